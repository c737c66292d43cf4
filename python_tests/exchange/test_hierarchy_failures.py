"""Failure handling for hierarchical D-Lion (DistributedLion(hierarchy=2) on n = 4: nodes {0, 1} and
{2, 3}): a rank killed or stalled in the node reduce-scatter, the inter-node exchange or the
intra-node gather makes every other rank raise DistributedStepError naming the step and the
collective, within the timeout plus a margin; the failed step leaves every survivor's parameters
and momentum shard exactly as they were, and the library's node groups take the default group's
timeout (not gloo's 30-minute default) or DistributedLion(timeout=).

Real gloo processes (faults.py); every run is bounded and kills all its processes at the end.
"""

import datetime

import pytest
import torch
import torch.distributed as dist
from faults import Fault, attempt, check_survivors, run_with_fault, snapshot

import dlion_kernels as dk
from dlion_kernels.exchange import hierarchy as hier
from dlion_kernels.exchange.collectives import group_timeout
from dlion_kernels.exchange.pipeline import A2A, GATHER

PG_TIMEOUT = 5.0  # seconds: DistributedLion(timeout=), also the node groups' own timeout
MARGIN = 15.0  # spawn jitter on a shared 2-core machine
FAULT_STEP = 2
DEADLINE = 300.0
N, L = 4, 2


def worker(rank, n, group, steps):
    """Two param groups, hierarchy=2 on the default group (whose timeout is long). The ranks
    line up before each step up to FAULT_STEP; from FAULT_STEP on timeout=PG_TIMEOUT (its node
    groups are made then, with that timeout). Returns what this rank saw and the timeouts of
    the node groups made without and with timeout=."""
    torch.manual_seed(0)
    params = [torch.randn(s, requires_grad=True) for s in [(7, 5), (33,), (4, 4, 3), (70,)]]
    opt = dk.DistributedLion([{"params": params[:2]}, {"params": params[2:], "lr": 2e-2}],
                             lr=1e-2, weight_decay=0.1, hierarchy=L)
    gen = torch.Generator().manual_seed(100 + rank)
    completed, info = [], {}
    for k in range(steps):
        if k <= FAULT_STEP:
            dist.barrier()
        if k == FAULT_STEP:
            opt.timeout = PG_TIMEOUT
            plain, short = hier.topology(None, L), hier.topology(None, L, PG_TIMEOUT)
            info["timeouts"] = [group_timeout(g) for g in (plain.intra, plain.inter,
                                                           short.intra, short.inter)]
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        before = snapshot(opt, params)
        seen = attempt([("step", opt.step)])
        if seen is not None:
            return dict(seen, before=before, now=snapshot(opt, params), completed=completed,
                        **info)
        completed.append([p.detach().clone() for p in params])
    return dict(error=None, completed=completed, **info)


RS, FLAGS, NODE, COMMIT = hier.REDUCE_SCATTER, hier.FLAGS, hier.NODE_GATHER, hier.COMMIT
CASES = [
    # (victim, action, point, steps the survivors fail at, collectives they may name)
    # rank 1 dies before the node reduce-scatter: rank 0 fails in it, node {2, 3} when it
    # exchanges the non-finite flags with node 0.
    (1, "kill", "before:" + RS, {FAULT_STEP}, {RS, FLAGS}),
    # rank 0 dies between the two inter-node collectives: rank 2 fails in them, rank 1 and 3
    # in the intra-node gather of the aggregate (after their own exchange completed).
    (0, "kill", "after:" + A2A, {FAULT_STEP}, {A2A, GATHER, NODE, COMMIT}),
    # rank 3 stalls before the intra-node gather: rank 2 times out in it; node {0, 1} completes
    # its gather and waits in the commit over all ranks, which no rank completes: no rank
    # applies the step (with the node gather last, node {0, 1} used to apply it).
    (3, "stop", "before:" + NODE, {FAULT_STEP}, {NODE, COMMIT}),
    # rank 1 stalls before the commit itself: every other rank times out in it.
    (1, "stop", "before:" + COMMIT, {FAULT_STEP}, {COMMIT}),
]


@pytest.mark.parametrize("victim,action,point,steps,names", CASES,
                         ids=["kill-reduce-scatter", "kill-inter-exchange", "stop-node-gather",
                              "stop-commit"])
def test_dead_or_stalled_rank_hierarchy_n4(victim, action, point, steps, names):
    fault = Fault(rank=victim, step=FAULT_STEP, point=point, action=action)
    results = run_with_fault(N, worker, fault, FAULT_STEP + 3, pg_timeout=PG_TIMEOUT,
                             deadline=DEADLINE)
    check_survivors(results, fault, N, steps=steps, names=names, limit=PG_TIMEOUT + MARGIN)
    default = datetime.timedelta(seconds=120)  # faults.py's default group
    short = datetime.timedelta(seconds=PG_TIMEOUT)
    for r in range(N):
        if r != victim:
            assert results[r]["timeouts"] == [default, default, short, short]


def worker_overlap(rank, n, group, steps):
    """hierarchy=2 with overlap=True (one bucket per parameter): the node gathers and the
    inter-node exchanges run during backward. From FAULT_STEP on timeout=PG_TIMEOUT."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    params = list(model.parameters())
    opt = dk.DistributedLion(params, lr=1e-2, weight_decay=0.1, hierarchy=L, overlap=True,
                             bucket_mb=1e-6)
    gen = torch.Generator().manual_seed(100 + rank)
    completed = []
    for k in range(steps):
        if k <= FAULT_STEP:
            dist.barrier()
        if k == FAULT_STEP:
            opt.timeout = PG_TIMEOUT
        x = torch.randn(4, 8, generator=gen)
        opt.zero_grad(set_to_none=True)
        before = snapshot(opt, params)
        seen = attempt([("backward", lambda x=x: model(x).square().mean().backward()),
                        ("step", opt.step)])
        if seen is not None:
            return dict(seen, before=before, now=snapshot(opt, params), completed=completed)
        completed.append([p.detach().clone() for p in params])
    return dict(error=None, completed=completed)


def test_dead_rank_hierarchy_overlap_n4():
    """Rank 1 dies before its first node gather of the step (bucket 0's, issued during backward
    when bucket 1 starts): every survivor raises from backward() or step(), naming a collective
    of the step, with parameters and momentum shards as they were. Rank 0, rank 1's node peer,
    notices at its next node reduce-scatter (a synchronous collective in the hook) or, when rank
    1 died after the last one, at step(), where the node gathers are waited for."""
    fault = Fault(rank=1, step=FAULT_STEP, point="before:" + NODE, action="kill")
    results = run_with_fault(N, worker_overlap, fault, FAULT_STEP + 2, pg_timeout=PG_TIMEOUT,
                             deadline=DEADLINE)
    check_survivors(results, fault, N, steps={FAULT_STEP}, names={RS, A2A, GATHER, NODE},
                    limit=PG_TIMEOUT + MARGIN, where={"backward", "step"})
    assert (results[0]["collective"], results[0]["where"]) in {(RS, "backward"), (NODE, "step")}
