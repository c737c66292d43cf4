"""bench/bench_kernels.py --smoke runs to the end and writes its results (pytest -m bench)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.bench


def test_bench_kernels_smoke(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_kernels.py"),
                           "--smoke", "--no-plot", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "bench_kernels.json").read_text())
    assert (tmp_path / "bench_kernels.csv").exists()
    assert (tmp_path / "bench_kernels.md").exists()
    assert data["metadata"]["command"] and data["metadata"]["gpu"]
    rows = data["rows"]
    timed = [r for r in rows if r.get("ms")]
    assert {r["op"] for r in timed} >= {"local_step", "apply vote", "step"}
    assert {r["shape"] for r in timed} == {"flat", "gpt2"}
    assert all(r["gbps"] > 0 and r["of_copy"] > 0 for r in timed)
    gpt2 = [r for r in timed if r["shape"] == "gpt2"]
    assert gpt2 and all(r["tensors"] == 148 for r in gpt2)
    for r in timed:  # the bytes the docstring spells out
        if r["op"] == "local_step" and r["dtype"] == "fp32":
            assert r["bytes_per_elt"] == 8.125  # reads g and m, writes 1 bit (stages v2)
        if r["op"] == "step" and r["dtype"] == "fp32":
            assert r["bytes_per_elt"] == 28.5  # apply also reads g and m and writes m
    assert "### Targets" in proc.stdout
    assert "PASS" in proc.stdout or "FAIL" in proc.stdout or "not measured" in proc.stdout
