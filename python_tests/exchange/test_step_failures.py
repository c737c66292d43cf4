"""Failure handling: a rank that dies (SIGKILL) or stalls (SIGSTOP) at any point of a step makes
every other rank raise DistributedStepError within the group's timeout plus a margin, naming the
step and the collective, and no surviving rank applies a partial update.

Real gloo processes (faults.py); every run is bounded and kills all its processes at the end.
"""

import time

import pytest
import torch
from faults import Fault, run_with_fault

import dlion_kernels as dk

PG_TIMEOUT = 5.0  # seconds: the process group's own timeout
MARGIN = 15.0  # seconds on top of it: spawn jitter on a shared 2-core machine
FAULT_STEP = 2
DEADLINE = 300.0  # a safety net only: a hung run fails (and is killed) after this long
# Kernel stages v2 move the momentum write into apply; with v1 local_step writes momentum before
# the exchange, so only the parameters are all-before/all-after there.
def _model():
    torch.manual_seed(0)  # identical parameters on every rank
    shapes = [(7, 5), (33,), (4, 4, 3)]
    return [torch.randn(s) for s in shapes]


def _snapshot(opt, params):
    moms = [opt.state[p]["exp_avg"].clone() if opt.state[p] else None for p in params]
    return [p.detach().clone() for p in params], moms


def plain_worker(rank, n, group, steps, nonfinite="raise"):
    """Two param groups (so apply runs in two launches); one step per iteration. Returns what the
    survivor saw: the error (if any) and the parameters before the failing step and now.

    The first FAULT_STEP steps run on the default group (long timeout): on a loaded machine a
    first step can take seconds. Then, after a barrier, the optimizer moves to ``group``, whose
    timeout is PG_TIMEOUT."""
    params = _model()
    for p in params:
        p.requires_grad_(True)
    opt = dk.DistributedLion([{"params": params[:2]}, {"params": params[2:], "lr": 2e-2}],
                             lr=1e-2, weight_decay=0.1, nonfinite=nonfinite)
    gen = torch.Generator().manual_seed(100 + rank)
    completed = []
    for k in range(steps):
        if k == FAULT_STEP:
            torch.distributed.barrier()
            opt.group = group
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        before = _snapshot(opt, params)
        start = time.monotonic()
        try:
            opt.step()
        except dk.DistributedStepError as e:
            return dict(error=str(e), step=e.step, collective=e.collective,
                        elapsed=time.monotonic() - start, before=before,
                        now=_snapshot(opt, params), completed=completed)
        completed.append(_snapshot(opt, params))
    return dict(error=None, completed=completed)


POINTS = [
    # (point, step at which survivors fail, collectives they may name)
    ("before:all_to_all_single(votes)", FAULT_STEP, {"all_to_all_single(votes)"}),
    ("after:all_to_all_single(votes)", FAULT_STEP,
     {"all_to_all_single(votes)", "all_gather(aggregate)"}),
    # The victim finished every collective: survivors complete the step and fail at the next.
    ("apply", FAULT_STEP + 1, {"all_to_all_single(votes)"}),
]


def _check_survivors(results, fault, fail_step, names, n):
    survivors = [r for r in range(n) if r != fault.rank]
    assert results[fault.rank] is None  # the victim never got to report
    finals = []
    for r in survivors:
        res = results[r]
        assert res["error"] is not None, f"rank {r} finished without noticing the dead peer"
        assert res["step"] == fail_step, (r, res["step"], res["error"])
        assert res["collective"] in names, (r, res["collective"])
        assert f"step {fail_step}" in res["error"] and res["collective"] in res["error"]
        assert res["elapsed"] < PG_TIMEOUT + MARGIN, (r, res["elapsed"])
        # All before: the failing step left the parameters exactly as they were.
        for a, b in zip(res["now"][0], res["before"][0]):
            assert torch.equal(a, b)
        # ... momenta too (kernel stages v2 write them in apply, after the last collective)
        for a, b in zip(res["now"][1], res["before"][1]):
            assert (a is None and b is None) or torch.equal(a, b)
        assert len(res["completed"]) == fail_step
        finals.append(res["now"][0])
    # ... and all after for the steps that completed: the survivors agree bit for bit.
    for other in finals[1:]:
        for a, b in zip(finals[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("action", ["kill", "stop"])
@pytest.mark.parametrize("point,fail_step,names", POINTS, ids=["before-first", "between", "apply"])
def test_dead_or_stalled_rank_n3(action, point, fail_step, names):
    n = 3
    fault = Fault(rank=1, step=FAULT_STEP, point=point, action=action)
    results = run_with_fault(n, plain_worker, fault, FAULT_STEP + 3, pg_timeout=PG_TIMEOUT,
                             deadline=DEADLINE)
    _check_survivors(results, fault, fail_step, names, n)


def test_killed_rank0_n2_between_collectives():
    """n = 2, rank 0 dies."""
    fault = Fault(rank=0, step=FAULT_STEP, point="after:all_to_all_single(votes)")
    results = run_with_fault(2, plain_worker, fault, FAULT_STEP + 3, pg_timeout=PG_TIMEOUT,
                             deadline=DEADLINE)
    _check_survivors(results, fault, FAULT_STEP, POINTS[1][2], 2)


def test_stall_before_last_collective_n4():
    fault = Fault(rank=3, step=FAULT_STEP, point="before:all_gather(aggregate)", action="stop")
    results = run_with_fault(4, plain_worker, fault, FAULT_STEP + 3, pg_timeout=PG_TIMEOUT,
                             deadline=DEADLINE)
    _check_survivors(results, fault, FAULT_STEP, {"all_gather(aggregate)"}, 4)


def test_no_fault_runs_to_the_end():
    """The harness itself: without a fault every rank completes every step, in sync."""
    results = run_with_fault(3, plain_worker, None, 4, pg_timeout=PG_TIMEOUT, deadline=DEADLINE)
    assert all(r["error"] is None and len(r["completed"]) == 4 for r in results)
    for r in results[1:]:
        for a, b in zip(r["completed"][-1][0], results[0]["completed"][-1][0]):
            assert torch.equal(a, b)
