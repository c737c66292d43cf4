"""``python -m dlion_kernels.demo --task chars --sites`` at a tiny size: 2 sites of 2 ranks each
(FSDP2 inside a site), DiLoCo with its default 1-bit outer step and 2 fragments streamed
(``overlap_steps=1``) between them, on torchft's quorum; every rank of site 1 killed (SIGKILL)
with a sync in flight, then restarted. The report must agree with itself: at most one sync lost,
the restarted site heals and syncs with the other again, every committed sync leaves the same
theta_bar on every site (rank by rank), and the bytes between sites are about 1/32 of an fp32
all-reduce of the same fragment."""

import math

import pytest

pytest.importorskip("torchft")

from dlion_kernels.demo import chars, cli  # noqa: E402
from dlion_kernels.demo import sites as demo  # noqa: E402

TINY = ["--task", "chars", "--sites", "--replicas", "2", "--ranks-per-site", "2",
        "--min-sites", "1", "--sync-every", "4", "--iters", "28", "--kill-at", "8",
        "--restart-at", "12", "--eval-every", "2", "--batch-size", "4", "--context", "32",
        "--d-model", "32", "--heads", "2", "--layers", "1", "--eval-windows", "16",
        "--seeds", "0", "--quiet"]


def test_sites_kill_restart_heal(tmp_path):
    rep = cli.main(TINY + ["--json", str(tmp_path / "rep.json")])
    records = {tuple(map(int, k.split("-"))): [x for x in v if "sync" in x]
               for k, v in rep["records"].items()}
    assert rep["committed_syncs_in_sync"] and rep["final_theta_identical"]
    # the sync in flight at the kill cannot commit; nothing else is lost
    assert rep["syncs_lost"] == 1
    for q in (0, 1):
        survivor = records[(0, q)]
        assert [x["sync"] for x in survivor if not x["committed"]] == [8]
        assert any(x["committed"] and x["n"] == 1 for x in survivor)  # alone meanwhile
        # healed: the restarted site syncs with the survivor again, at the same steps
        after = [x for x in records[(1, q)] if x["sync"] > 12]
        assert after and all(x["committed"] and x["n"] == 2 for x in after)
        assert after[-1]["sync"] == survivor[-1]["sync"] >= 28
    assert rep["heal"]["heal_s"] is not None
    # bytes between sites: the 1-bit vote, 1/32 of an fp32 all-reduce of the fragment but for
    # the step header and the padding of a shard, which weigh on fragments this small
    two = rep["per_participants"][2]
    assert 0 < two["inter_bytes"] <= two["fp32_allreduce"] / 30
    # it learned, through the failure
    assert rep["final_val_loss"] < math.log(chars.VOCAB) - 0.3
    assert (tmp_path / "rep.json").exists()


@pytest.mark.parametrize("bad", [
    ["--replicas", "1", "--min-sites", "2"], ["--kill-at", "5", "--kill-site", "3"],
    ["--restart-at", "8"], ["--replicas", "2", "--kill-at", "5"],
    ["--sync-every", "6", "--fragments", "4"], ["--overlap-steps", "4"],
    ["--strategy", "diloco-nesterov"]])
def test_sites_bad_options(bad):
    with pytest.raises(SystemExit) as e:
        demo.parse_args(["--task", "chars", "--sites", "--iters", "16"] + bad)
    assert e.value.code == 2
