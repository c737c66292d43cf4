"""The benchmarks' --smoke modes run to the end and write their results (pytest -m bench)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.bench


def _run(script, out, timeout=180):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), "--smoke",
                           "--out", str(out)], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_bench_comm_smoke(tmp_path):
    stdout = _run("bench_comm.py", tmp_path)
    data = json.loads((tmp_path / "bench_comm.json").read_text())
    assert (tmp_path / "bench_comm.csv").exists()
    assert data["metadata"]["command"] and data["metadata"]["gpu"]
    rows = data["rows"]
    assert {r["variant"] for r in rows} >= {"dlion vote/binary", "all_reduce fp32"}
    for r in rows:
        if r["variant"] == "dlion vote/binary":
            # SPEC §2: 2 (n-1)/n * d/8 plus a few words of padding
            assert 0 <= r["bytes_sent"] - r["bytes_formula"] <= 16 * r["n"]
    assert "| n |" in stdout


def test_bench_network_smoke(tmp_path):
    stdout = _run("bench_network.py", tmp_path)
    if "skipped" in stdout.splitlines()[0]:
        pytest.skip(stdout.strip())
    data = json.loads((tmp_path / "bench_network.json").read_text())
    assert data["links"] and data["links"][0]["measured_gbit"] > 0
    assert {r["key"] for r in data["rows"]} >= {"lion_allreduce_fp32", "dlion_vote_binary"}
