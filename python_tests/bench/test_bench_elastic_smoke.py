"""bench_elastic.py --smoke runs to the end and writes its results (pytest -m bench): torchft's
Manager with an fp32 all-reduce and dk.DistributedLion(manager=) through the same kill and
restart, and the plain dk.DistributedLion in a gloo group without a failure, 3 replicas on this
machine's loopback, a tiny MLP."""

import json
import os
import subprocess
import sys

import pytest

from dlion_kernels.kernels.layout import HEADER_WORDS, num_blocks, shard_blocks

pytest.importorskip("torchft")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.bench


def test_bench_elastic_smoke(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_elastic.py"),
                           "--smoke", "--no-plot", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "summary.md").exists()
    data = json.loads((tmp_path / "elastic.json").read_text())
    rows = {r["variant"]: r for r in data["rows"]}
    assert set(rows) == {"torchft-allreduce", "dk-dlion", "dk-dlion-plain"}
    d = 64 * 128 * 2 + 128 + 64  # the smoke MLP
    for r in rows.values():
        assert "failed" not in r, r
        assert r["final_step"] >= 12
    for r in (rows["torchft-allreduce"], rows["dk-dlion"]):
        assert r["steps_lost"] == 1  # the step in flight at the kill, nothing more
        assert r["heal_s"] > 0 and r["first_vote_step"] > 6
    # fp32 ring all-reduce against 1 bit per parameter each way (32-element words, a 2-word
    # header per all_to_all chunk), n = 3 replicas
    assert rows["torchft-allreduce"]["bytes_per_step_3"] == round(2 * 2 / 3 * 4 * d)
    blocks = sum(num_blocks(k) for k in (64 * 128, 128, 128 * 64, 64))
    assert rows["dk-dlion"]["bytes_per_step_3"] == 4 * 2 * (HEADER_WORDS + 2 * shard_blocks(
        blocks, 3))
    assert rows["dk-dlion"]["bytes_per_step_2"] == 4 * 1 * (HEADER_WORDS + 2 * shard_blocks(
        blocks, 2))

    # the plain D-Lion: no failure, every step committed with all 3, the elastic one's wire
    plain = rows["dk-dlion-plain"]
    for key in ("steps_lost", "heal_s", "ready_s", "first_vote_step", "ms_per_step_2",
                "bytes_per_step_2"):
        assert plain[key] is None, (key, plain[key])
    assert plain["final_step"] == 12 and plain["steps_run"] == plain["committed_steps"] == 12
    assert plain["intervals_2"] == 0 and plain["intervals_3"] == 11  # after the warmup step
    curve = data["curves"]["dk-dlion-plain-0-0"]
    assert [p[1] for p in curve] == list(range(1, 13))
    assert all(p[2] == 3 and p[3] is True for p in curve)
    assert plain["bytes_per_step_3"] == rows["dk-dlion"]["bytes_per_step_3"]
    assert plain["ms_per_step_3"] > 0
    summary = {s["variant"]: s for s in data["summary"]}
    ratio = rows["dk-dlion"]["ms_per_step_3"] / plain["ms_per_step_3"]
    assert summary["dk-dlion"]["plain_time_ratio"] == pytest.approx(ratio)
    text = (tmp_path / "summary.md").read_text()
    assert "no failure injected" in text and f"{ratio:.2f}x" in text
    # every run's raw records, one line per step attempt, are kept next to the results
    for label in ("torchft-allreduce-0-0", "dk-dlion-0-0", "dk-dlion-plain-0-0"):
        lines = (tmp_path / "runs" / label / "replica0.jsonl").read_text().splitlines()
        assert sum('"step"' in line for line in lines) >= 12, label
