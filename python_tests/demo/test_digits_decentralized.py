"""``python -m dlion_kernels.demo --strategy ... decentralized-ring-accum-adamw`` on real gloo
workers."""

from dlion_kernels.demo import digits as demo


def test_demo_decentralized_ring_accum_adamw(capsys):
    args = ["--workers", "2", "--epochs", "4", "--hidden", "64", "--quiet",
            "--strategy", "adamw-allreduce", "dlion-vote", "decentralized-ring-accum-adamw"]
    rows = {r["strategy"]: r for r in demo.main(args)}
    assert list(rows) == ["adamw-allreduce", "dlion-vote", "decentralized-ring-accum-adamw"]
    dec, adamw = rows["decentralized-ring-accum-adamw"], rows["adamw-allreduce"]
    assert dec["test_accuracy"] >= 0.70
    assert abs(dec["test_accuracy"] - adamw["test_accuracy"]) <= 0.08
    # a pair all-reduce of fp32 parameters: 2 (k-1)/k * 4d with k = 2, as the full all-reduce
    # of gradients on 2 workers
    assert dec["bytes_per_step"] == 4 * dec["numel"]
    assert dec["ranks_in_sync"]  # evaluated on the average over ranks
    assert "| Decentralized ring accum-adamw |" in capsys.readouterr().out
