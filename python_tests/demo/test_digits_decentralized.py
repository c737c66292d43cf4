"""``python -m dlion_kernels.demo --strategy decentralized`` on real gloo workers."""

from dlion_kernels.demo import digits as demo


def test_demo_decentralized_ring_accum_adamw(capsys):
    args = ["--workers", "2", "--epochs", "4", "--hidden", "64", "--quiet",
            "--strategy", "decentralized", "--topology", "ring", "--optimizer", "accum-adamw"]
    rows = {r["optimizer"]: r for r in demo.main(args)}
    assert list(rows) == ["AdamW + all-reduce", "D-Lion vote", "Decentralized ring accum-adamw"]
    dec, adamw = rows["Decentralized ring accum-adamw"], rows["AdamW + all-reduce"]
    assert dec["test_accuracy"] >= 0.70
    assert abs(dec["test_accuracy"] - adamw["test_accuracy"]) <= 0.08
    # a pair all-reduce of fp32 parameters: 2 (k-1)/k * 4d with k = 2, as the full all-reduce
    # of gradients on 2 workers
    assert dec["bytes_per_step"] == 4 * dec["numel"]
    assert dec["ranks_in_sync"]  # evaluated on the average over ranks
    assert "| Decentralized ring accum-adamw |" in capsys.readouterr().out
