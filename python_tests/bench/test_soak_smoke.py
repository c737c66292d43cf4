"""bench_soak.py --smoke runs both phases (DistributedLion, decentralized) to the end within the
leak limits (pytest -m bench)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.bench


def test_soak_smoke(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_soak.py"),
                           "--smoke", "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=1800, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "soak.json").read_text())
    assert data["metadata"]["ok"] and data["metadata"]["ranks"] == 2
    assert [(row["strategy"], row["rank"]) for row in data["rows"]] == [
        ("dlion", 0), ("dlion", 1), ("decentralized", 0), ("decentralized", 1)]
    for row in data["rows"]:
        assert row["fds_growth_pct"] <= 1.0 and row["threads_growth_pct"] <= 1.0
        assert row["rss_kb_growth_pct"] <= 1.0
        assert row["ckpt_files"] == 3  # two rank files and the manifest: old saves removed
    assert (tmp_path / "soak.csv").exists() and "| rank |" in (tmp_path / "soak.md").read_text()
