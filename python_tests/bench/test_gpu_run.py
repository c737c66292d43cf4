"""bench/gpu_run.sh without a GPU (GPU_RUN_DRY=1): every GPU step is skipped with its reason,
the machine's description is written, a step that runs and fails is recorded and fails the
script, and --short packs what comes back from the device machine (pytest -m bench)."""

import os
import subprocess
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "gpu_run.sh")
pytestmark = pytest.mark.bench
GPU_STEPS = ["bench", "accum", "tests", "compile", "nccl", "demo", "sim"]  # in the order they run


def _gpu_run(out, *args, python=sys.executable):
    env = {**os.environ, "OUT": str(out), "GPU_RUN_DRY": "1", "PYTHON": python}
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT, check=False)


def _steps(out):
    lines = (out / "steps.tsv").read_text().splitlines()
    assert lines[0].split("\t") == ["step", "status", "exit_code", "seconds", "log"]
    return {row[0]: row for row in (line.split("\t") for line in lines[1:])}


def test_dry_run_skips_every_gpu_step_and_describes_the_machine(tmp_path):
    out = tmp_path / "run"
    tar = tmp_path / "run.tar.gz"
    proc = _gpu_run(out, "--steps", ",".join(GPU_STEPS), "--tar", str(tar))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    info = (out / "info.txt").read_text()
    import torch

    for line in ("date: ", "command: ", "git commit: ", "host: ", "python: ",
                 f"torch: {torch.__version__}", "triton: ", "lion_pytorch: ", "nvcc: ",
                 "nvidia-smi", "dlion_kernels native: ", "gpu: dry run (GPU_RUN_DRY=1)"):
        assert line in info, f"{line!r} missing from info.txt:\n{info}"
    assert "--steps bench,accum,tests,compile,nccl,demo,sim" in info
    steps = _steps(out)
    assert list(steps) == GPU_STEPS
    for name in GPU_STEPS:
        assert steps[name][1] == "skipped" and "GPU_RUN_DRY" in steps[name][4], steps[name]
        assert not (out / f"{name}.log").exists()
    with tarfile.open(tar) as t:
        names = t.getnames()
    assert {"run/info.txt", "run/steps.tsv"} <= set(names), names


def test_a_failing_step_is_recorded_and_fails_the_gpu_run(tmp_path):
    """The build step (no GPU needed) through a python whose pip fails: logged with its command,
    'failed' with the exit code in steps.tsv, exit code 1; the other steps still run."""
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\nif [ "$1" = -m ] && [ "$2" = pip ]; then echo "pip $*"; '
                    f'exit 3; fi\nexec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    out = tmp_path / "run"
    proc = _gpu_run(out, "--steps", "build,nccl", python=str(fake))
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = _steps(out)
    assert steps["build"][1:3] == ["failed", "3"], steps["build"]
    assert steps["nccl"][1] == "skipped"
    log = (out / "build.log").read_text()
    assert "--no-build-isolation --no-deps -e ." in log and "pip -m pip install" in log


def test_bad_arguments(tmp_path):
    proc = _gpu_run(tmp_path / "x", "--steps", "tests,warp")
    assert proc.returncode == 2 and "unknown step 'warp'" in proc.stderr


def test_short_plan_packs_what_comes_back(tmp_path):
    """--short: build, bench, accum and tests in that order within one budget, the results in
    a folder of their own and, in $OUT, at most the 8 files the device tool brings back (the
    whole folder packed, and the summaries). The build goes through a python whose pip only
    prints (nothing is installed here)."""
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\nif [ "$1" = -m ] && [ "$2" = pip ]; then echo "pip $*"; '
                    f'exit 0; fi\nexec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    out = tmp_path / "out"
    proc = _gpu_run(out, "--short", python=str(fake))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    back = sorted(p.name for p in out.iterdir())
    assert back == ["gpu-run.tar.gz", "info.txt", "steps.tsv"], back  # no GPU: no bench files
    assert len(back) <= 8
    steps = _steps(out)
    assert list(steps) == ["build", "bench", "accum", "tests"]
    assert steps["build"][1] == "ok" and all(steps[s][1] == "skipped" for s in GPU_STEPS[:3])
    with tarfile.open(out / "gpu-run.tar.gz") as t:
        names = t.getnames()
    assert any(n.endswith("/build.log") for n in names), names
