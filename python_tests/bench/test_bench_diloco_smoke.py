"""bench_diloco.py --smoke runs to the end and writes its results (pytest -m bench); the
torchft variant runs when torchft is installed and is skipped with the reason otherwise."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.bench


def test_bench_diloco_smoke(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_diloco.py"),
                           "--smoke", "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "diloco_torchft.json").read_text())
    assert (tmp_path / "summary.md").exists()
    variants = {r["variant"] for r in data["rows"]}
    assert {"dk-nesterov", "dk-dlion-vote", "dk-dlion-average"} <= variants
    rows = {r["variant"]: r for r in data["summary"]}
    # 1 bit per parameter each way against an fp32 all-reduce: about 32x fewer bytes per sync
    assert rows["dk-dlion-vote"]["bytes_per_sync"] * 20 < rows["dk-nesterov"]["bytes_per_sync"]
    assert all(r["ranks_agree"] for r in data["summary"])
    if importlib.util.find_spec("torchft") is None:
        assert "torchft-nesterov" in data["skipped"]
    else:
        assert data["trajectory_dk_vs_torchft"]["bit_identical"]
