"""bench_outer_study.py --smoke runs every method end to end on 2 gloo workers and writes its
results (pytest -m bench): tuned on the held-out seed, every method evaluated at one of its
trial lrs, the ranks in agreement, and the bytes each outer step states."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.bench


def test_bench_outer_study_smoke(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_outer_study.py"),
                           "--smoke", "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in ("study.md", "study.json", "runs.jsonl", "meta.json"):
        assert (tmp_path / name).exists(), name
    runs = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    tune = [r for r in runs if r["phase"] == "tune"]
    ev = [r for r in runs if r["phase"] == "eval"]
    assert all(r["seed"] != 0 for r in tune) and all(r["seed"] == 0 for r in ev)
    assert all(r["ranks_agree"] and not r["diverged"] for r in runs)
    rows = {(r["method"], r["H"] or 0): r for r in json.loads(
        (tmp_path / "study.json").read_text())["rows"]}
    methods = {"adamw", "dlion-step", "nesterov", "sparseloco", "dlion", "dlion-ef",
               "dlion-scale", "dlion-ef-scale", "dlion-ef-tern", "dlion-ef-decay",
               "dlion-ef-decay-0.5"}
    assert {m for m, _ in rows} == methods
    for (m, H), r in rows.items():
        trials = {t["lr"]: t["val_loss"] for t in tune if t["method"] == m and t["H"] == H}
        assert len(trials) == 2 and r["lr"] == min(trials, key=trials.get)
    numel = json.loads((tmp_path / "meta.json").read_text())["numel"]
    fp32 = 2 * (2 - 1) / 2 * 4 * numel  # the ring all-reduce of 2 ranks
    for H in (8,):
        nes = rows[("nesterov", H)]["bytes_per_sync"]
        assert fp32 <= nes < fp32 + 64
        assert rows[("dlion", H)]["bytes_per_sync"] * 32 <= nes + 32 * 64  # 1 bit each way
        assert rows[("dlion-ef", H)]["bytes_per_sync"] == rows[("dlion", H)]["bytes_per_sync"]
        assert rows[("dlion-ef-decay", H)]["bytes_per_sync"] == rows[("dlion", H)]["bytes_per_sync"]
        assert rows[("dlion-ef-tern", H)]["bytes_per_sync"] > rows[("dlion", H)]["bytes_per_sync"]
        assert rows[("sparseloco", H)]["bytes_per_sync"] < rows[("dlion", H)]["bytes_per_sync"]
    assert rows[("adamw", 0)]["bytes_per_sync"] == round(fp32)
    assert (tmp_path / "loss_vs_bytes.png").exists()
