"""Shared test setup: backends to test, devices, and tolerances."""

import os

import pytest
import torch

# Without a GPU, Triton runs under its interpreter; this must be set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dlion_kernels.kernels import backends  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# One rounding of the storage dtype, relative (half an ulp each way between two roundings).
RTOL = {torch.float32: 0.0, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def backend_device(name: str) -> torch.device:
    """Where a backend's tests run: CUDA for cuda, CUDA for triton when there is a GPU."""
    if name == "cuda" or (name == "triton" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def fast_backends():
    """Every non-reference backend, skipped with the reason when it cannot run here."""
    params = []
    for name in ("cuda", "triton", "cpu"):
        problem = backends._problem(name, backend_device(name).type)
        marks = [pytest.mark.skip(reason=problem)] if problem else []
        params.append(pytest.param(name, marks=marks, id=name))
    return params


def assert_close_storage(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal within one rounding of the storage dtype (exact for fp32)."""
    assert actual.dtype == expected.dtype
    a, e = actual.detach().cpu().float(), expected.detach().cpu().float()
    torch.testing.assert_close(a, e, rtol=RTOL[actual.dtype], atol=0.0 if actual.dtype ==
                               torch.float32 else 1e-7, equal_nan=True)


# The ten test files that took longest (setup, call and teardown of their tests added up), after
# the run: where the suite's time goes, so that a slow file is seen when it lands.
_FILE_SECONDS: dict = {}


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if not _FILE_SECONDS:
        return
    terminalreporter.section("slowest test files")
    slowest = sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:10]
    for path, seconds in slowest:
        terminalreporter.write_line(f"{seconds:8.1f} s  {path}")
    terminalreporter.write_line(f"{sum(_FILE_SECONDS.values()):8.1f} s  all {len(_FILE_SECONDS)} "
                                "files (summed over workers)")


# The longest files start first: the workers take whole files in collection order, and a long
# file that starts last keeps one worker busy alone at the end. Paths relative to this folder.
LONGEST_FIRST = ("bench/test_bench_smoke.py", "demo/test_digits.py", "test_checkpoint.py",
                 "optim/test_fsdp.py", "kernels/test_backends.py",
                 "exchange/test_step_distributed.py", "bench/test_bench_overlap_smoke.py",
                 "exchange/test_step.py", "bench/test_bench_elastic_smoke.py",
                 "test_fault_matrix.py", "bench/test_bench_training_smoke.py",
                 "kernels/test_native.py", "bench/test_bench_outer_study_smoke.py",
                 "exchange/test_step_failures.py")
_HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config, items):
    def first(item):
        rel = os.path.relpath(str(item.path), _HERE).replace(os.sep, "/")
        return LONGEST_FIRST.index(rel) if rel in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=first)  # stable: each file's own order, and the other files', are kept


@pytest.fixture(scope="session", autouse=True)
def _demo_ranks_from_the_rank_server():
    """The demos' ranks, in the tests, come from the tests' rank server (torch imported once per
    pytest process) like every other test's, instead of a spawned interpreter each; the demo's
    own launcher is tested in test_launch.py and by the torchrun test."""
    import rankserver

    from dlion_kernels.demo import common

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(common, "spawn", rankserver.run)
        yield
