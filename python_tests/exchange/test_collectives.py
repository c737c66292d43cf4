"""exchange/collectives.py: collectives that fail loudly (DistributedStepError naming the step and
the collective), the timeout arguments, and the timeouts of the groups the library makes."""

import time

import torch
from faults import run_with_fault

import dlion_kernels as dk

DEADLINE = 300.0  # a safety net only: a hung run fails (and is killed) after this long


def test_collective_timeout_argument():
    """collective(..., timeout=) bounds one call below the group's timeout, on a single rank
    whose peer never joins the collective."""
    results = run_with_fault(2, _lonely_worker, None, pg_timeout=30.0, deadline=DEADLINE)
    res = results[0]
    assert res["collective"] == "all_reduce(test)" and res["step"] == 7
    assert 1.0 < res["elapsed"] < 5.5  # far below the group's 30 s


def _lonely_worker(rank, n, group):
    import torch.distributed as dist

    from dlion_kernels.exchange.collectives import collective

    if rank == 1:
        time.sleep(6)  # never calls the collective (and outlives rank 0's wait)
        return None
    start = time.monotonic()
    try:
        collective("all_reduce(test)", 7, dist.all_reduce, torch.ones(3), group=group,
                   timeout=1.5)
    except dk.DistributedStepError as e:
        return dict(collective=e.collective, step=e.step, elapsed=time.monotonic() - start)
    return dict(collective=None, step=None, elapsed=None)
