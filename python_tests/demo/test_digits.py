"""The main job, ``python -m dlion_kernels.demo``, on real gloo workers with small settings."""

import os
import subprocess
import sys

import pytest

from dlion_kernels.demo import digits as demo

# Measured with these settings (3 workers, 8 epochs, hidden 64) for seeds 0, 1, 2: D-Lion vote
# 82.2%, 83.9%, 82.2% test accuracy; Lion + fp32 all-reduce 82.5%, 84.7%, 82.5%; chance is 10%.
SMALL = ["--workers", "3", "--epochs", "8", "--hidden", "64", "--quiet"]
MIN_ACCURACY = 0.70
MAX_GAP_TO_ALLREDUCE = 0.05


def test_demo_trains_and_reports(tmp_path, capsys):
    plot = tmp_path / "loss.png"
    rows = {r["strategy"]: r for r in demo.main(SMALL + ["--plot", str(plot)])}
    assert list(rows) == list(demo.DEFAULT_STRATEGIES)
    vote, average = rows["dlion-vote"], rows["dlion-average"]
    lion = rows["lion-allreduce"]
    assert vote["test_accuracy"] >= MIN_ACCURACY
    assert average["test_accuracy"] >= MIN_ACCURACY
    assert abs(vote["test_accuracy"] - lion["test_accuracy"]) <= MAX_GAP_TO_ALLREDUCE
    assert all(r["ranks_in_sync"] for r in rows.values())
    # 1 bit up and 1 bit down per parameter against 2 (n-1)/n * 32 bits: about 1/32 of the bytes.
    assert 30 * vote["bytes_per_step"] < lion["bytes_per_step"] < 33 * vote["bytes_per_step"]
    assert vote["bytes_per_step"] < average["bytes_per_step"] < lion["bytes_per_step"] / 10
    assert rows["adamw-allreduce"]["bytes_per_step"] == lion["bytes_per_step"]
    out = capsys.readouterr().out
    assert "| D-Lion vote |" in out and "test accuracy" in out
    assert plot.stat().st_size > 10_000


def test_demo_under_torchrun():
    """The torchrun path: the launcher starts the ranks, the demo joins them (gloo on CPU)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--standalone", "-m", "dlion_kernels.demo", "--epochs", "1", "--hidden",
           "32", "--quiet"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "| strategy (2 workers) |" in proc.stdout
    assert proc.stdout.count("| D-Lion vote |") == 1  # rank 0 alone prints the table


def test_demo_hierarchy_rows(capsys):
    """Hierarchical D-Lion on 4 workers (2 nodes of 2) trains and sends fewer bytes between
    nodes than flat D-Lion sends in all."""
    # Measured with these settings (random seed 0): D-Lion vote 91.9%, hierarchical vote 92.2%,
    # hierarchical average 92.5%, Lion + all-reduce 92.2%.
    args = ["--workers", "4", "--epochs", "3", "--hidden", "32", "--lion-lr", "3e-3", "--quiet",
            "--strategy", "dlion-vote", "dlion-vote-hier", "dlion-average-hier",
            "--ranks-per-node", "2"]
    rows = {r["strategy"]: r for r in demo.main(args)}
    flat, hier = rows["dlion-vote"], rows["dlion-vote-hier"]
    assert list(rows) == ["dlion-vote", "dlion-vote-hier", "dlion-average-hier"]
    assert "| D-Lion vote, hierarchy |" in capsys.readouterr().out
    assert all(r["ranks_in_sync"] for r in rows.values())
    assert hier["test_accuracy"] >= 0.8  # chance is 10%
    assert abs(hier["test_accuracy"] - flat["test_accuracy"]) <= 0.05
    # Inter-node: 1/L of 2 (N-1)/N d/8 for N = 2 voters; flat sends 2 (n-1)/n d/8 with n = 4.
    d = flat["numel"]
    assert hier["inter_node_bytes_per_step"] <= d / 16 + 64
    assert 2.5 * hier["inter_node_bytes_per_step"] < flat["bytes_per_step"]


def test_demo_strategy_auto(tmp_path, monkeypatch, capfd):
    """--strategy auto trains the one strategy the runtime model ranks first among those it
    predicts, from the inputs in $DLION_PLAN (a measurement file)."""
    import json

    from dlion_kernels import plan

    inputs = dict(inter_gbps=0.05, latency_us=50.0, fwd_ms=0.2, bwd_ms=0.4, opt_ms=0.1)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"inputs": inputs}))
    monkeypatch.setenv("DLION_PLAN", str(path))
    numel = sum(p.numel() for p in demo.make_model(32, 0).parameters())
    ranked = plan.rank_strategies(numel, 2, 1, bucket_mb=demo.BUCKET_MB, **inputs)
    expected, row = ranked[0]
    assert expected.startswith("dlion-vote")  # 1 bit per parameter on a 50 Mbit/s link
    assert {"lion-allreduce", "dlion-average"} <= {slug for slug, _ in ranked}
    # local steps change the training (a sync every H steps): ranked only when named
    assert not any(slug.startswith("diloco") for slug, _ in ranked)
    named = plan.rank_strategies(numel, 2, 1, allowed=["dlion-vote", "diloco-dlion"],
                                 bucket_mb=demo.BUCKET_MB, **inputs)
    assert [slug for slug, _ in named] == ["diloco-dlion", "dlion-vote"]
    trained = demo.main(["--workers", "2", "--epochs", "1", "--hidden", "32", "--quiet",
                         "--strategy", "auto"])
    assert [r["strategy"] for r in trained] == [expected]
    assert trained[0]["ranks_in_sync"]
    out = capfd.readouterr().out  # rank 0's process printed the predictions
    assert f"chosen: {expected} (the model's row {row.strategy})" in out
    assert "| lion-allreduce |" in out


def test_demo_cli_errors(capsys):
    """Unknown slugs and auto among other strategies are refused before any worker starts."""
    for argv, match in [(["--strategy", "D-Lion vote"], "unknown strategy 'D-Lion vote'"),
                        (["--strategy", "auto", "dlion-vote"], "give it alone"),
                        (["--workers", "0"], "--workers must be >= 1")]:
        with pytest.raises(SystemExit) as exc:
            demo.parse_args(argv)
        assert exc.value.code == 2
        assert match in capsys.readouterr().err


def test_strategies_that_cannot_run_are_skipped(capfd):
    """A strategy that does not fit the workers is skipped with the reason; the rest train."""
    rows = demo.main(["--workers", "3", "--epochs", "1", "--hidden", "16", "--quiet",
                      "--strategy", "decentralized-ring-accum-adamw", "dlion-vote"])
    assert [r["strategy"] for r in rows] == ["dlion-vote"]
    assert "skipping decentralized-ring-accum-adamw: topology 'ring' needs an even number of " \
        "ranks, got 3" in capfd.readouterr().out  # printed by rank 0's process
