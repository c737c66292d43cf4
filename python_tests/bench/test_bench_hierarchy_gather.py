"""bench_hierarchy_gather.py --smoke runs to the end and writes its results (pytest -m bench)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.bench


def test_bench_hierarchy_gather_smoke(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_hierarchy_gather.py"),
                           "--smoke", "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "hierarchy_gather.json").read_text())["rows"]
    assert {r["variant"] for r in rows} == {"aggregate", "params"}
    for r in rows:
        assert r["ms"] > 0
        if r["variant"] == "aggregate":  # 1 bit per element against 32 or 16 in the params
            other = next(x for x in rows if x["variant"] == "params" and x["d"] == r["d"]
                         and x["dtype"] == r["dtype"])
            assert r["intra_bytes_sent"] * 15 < other["intra_bytes_sent"]
    assert "gather aggregate vs gather parameters" in proc.stdout
