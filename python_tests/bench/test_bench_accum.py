"""bench/bench_accum.py --smoke runs to the end and writes its results (pytest -m bench)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.bench


def test_bench_accum_smoke(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_accum.py"),
                           "--smoke", "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "bench_accum.json").read_text())
    variants = {r["variant"] for r in data["rows"]}
    assert "copy fp32" in variants
    assert any(v.startswith("AccumAdamW fused") for v in variants)
    assert any(v.startswith("AccumLion fused") for v in variants)
    assert all(r["gb_s"] > 0 for r in data["rows"])
    assert (tmp_path / "bench_accum.md").exists()
