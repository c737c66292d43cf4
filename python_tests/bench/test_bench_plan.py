"""bench/bench_plan.py: the validation arithmetic on a generic-schema file, and --clusters."""

import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "bench"))

import bench_plan  # noqa: E402

from dlion_kernels.plan import model  # noqa: E402

INPUTS = {"params": 25_000_000, "ranks": 4, "ranks_per_node": 1, "inter_gbps": 1.0,
          "latency_us": 50.0, "fwd_ms": 100.0, "bwd_ms": 200.0, "opt_ms": 20.0,
          "algorithm": "ring"}


def _rows(factors):
    """Measured = predicted * factor, per strategy, in one configuration."""
    pred = {r.strategy: r.step_ms for r in model.predict(
        INPUTS["params"], 4, 1, **{k: v for k, v in INPUTS.items()
                                   if k not in ("params", "ranks", "ranks_per_node")})}
    return [{"config": "c1", "strategy": s, "measured_ms": pred[s] * f, "inputs": INPUTS}
            for s, f in factors.items()], pred


def test_validate_errors_and_fastest(tmp_path):
    rows, pred = _rows({"lion-allreduce": 1.10, "dlion-vote": 0.80, "dlion-vote-overlap": 1.0})
    result = bench_plan.validate(rows)
    errs = {r["strategy"]: r["error_pct"] for r in result["rows"]}
    assert errs["lion-allreduce"] == pytest.approx(100 * (1 / 1.1 - 1))
    assert errs["dlion-vote"] == pytest.approx(100 * (1 / 0.8 - 1))
    assert errs["dlion-vote-overlap"] == pytest.approx(0.0, abs=1e-9)
    s = result["summary"]
    assert s["median_abs_error"] == pytest.approx(1 - 1 / 1.1)
    assert s["worst_abs_error"] == pytest.approx(0.25)
    (fast,) = result["fastest"]
    assert fast["predicted_fastest"] == min(
        ("lion-allreduce", "dlion-vote", "dlion-vote-overlap"), key=pred.get)
    measured = {r["strategy"]: r["measured_ms"] for r in rows}
    assert fast["measured_fastest"] == min(measured, key=measured.get)
    assert fast["ok"] == (measured[fast["predicted_fastest"]]
                          <= 1.05 * measured[fast["measured_fastest"]])
    # The command line writes the results and the report states the targets.
    path = tmp_path / "measured.json"
    path.write_text(json.dumps({"rows": rows}))
    out = tmp_path / "out"
    assert bench_plan.main(["--measured", str(path), "--out", str(out), "--no-plot"]) == 0
    text = (out / "bench_plan.md").read_text()
    assert "median absolute error" in text and "(target <= 15%)" in text
    assert json.loads((out / "bench_plan.json").read_text())["summary"]["validation_rows"] == 3


def test_calibration_rows_are_not_judged():
    rows, _ = _rows({"lion-allreduce": 1.0, "dlion-vote": 1.0})
    rows.append({**rows[0], "config": "c1-comm", "role": "calibrate", "measured_ms": 1.0})
    result = bench_plan.validate(rows)
    assert result["summary"]["validation_rows"] == 2
    assert result["summary"]["worst_abs_error"] == pytest.approx(0.0, abs=1e-9)


def test_clusters_table_states_every_cluster_and_model():
    rows, text = bench_plan.clusters_table()
    assert len(rows) == len(bench_plan.CLUSTERS) * len(bench_plan.MODELS)
    for r in rows:
        assert r["fastest_ms"] <= r["allreduce_fp32_ms"]
        assert r["fwd_ms"] > 0 and r["bwd_ms"] == pytest.approx(2 * r["fwd_ms"])
    assert "| 4 x 8 H100 | GPT-2 124M |" in text
