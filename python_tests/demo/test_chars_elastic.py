"""``python -m dlion_kernels.demo --task chars --elastic`` at a tiny size: 3 replicas under a
torchft Lighthouse, one killed (SIGKILL) in the middle of a step and restarted later. The report
must agree with itself and with the wire format: the healed replica ends bit-identical to the
others, the survivors lose at most one step to the failure, and every committed step's bytes are
the vote/binary figure for its participants."""

import math

import pytest

pytest.importorskip("torchft")

from dlion_kernels.demo import chars, cli  # noqa: E402
from dlion_kernels.demo import elastic as demo  # noqa: E402
from dlion_kernels.kernels.layout import HEADER_WORDS, num_blocks, shard_blocks  # noqa: E402

TINY = ["--task", "chars", "--elastic", "--iters", "16", "--kill-at", "5", "--restart-at", "8",
        "--eval-every", "4", "--batch-size", "4", "--context", "32", "--d-model", "32",
        "--heads", "2", "--layers", "1", "--eval-windows", "16", "--seeds", "0", "--quiet"]


def _vote_binary_bytes(numels, n):
    """(n-1) all_to_all chunks of the 2-word header and one bit plane of a shard, then (n-1)
    gathered shards of the 1-plane aggregate, in 4-byte words."""
    shard = shard_blocks(sum(num_blocks(k) for k in numels), n)
    return 4 * (n - 1) * (HEADER_WORDS + 2 * shard)


def test_elastic_chars_kill_restart_heal(tmp_path):
    rep = cli.main(TINY + ["--json", str(tmp_path / "rep.json")])
    args = demo.parse_args(TINY)
    numels = [p.numel() for p in chars.make_model(args, 0).parameters()]
    assert rep["numel"] == sum(numels)
    steps = rep["steps"]
    # it trained to the end, every replica in step, the healed one included
    assert rep["final_step"] >= 16
    assert rep["final_bit_identical"] and rep["committed_steps_in_sync"]
    assert len({rs[-1]["digest"] for rs in steps}) == 1
    assert all(rs[-1]["committed"] and rs[-1]["n"] == 3 for rs in steps)
    # the victim died in step 5: its last line before the restart is step 4
    victim = steps[2]
    assert rep["kill_replica"] == 2
    before = [r for r in victim if r["step"] <= 4]
    assert before and before[-1]["step"] == 4 and all(r["committed"] for r in before)
    # at most one step lost per failure (the one in flight cannot commit: exactly one);
    # counted from the survivors' lines
    assert rep["failures"] == 1
    lost = [sum(not r["committed"] for r in steps[i]) for i in (0, 1)]
    assert rep["steps_lost"] == max(lost) == 1
    # the survivors went on with 2 participants; nothing committed below 2
    assert any(r["committed"] and r["n"] == 2 for r in steps[0])
    assert all(r["n"] >= 2 for rs in steps for r in rs if r["committed"])
    # healed: its first counted vote came after the restart, with 3 replicas, already identical
    heal = rep["heal"]
    assert heal["first_vote_n"] == 3 and heal["first_vote_bit_identical"]
    assert heal["first_vote_step"] > 8 and 0 < heal["ready_s"] <= heal["heal_s"]
    # bytes per step: the formula, per participants, measured on every committed step
    assert rep["bytes_match_formula"]
    for n, b in rep["bytes_per_step"].items():
        n = int(n)
        assert b["measured"] == b["formula"] == _vote_binary_bytes(numels, n)
        assert b["fp32_allreduce"] == round(2 * (n - 1) / n * 4 * sum(numels))
    sent = {r["n"]: r["sent"] for rs in steps for r in rs if r["committed"]}
    assert sent == {n: _vote_binary_bytes(numels, n) for n in (2, 3)}
    # the loss curve through the failure: replica 0 every 4 steps, and it learned
    curve = rep["curve"]
    assert [c["step"] for c in curve] == list(range(4, rep["final_step"] + 1, 4))
    assert curve[-1]["val_loss"] < math.log(chars.VOCAB) - 0.3
    assert (tmp_path / "rep.json").exists()


@pytest.mark.parametrize("bad", [
    ["--kill-at", "0"], ["--kill-at", "16"], ["--kill-at", "5", "--restart-at", "3"],
    ["--restart-at", "8"], ["--replicas", "1"], ["--kill-at", "5", "--kill-replica", "3"],
    ["--replicas", "2", "--kill-at", "5"], ["--eval-every", "0"]])
def test_elastic_chars_bad_options(bad):
    with pytest.raises(SystemExit) as e:
        demo.parse_args(["--task", "chars", "--elastic", "--iters", "16"] + bad)
    assert e.value.code == 2
