"""bench_sim_study.py --smoke runs each study end to end on simulated workers (pytest -m bench):
4 steps, k = 2, H = 1, one lr, one seed, both tasks. Each writes its results, tunes on the held-out
seed only, and reports the bytes the exchange formulas give."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
pytestmark = pytest.mark.bench

from dlion_kernels.accounting import ring_all_reduce_bytes  # noqa: E402
from dlion_kernels.simulate import dlion_step_bytes  # noqa: E402


def _study(tmp_path, study):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_sim_study.py"),
                           study, "--smoke", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert runs and all(not r["diverged"] for r in runs)
    assert {r["seed"] for r in runs} == {0, 100}
    return runs


def _rows(tmp_path):
    return json.loads((tmp_path / "study.json").read_text())["rows"]


def test_sweep_smoke(tmp_path):
    runs = _study(tmp_path, "sweep")
    assert {r["method"] for r in runs} == {"dlion", "dlion-ef-decay-0.5"}
    assert {(r["H"], r["steps"]) for r in runs} == {(1, 1), (1, 4)}
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    assert sweep["chosen"]["method"] in {"dlion", "dlion-ef-decay-0.5"}
    for row in sweep["rows"]:  # the chosen rule ran on the reported seed in every setting
        if row["method"] == sweep["chosen"]["method"]:
            assert row["rule_excess"] >= 0 and row["rule_lr"] in map(float, row["eval"])
    assert sweep["plain"]["method"] == "dlion"
    assert "chosen on the held-out seed" in (tmp_path / "sweep.md").read_text()


def test_per_step_smoke(tmp_path):
    runs = _study(tmp_path, "per-step")
    assert {r["task"] for r in runs} == {"chars", "stdlib"}
    rows = _rows(tmp_path)
    for r in rows:
        if r["method"] in ("adamw", "lion"):
            assert r["bytes_per_sync"] == round(ring_all_reduce_bytes(2, 4 * r["numel"]))
        else:
            mode, votes = r["method"].split("-")[1:]
            sizes = [p.numel() for p in _model(r["task"]).parameters()]
            assert r["bytes_per_sync"] == dlion_step_bytes(sizes, 2, mode, votes)
    assert len(rows) == 2 * 4  # AdamW, Lion and two D-Lion modes per task
    assert (tmp_path / "loss_vs_bytes-per-step-stdlib-4.png").exists()


def test_local_smoke(tmp_path):
    _study(tmp_path, "local")
    rows = _rows(tmp_path)
    assert {(r["task"], r["method"]) for r in rows} == {
        (t, m) for t in ("chars", "stdlib") for m in ("nesterov", "dlion-ef-decay-0.5",
                                                      "sparseloco")}
    for r in rows:
        nes = next(x for x in rows if x["task"] == r["task"] and x["method"] == "nesterov")
        if r["method"].startswith("dlion"):
            assert r["bytes_per_sync"] * 31 < nes["bytes_per_sync"]  # 1 bit each way
        assert r["syncs"] == 4  # H = 1
    assert "## Targets" in (tmp_path / "study.md").read_text()


def test_budgets_smoke(tmp_path):
    runs = _study(tmp_path, "budgets")
    assert {r["task"] for r in runs} == {"chars"}
    assert {r["steps"] for r in runs} == {1, 4}


def _model(task):
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import sim_tasks

    return sim_tasks.TASKS[task].make_model(0)
