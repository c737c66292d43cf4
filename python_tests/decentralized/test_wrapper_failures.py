"""Failure handling for decentralized training (DecentralizedDataParallel, AccumAdamW, one bucket
per parameter): a peer killed or stalled while gossip is in flight makes every other rank raise
DistributedStepError naming the iteration and the gossip collective of a bucket, within the timeout
plus a margin, from backward() or synchronize(); a dead peer in global_average() raises naming
all_reduce(global average).

What is checked, per bucket (the gossip is per bucket): when a survivor raises at iteration t
naming bucket k, its buckets 0..k-1 hold exactly the parameters of a run without any fault after
iteration t (mixed and stepped) and its buckets k.. exactly those before iteration t, bit for bit
(a launch that fails instead of a wait: buckets 0..k after). So no bucket is half-mixed or
half-stepped, and what finished is what a healthy run computes. Failures in synchronize() are
checked the same way against the healthy run's synchronize().

Real gloo processes (faults.py); every run is bounded and kills all its processes at the end.
"""

import re

import pytest
import torch
import torch.distributed as dist
from faults import Fault, attempt, run_with_fault

import dlion_kernels as dk
from dlion_kernels.exchange.collectives import group_timeout

PG_TIMEOUT = 5.0  # seconds: DecentralizedDataParallel(timeout=), also its subgroups' timeout
MARGIN = 15.0
FAULT_ITER = 2  # even: ring pairs (0, 1), (2, 3); odd: (1, 2), (0, 3)
ITERATIONS = FAULT_ITER + 4
DEADLINE = 300.0
N = 4
BUCKETS = 4  # bucket_mb tiny: one bucket per parameter of the model
GOSSIP = re.compile(r"all_reduce\(gossip, bucket (\d+)\)")


def worker(rank, n, group, iterations, topology, final, aligned=FAULT_ITER):
    """``iterations`` of decentralized training, then ``final``: "synchronize" or "average"
    (synchronize, then global_average()). The ranks line up on the default group (long timeout)
    before each iteration up to ``aligned``, so that a rank slowed down by a loaded machine is
    not taken for a stalled one. Returns the parameters after every iteration (or what the
    failure left)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    params = list(model.parameters())
    ddp = dk.DecentralizedDataParallel(model, lambda ps: dk.AccumAdamW(ps, lr=1e-2),
                                       topology=topology, bucket_mb=1e-6, timeout=PG_TIMEOUT)
    gen = torch.Generator().manual_seed(100 + rank)
    after = []

    def now():
        return [p.detach().clone() for p in params]

    def out(**kwargs):
        index = {id(p): i for i, p in enumerate(params)}
        buckets = [[index[id(p)] for p in o.param_groups[0]["params"]] for o in ddp.optimizers]
        # the ring's pair groups: made with timeout= (not gloo's 30 minutes)
        timeouts = [group_timeout(ddp.topology.group_at(t)[1]).total_seconds() for t in (0, 1)]
        return dict(after=after, buckets=buckets, timeouts=timeouts, **kwargs)

    for t in range(iterations):
        if t <= aligned:
            dist.barrier()
        x = torch.randn(4, 8, generator=gen)
        seen = attempt([("backward", lambda x=x: ddp(x).square().mean().backward())])
        if seen is not None:
            return out(now=now(), **seen)
        after.append(now())
    if final == "synchronize":
        if aligned >= iterations:
            dist.barrier()
        seen = attempt([("synchronize", ddp.synchronize)])
        return out(now=now(), **seen) if seen is not None else out(error=None, synced=now())

    def average():
        with ddp.global_average():
            pass

    ddp.synchronize()
    mine = now()
    seen = attempt([("average", average)]) or dict(error=None)
    return out(now=now(), mine=mine, **seen)


@pytest.fixture(scope="module")
def healthy():
    """The same run without a fault: every rank's parameters after each iteration."""
    results = run_with_fault(N, worker, None, ITERATIONS, "ring", "synchronize", ITERATIONS,
                             pg_timeout=PG_TIMEOUT, deadline=DEADLINE)
    for res in results:
        assert res["error"] is None, res["error"]
        assert len(res["after"]) == ITERATIONS
        assert res["timeouts"] == [PG_TIMEOUT, PG_TIMEOUT]
        assert len(res["buckets"]) == BUCKETS and all(len(b) == 1 for b in res["buckets"])
    return results


def _check_bucketwise(res, ref, rank):
    """The survivor ``res`` against the healthy run ``ref`` of the same rank (module doc)."""
    t = res["step"]
    k = int(GOSSIP.fullmatch(res["collective"]).group(1))
    if res["where"] == "synchronize":
        assert t == ITERATIONS
        before, after = ref["after"][-1], ref["synced"]
    else:
        assert res["where"] == "backward" and 1 <= t < ITERATIONS
        before, after = ref["after"][t - 1], ref["after"][t]
    # a failed wait: bucket k untouched; a failed launch (after bucket k stepped): k finished
    done = k if "the gossip was launched at iteration" in res["error"] else k + 1
    assert res["buckets"] == ref["buckets"]
    for b, members in enumerate(res["buckets"]):
        for i in members:
            assert not torch.equal(before[i], after[i])  # the check can tell them apart
            expect = after[i] if b < done else before[i]
            assert torch.equal(res["now"][i], expect), (rank, t, k, b, res["where"])
    assert len(res["after"]) == t  # the iterations before t completed ...
    for mine, theirs in zip(res["after"], ref["after"]):  # ... exactly as in the healthy run
        for a, b in zip(mine, theirs, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("action,point", [
    # killed mid-backward, just after launching bucket 1's gossip (bucket 0's is in flight too)
    ("kill", "after:all_reduce(gossip, bucket 1)"),
    # stalled mid-backward after stepping bucket 0, before launching its gossip
    ("stop", "before:all_reduce(gossip, bucket 0)"),
], ids=["kill-after-launch", "stop-before-launch"])
def test_dead_or_stalled_peer_ring_n4(healthy, action, point):
    fault = Fault(rank=1, step=FAULT_ITER, point=point, action=action)
    results = run_with_fault(N, worker, fault, ITERATIONS, "ring", "synchronize",
                             pg_timeout=PG_TIMEOUT, deadline=DEADLINE)
    assert results[1] is None
    for r in (0, 2, 3):
        res = results[r]
        assert res["error"] is not None, f"rank {r} finished without noticing the dead peer"
        assert GOSSIP.fullmatch(res["collective"]), res["collective"]
        assert f"decentralized iteration {res['step']}: collective {res['collective']}" \
            in res["error"]
        # the victim's gossip of FAULT_ITER is mixed at FAULT_ITER + 1; its gossip of
        # FAULT_ITER - 1 was launched but may not have been served yet by its gloo thread when
        # it died or froze (a loaded machine), so its partner of then may fail at FAULT_ITER
        assert res["step"] >= FAULT_ITER, (r, res["step"], res["error"])
        if res["step"] == FAULT_ITER:
            assert r == 2, (r, res["error"])  # ring pairs at FAULT_ITER - 1: (1, 2), (0, 3)
        assert res["elapsed"] < PG_TIMEOUT + MARGIN, (r, res["elapsed"])
        _check_bucketwise(res, healthy[r], r)
    # rank 0, the victim's partner at FAULT_ITER, fails at the next iteration's mixing
    assert results[0]["step"] == FAULT_ITER + 1 and results[0]["where"] == "backward"


def test_dead_peer_in_global_average_n3():
    """complete topology: the victim dies at global_average()'s all-reduce; the survivors raise
    naming it, and their own parameters are back bit for bit."""
    fault = Fault(rank=1, step=ITERATIONS, point="before:all_reduce(global average)")
    results = run_with_fault(3, worker, fault, ITERATIONS, "complete", "average",
                             pg_timeout=PG_TIMEOUT, deadline=DEADLINE)
    assert results[1] is None
    for r in (0, 2):
        res = results[r]
        assert res["collective"] == "all_reduce(global average)" and res["step"] == ITERATIONS
        assert f"decentralized iteration {ITERATIONS}: collective all_reduce(global average)" \
            in res["error"]
        assert res["elapsed"] < PG_TIMEOUT + MARGIN
        for a, b in zip(res["now"], res["mine"], strict=True):
            assert torch.equal(a, b)
        assert len(res["after"]) == ITERATIONS
