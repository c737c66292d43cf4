"""The runtime model on a running job (plan/auto.py): DistributedLion(hierarchy="auto") picks L
from the model, every rank the same, from $DLION_PLAN's inputs or a live calibration."""

import json
import os

import pytest
import torch
import torch.distributed as dist
from workers import run_workers

import dlion_kernels as dk
from dlion_kernels.plan import choose_hierarchy, predict

D = 200_000  # parameters of the test model

# Two clusters of 2 nodes x 2 ranks. Slow links between nodes and fast ones inside:
# hierarchical D-Lion sends 1/L of the cross-node bytes and wins. One process per host (the
# intra "link" as slow as the inter one): the intra-node reduce-scatter and gather only add.
SLOW_INTER = dict(inter_gbps=0.1, intra_gbps=400.0, latency_us=50.0, fwd_ms=1.0, bwd_ms=2.0,
                  opt_ms=1.0)
FLAT_WINS = dict(inter_gbps=100.0, intra_gbps=0.1, latency_us=5.0, intra_latency_us=500.0,
                 fwd_ms=1.0, bwd_ms=2.0, opt_ms=1.0)


def test_the_two_clusters_choose_differently():
    # The test below can only fail if the model's choice depends on the inputs: check it does.
    assert choose_hierarchy(4, 2, D, **SLOW_INTER) == 2
    assert choose_hierarchy(4, 2, D, **FLAT_WINS) == 1
    rows = {r.strategy: r.step_ms for r in predict(D, 4, 2, **SLOW_INTER)}
    assert rows["dlion-vote-hier"] < rows["dlion-vote"]


def _from_file(rank, n, path, expect_steps):
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    os.environ["DLION_PLAN"] = path
    torch.manual_seed(0)
    model = torch.nn.Linear(400, 500)  # 200,500 parameters
    opt = dk.DistributedLion(model.parameters(), lr=1e-2, hierarchy="auto")
    for step in range(expect_steps):
        torch.manual_seed(100 * rank + step)
        model(torch.randn(8, 400)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(n)]
    dist.all_gather(everyone, flat)
    return dict(L=opt.ranks_per_node, in_sync=all(torch.equal(e, flat) for e in everyone),
                inter=getattr(opt.last_stats, "inter_node_bytes_sent", None))


@pytest.mark.parametrize("inputs, expect", [(SLOW_INTER, 2), (FLAT_WINS, 1)])
def test_hierarchy_auto_follows_the_model(tmp_path, inputs, expect):
    path = tmp_path / "plan.json"  # as `python -m dlion_kernels.plan --measure --json` writes
    path.write_text(json.dumps({"inputs": dict(inputs, params=D, ranks=4, ranks_per_node=2)}))
    results = run_workers(4, _from_file, str(path), 3)
    assert [r["L"] for r in results] == [expect] * 4
    assert all(r["in_sync"] for r in results)
    if expect == 2:  # the step that ran is the hierarchical one
        assert all(r["inter"] is not None and r["inter"] > 0 for r in results)


def _live(rank, n):
    os.environ.pop("DLION_PLAN", None)
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    torch.manual_seed(0)  # the replicas start identical (the optimizer checks it)
    model = torch.nn.Linear(64, 64)
    opt = dk.DistributedLion(model.parameters(), lr=1e-2, hierarchy="auto")
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    return opt.ranks_per_node


def test_hierarchy_auto_calibrates_on_the_running_group():
    # No $DLION_PLAN: the job measures its links, collectives and compute (a few seconds).
    results = run_workers(4, _live, timeout=240)
    assert results[0] in (1, 2) and results == [results[0]] * 4


def _bad_file(rank, n, path):
    os.environ["DLION_PLAN"] = path
    try:
        dk.DistributedLion([torch.nn.Parameter(torch.zeros(10))], hierarchy="auto")
    except ValueError as e:
        return str(e)
    return None


def test_a_bad_plan_file_raises_on_every_rank(tmp_path):
    messages = run_workers(2, _bad_file, str(tmp_path / "missing.json"))
    assert all(m and "DLION_PLAN" in m and "missing.json" in m for m in messages), messages


def test_auto_options_that_cannot_work():
    with pytest.raises(ValueError, match="resolved once by DistributedLion"):
        dk.fused_dlion_step([torch.zeros(3)], [torch.zeros(3)], [torch.zeros(3)], lr=1e-3,
                            hierarchy="auto")
    from dlion_kernels.plan import auto

    with pytest.raises(ValueError, match="default process group"):
        auto.hierarchy(10, mode="vote", overlap=False, group=object())
