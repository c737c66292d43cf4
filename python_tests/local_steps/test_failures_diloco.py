"""Failure handling for dk.DiLoCo: a rank that dies (SIGKILL) or stalls (SIGSTOP) at a sync makes
every other rank raise DistributedStepError within the timeout plus a margin, naming the sync's
inner step and the collective, with theta_bar, the outer momenta and the parameters exactly as
before that step() call (with overlap_steps the error comes at the apply step, tau steps later, and
still names the sync's step).

Real gloo processes (faults.py); every run is bounded and kills all its processes at the end.
"""

import time

import pytest
import torch
import torch.distributed as dist
from faults import Fault, run_with_fault
from test_diloco import _inner, _inner_step, _model

import dlion_kernels as dk
from dlion_kernels.exchange.sharded import HEADERS
from dlion_kernels.local_steps.diloco import ALL_REDUCE, FLAGS, DiLoCo

PG_TIMEOUT = 5.0  # seconds: the group's timeout and DiLoCo(timeout=)
MARGIN = 15.0  # spawn and scheduling jitter on a shared 2-core machine
DEADLINE = 300.0
H = 2
FAULT_SYNC = 2 * H  # the second sync: the first one ran on every rank
A2A, GATHER = "all_to_all_single(votes)", "all_gather(aggregate)"


def _snap(model, diloco):
    return ([p.detach().clone() for p in model.parameters()],
            [t.clone() for t in diloco.theta_bar], [m.clone() for m in diloco.outer_momenta])


def worker(rank, n, group, outer, tau):
    """Inner steps with a DiLoCo on ``group`` (PG_TIMEOUT); the ranks line up on the default
    group (long timeout) before building it and before each step up to the faulty sync, so that
    a rank slowed down by a loaded machine is not taken for a stalled one."""
    model = _model()
    inner = _inner("adamw", model)
    dist.barrier()
    diloco = DiLoCo(model, inner, sync_every=H * (tau + 1), outer=outer, outer_lr=5e-2,
                    overlap_steps=tau, group=group, timeout=PG_TIMEOUT)
    sync = FAULT_SYNC * (tau + 1)
    return _until_error(diloco, lambda t: _inner_step(model, inner, rank, t),
                        lambda: _snap(model, diloco), sync, sync + tau + 2)


def _until_error(diloco, inner_step, snap, sync, last):
    """Inner steps 1..``last`` (``inner_step(t)``), each followed by ``diloco.step()``, the
    ranks lined up on the default group before each step up to ``sync``; at a
    DistributedStepError what this rank saw (``snap()``: params, theta_bar, momenta)."""
    completed = []
    for t in range(1, last + 1):
        if t <= sync:
            dist.barrier()
        inner_step(t)
        before = snap()
        start = time.monotonic()
        try:
            diloco.step()
        except dk.DistributedStepError as e:
            return dict(error=str(e), step=e.step, collective=e.collective, at=t,
                        elapsed=time.monotonic() - start, before=before, now=snap(),
                        completed=completed, inner_step=diloco.inner_step)
        completed.append(snap())
    return dict(error=None, completed=completed)


SCENARIOS = [  # (outer, overlap_steps, n, fault rank, point, action, collectives named)
    ("dlion", 0, 3, 1, f"before:{A2A}", "kill", {A2A}),
    ("dlion", 0, 2, 0, f"after:{A2A}", "stop", {A2A, GATHER}),
    ("dlion", 1, 3, 2, f"after:{A2A}", "kill", {A2A, GATHER}),
    ("nesterov", 0, 2, 1, f"before:{ALL_REDUCE}", "stop", {ALL_REDUCE}),
    ("nesterov", 1, 2, 0, f"before:{ALL_REDUCE}", "kill", {ALL_REDUCE}),
]


@pytest.mark.parametrize("outer,tau,n,victim,point,action,names", SCENARIOS,
                         ids=[f"{s[0]}-tau{s[1]}-n{s[2]}-{s[5]}" for s in SCENARIOS])
def test_dead_or_stalled_rank_at_a_sync(outer, tau, n, victim, point, action, names):
    sync = FAULT_SYNC * (tau + 1)
    fault = Fault(rank=victim, step=sync, point=point, action=action)
    results = run_with_fault(n, worker, fault, outer, tau, pg_timeout=PG_TIMEOUT,
                             deadline=DEADLINE)
    _check_survivors(results, n, victim, sync, tau, names)


def fsdp_worker(rank, n, group, outer):
    """``worker`` on a 2 x 2 FSDP2 mesh (test_diloco_fsdp's model): the mesh's groups have the
    default group's long timeout, DiLoCo(timeout=) bounds each wait of a sync."""
    from test_diloco_fsdp import _fsdp, _mesh
    from test_diloco_fsdp import _inner_step as fsdp_inner_step
    from test_diloco_fsdp import _snap as fsdp_snap

    mesh = _mesh(2, 2)
    net = _fsdp(mesh)
    inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
    dist.barrier()
    diloco = DiLoCo(net, inner, sync_every=H, outer=outer, outer_lr=5e-2, device_mesh=mesh,
                    timeout=PG_TIMEOUT)
    return _until_error(diloco, lambda t: fsdp_inner_step(net, inner, rank, t),
                        lambda: fsdp_snap(net, diloco), FAULT_SYNC, FAULT_SYNC + 2)

@pytest.mark.parametrize("outer,names", [
    ("dlion", {A2A, GATHER, HEADERS}), ("nesterov", {ALL_REDUCE, FLAGS})])
def test_dead_rank_at_a_sync_on_an_fsdp_mesh(outer, names):
    """2 replicas x 2 shards, rank 3 killed at the second sync: its replicate peer (rank 1) fails
    in the exchange, the others in the agreement inside their shard group (rank 2 with the dead
    rank, rank 0 with rank 1, which has given up): every survivor raises, nothing modified."""
    first = A2A if outer == "dlion" else ALL_REDUCE
    fault = Fault(rank=3, step=FAULT_SYNC, point=f"before:{first}", action="kill")
    results = run_with_fault(4, fsdp_worker, fault, outer, pg_timeout=PG_TIMEOUT,
                             deadline=DEADLINE)
    _check_survivors(results, 4, 3, FAULT_SYNC, 0, names, replicas=[(0, 2)])


def _check_survivors(results, n, victim, sync, tau, names, replicas=None):
    """Every survivor raised at the sync, in time, naming it, with nothing modified; before it,
    the survivors (or each pair of ``replicas``: ranks holding the same shard) agree on
    theta_bar bit for bit."""
    survivors = [r for r in range(n) if r != victim]
    assert results[victim] is None  # the victim never got to report
    for r in survivors:
        res = results[r]
        assert res["error"] is not None, f"rank {r} finished without noticing the dead peer"
        assert res["step"] == sync and res["at"] == sync + tau, (r, res["step"], res["at"])
        assert res["collective"] in names, (r, res["collective"])
        assert f"DiLoCo sync at inner step {sync}:" in res["error"]
        assert res["collective"] in res["error"]
        assert res["elapsed"] < PG_TIMEOUT + MARGIN, (r, res["elapsed"])
        assert res["inner_step"] == sync + tau - 1  # the failed call did not count
        for a, b in zip(res["now"], res["before"]):  # params, theta_bar, momenta: as before
            for x, y in zip(a, b, strict=True):
                assert torch.equal(x, y)
        assert len(res["completed"]) == sync + tau - 1
    # the syncs before the failure: the survivors agree on theta_bar bit for bit
    for same in replicas or [survivors]:
        first = results[same[0]]["completed"][-1][1]
        for r in same[1:]:
            for x, y in zip(results[r]["completed"][-1][1], first, strict=True):
                assert torch.equal(x, y)
