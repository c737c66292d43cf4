"""bench_overlap.py --smoke and --timeline --smoke on the emulated network (pytest -m bench).

Both need root (network namespaces); without it the script prints "skipped" and the tests skip.
Each launch starts 2 rank processes (python + torch): ~2 min for the four launches of --smoke at
load ~15 on 2 cores, ~40 s for --timeline --smoke (one launch per network).
"""

import gzip
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.bench
SCRIPT = os.path.join("bench", "bench_overlap.py")


def _run(args, timeout=900):
    proc = subprocess.run([sys.executable, SCRIPT] + args, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if "skipped" in proc.stdout.splitlines()[0]:
        pytest.skip(proc.stdout.strip())
    return proc.stdout


def test_bench_overlap_smoke(tmp_path):
    stdout = _run(["--smoke", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "bench_overlap.json").read_text())
    assert (tmp_path / "bench_overlap.csv").exists() and (tmp_path / "bench_overlap.md").exists()
    assert data["metadata"]["command"] and not data["failed"]
    rows = data["rows"]
    assert [r["variant"] for r in rows] == ["no_comm", "dlion", "dlion_overlap",
                                            "dlion_ddp_hook"]  # first round: no rotation
    for r in rows:
        assert r["step_ms"] > 0 and r["fwd_ms"] > 0 and r["bwd_ms"] > 0 and r["opt_ms"] > 0
    by = {r["variant"]: r for r in rows}
    assert by["no_comm"]["bytes_sent"] == 0 and by["dlion"]["bytes_sent"] > 0
    assert by["dlion_overlap"]["buckets"] >= 2 and by["dlion_ddp_hook"]["buckets"] >= 2
    ratios = {(r["variant"], r["ratio"]): r for r in data["ratios"]}
    for v in ("dlion", "dlion_overlap", "dlion_ddp_hook"):
        r = ratios[v, "vs_no_comm"]
        assert r["median"] == pytest.approx(by[v]["step_ms"] / by["no_comm"]["step_ms"])
    assert ("dlion_overlap", "overlap_vs_ddp_hook") in ratios
    assert any("overlap=True / DDP hook" in line for line in data["targets"])
    assert "Ratios (median and spread over rounds)" in stdout


def test_bench_overlap_timeline_smoke(tmp_path):
    _run(["--timeline", "--smoke", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "timeline.json").read_text())
    (name, report), = data["networks"].items()
    assert set(report) >= {"dlion_overlap", "dlion_ddp_hook", "buckets", "summary"}
    slug = name.replace(" ", "-").replace("/", "")
    assert (tmp_path / f"timeline-{slug}.png").stat().st_size > 10_000
    with gzip.open(tmp_path / f"traces-{slug}.json.gz", "rt") as f:
        traced = json.load(f)
    assert [c["variant"] for c in traced] == ["dlion_overlap", "dlion_ddp_hook"]
    for case in traced:
        for events in case["ranks"]:
            kinds = {e["kind"] for e in events}
            assert kinds >= {"step_start", "fwd_end", "bwd_end", "step_end", "grad", "add",
                             "local_step", "collective", "apply"}, kinds
            done = [e for e in events if e["kind"] == "collective"]
            assert all(e["done"] >= e["t"] for e in done)
    # the plots can be drawn again from the stored traces
    os.remove(tmp_path / f"timeline-{slug}.png")
    _run(["--replot", str(tmp_path)])
    assert (tmp_path / f"timeline-{slug}.png").exists()
