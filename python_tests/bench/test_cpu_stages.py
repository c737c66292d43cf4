"""pytest-benchmark CPU microbenchmarks: each stage and a whole step, per CPU backend.

For the backends ``cpu`` (native) and ``torch`` (reference), on one flat fp32 tensor of
``$DLION_BENCH_NUMEL`` elements (suffixes k, M, G; default 64M: smaller working sets partly fit
in this VM's caches, and pytest-benchmark repeats each call on the same tensors), it times

- ``local_step``        votes = binary
- ``tally_n8``          8 binary vote vectors -> vote/binary aggregate
- ``apply_vote``        vote/binary aggregate applied to the parameters
- ``fused_dlion_step``  ``dlion_kernels.fused_dlion_step`` in one process (vote/binary)

and ``copy``, ``dst.copy_(src)`` of ``$DLION_BENCH_NUMEL`` fp32 elements (8 B/element), the
bandwidth to compare the stages' GB/s with.

with the call signatures and tensors of bench_kernels.py (``Workload``, ``stage_fns``). Each
result's ``extra_info`` holds the bytes per element the variant must move (bench_kernels'
``bytes_per_elt``: 8.125, 1.125, 20.125 and 28.5 for fp32 (kernel stages v2); the step is
charged like bench_kernels' ``step``, its non-finite check of the gradient is not counted), the
bytes, and the GB/s of the median. A backend that cannot run here is skipped with the reason.
The torch reference is timed in 3 rounds of 1 call (1.5-4 s per call at 64M).

It is marked ``timing`` (deselected by pyproject's addopts), so it runs only with ``-m timing``
(``bench/run_all.py``'s ``pytest`` part runs it so):

    python -m pytest python_tests/bench/test_cpu_stages.py -m timing --benchmark-json=out.json
    DLION_BENCH_NUMEL=256k python -m pytest python_tests/bench/test_cpu_stages.py -m timing  # quick
"""

from __future__ import annotations

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "bench"))
import bench_kernels as bk  # noqa: E402  (its import of common puts the repository on sys.path)
import common  # noqa: E402
import torch  # noqa: E402

import dlion_kernels  # noqa: E402
from dlion_kernels.kernels import backends as dk_backends  # noqa: E402

pytestmark = pytest.mark.timing

NUMEL = common.parse_count(os.environ.get("DLION_BENCH_NUMEL", "64M"))
DTYPE = torch.float32
BACKENDS = ["cpu", "torch"]
# test id -> the op whose bytes bench_kernels.bytes_per_elt counts
STAGES = {"local_step": "local_step", "tally_n8": "tally vote n=8", "apply_vote": "apply vote",
          "fused_dlion_step": "step"}
TORCH_ROUNDS = 3


@pytest.fixture(scope="module")
def workload():
    gen = torch.Generator().manual_seed(0)
    w = bk.Workload([(NUMEL,)], DTYPE, torch.device("cpu"), gen)
    yield w
    w.free()


def _fn(name: str, stage: str, w):
    if stage == "fused_dlion_step":
        def step():
            dlion_kernels.fused_dlion_step(w.params, w.grads, w.exp_avgs, lr=bk.LR,
                                           betas=bk.BETAS, weight_decay=bk.WD, mode="vote",
                                           votes="binary", backend=name)

        return step
    return bk.stage_fns(dk_backends.get(name), w)[STAGES[stage]]


@pytest.mark.parametrize("stage", list(STAGES))
@pytest.mark.parametrize("name", BACKENDS)
def test_stage(benchmark, workload, name, stage):
    problem = dk_backends._problem(name, "cpu")
    if problem is not None:
        pytest.skip(f"{name}: {problem}")
    fn = _fn(name, stage, workload)
    bpe = bk.bytes_per_elt(STAGES[stage], DTYPE)
    benchmark.group = f"{stage} {common.human_count(NUMEL)} fp32"
    benchmark.extra_info.update(backend=name, stage=stage, numel=NUMEL, dtype="fp32",
                                bytes_per_elt=bpe, bytes=bpe * NUMEL,
                                torch_threads=torch.get_num_threads())
    fn()  # warm-up outside the timing: first touch, thread pool, the backend's import
    if name == "torch":  # the reference: 1.5-4 s per call at 64M
        benchmark.pedantic(fn, rounds=TORCH_ROUNDS, iterations=1)
    else:
        benchmark(fn)
    if benchmark.stats is not None:  # None under --benchmark-disable
        median = benchmark.stats.stats.median
        benchmark.extra_info["gbps"] = bpe * NUMEL / median / 1e9


def test_copy(benchmark):
    """The same-run reference: a device-to-device copy, 4 bytes read + 4 written per element."""
    src = torch.randn(NUMEL)
    dst = torch.empty_like(src)
    benchmark.group = f"copy {common.human_count(NUMEL)} fp32"
    benchmark.extra_info.update(backend="torch", stage="copy", numel=NUMEL, dtype="fp32",
                                bytes_per_elt=8.0, bytes=8.0 * NUMEL,
                                torch_threads=torch.get_num_threads())
    dst.copy_(src)
    benchmark(dst.copy_, src)
    if benchmark.stats is not None:
        benchmark.extra_info["gbps"] = 8.0 * NUMEL / benchmark.stats.stats.median / 1e9
