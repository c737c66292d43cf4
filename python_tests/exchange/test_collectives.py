"""exchange/collectives.py: collectives that fail loudly (DistributedStepError naming the step and
the collective), the timeout arguments, and the timeouts of the groups the library makes."""

import datetime
import math
import time

import pytest
import torch
from faults import Fault, run_with_fault

import dlion_kernels as dk
from dlion_kernels.exchange.collectives import (
    NOTHING_APPLIED,
    DistributedStepError,
    as_timedelta,
    collective,
    group_timeout,
    wait,
)

DEADLINE = 300.0  # a safety net only: a hung run fails (and is killed) after this long
PG_TIMEOUT = 5.0  # the test group's own timeout
MARGIN = 25.0  # seconds on top of it: spawn jitter on a shared 2-core machine


# ----------------------------------------------------------------------------- in one process


@pytest.mark.parametrize("value, seconds", [(None, None), (1, 1.0), (0.25, 0.25), (3600, 3600.0),
                                            (datetime.timedelta(minutes=2), 120.0)])
def test_as_timedelta(value, seconds):
    got = as_timedelta(value)
    assert got is None if seconds is None else got == datetime.timedelta(seconds=seconds)


@pytest.mark.parametrize("value", [0, -1, 0.0, math.nan, math.inf, 1e20, 10**30, True, "5",
                                   [5], datetime.timedelta(0), datetime.timedelta(seconds=-1)])
def test_as_timedelta_refuses(value):
    with pytest.raises(ValueError, match=r"^wait_for must be "):
        as_timedelta(value, "wait_for")


def test_error_names_step_collective_and_rank():
    e = DistributedStepError(12, "all_to_all_single(votes)", "RuntimeError: connection closed")
    assert isinstance(e, RuntimeError) and dk.DistributedStepError is DistributedStepError
    assert (e.step, e.collective, e.rank) == (12, "all_to_all_single(votes)", -1)
    assert str(e) == (
        "D-Lion step 12: collective all_to_all_single(votes) failed on rank -1: RuntimeError: "
        f"connection closed. A peer rank has probably died or stalled; {NOTHING_APPLIED}. The "
        "process group is no longer usable: destroy it, restart the job and resume from the "
        "last checkpoint (dlion_kernels.load_state).")
    e = DistributedStepError(3, "x", "d", label="iteration", applied="the gossip was mixed")
    assert str(e).startswith("iteration 3: collective x failed on rank -1: d. ")
    assert "; the gossip was mixed. " in str(e)


def test_errors_survive_pickling():
    # sent between processes (a multiprocessing pool, an elastic agent's error file) as they are
    import pickle

    from dlion_kernels.exchange.pipeline import StepAbortedError

    e = DistributedStepError(7, "all_gather(aggregate)", "d", advice="Restart the replica.")
    e.rank = 5  # as raised on rank 5
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is DistributedStepError and str(back) == str(e)
    assert (back.step, back.collective, back.rank) == (7, "all_gather(aggregate)", 5)
    a = StepAbortedError(4, [2, 0])
    back = pickle.loads(pickle.dumps(a))
    assert type(back) is StepAbortedError and str(back) == str(a)
    assert (back.step, back.ranks) == (4, [2, 0])


class _Work:
    """A torch.distributed Work stand-in: records how it was waited on."""

    def __init__(self, result=True, error=None):
        self.result, self.error, self.waits = result, error, []

    def wait(self, *args):
        self.waits.append(args)
        if self.error is not None:
            raise self.error
        return self.result


def test_wait_passes_the_limit():
    work = _Work()
    assert wait(work, 1, "x") is None and work.waits == [()]
    wait(work, 1, "x", timeout=2)
    assert work.waits[-1] == (datetime.timedelta(seconds=2),)


def test_wait_turns_a_backend_error_into_the_step_error():
    cause = RuntimeError("[gloo] Connection closed by peer")
    with pytest.raises(DistributedStepError) as info:
        wait(_Work(error=cause), 4, "all_gather(aggregate)", label="step", applied="all kept")
    e = info.value
    assert e.__cause__ is cause and (e.step, e.collective) == (4, "all_gather(aggregate)")
    assert str(e).startswith("step 4: collective all_gather(aggregate) failed on rank -1: "
                             "RuntimeError: [gloo] Connection closed by peer. ")
    assert "; all kept. " in str(e)


def test_wait_that_returns_false_is_a_timeout():
    with pytest.raises(DistributedStepError, match=r"collective g failed on rank -1: not finished "
                                                   r"after 0:00:01.500000\. "):
        wait(_Work(result=False), 2, "g", timeout=1.5)


def test_wait_lets_a_step_error_through_unchanged():
    inner = DistributedStepError(9, "inner", "detail")
    with pytest.raises(DistributedStepError) as info:
        wait(_Work(error=inner), 1, "outer")
    assert info.value is inner


def test_collective_without_timeout_waits_under_the_groups_own_and_keeps_its_work():
    from dlion_kernels.exchange import collectives

    work, calls = _Work(), []
    assert collective("c", 5, lambda *a, **k: calls.append((a, k)) or work, 1, 2,
                      group="g") is None
    assert calls == [((1, 2), {"group": "g", "async_op": True})]
    assert work.waits == [()]  # no limit: the group's own timeout applies
    # kept past the wait, so that gloo's thread is never the one to free its tensors
    assert collectives._recent[-1] is work


def test_collective_with_timeout_waits_on_the_work():
    work, calls = _Work(), []
    assert collective("c", 5, lambda *a, **k: calls.append(k) or work, timeout=0.5) is None
    assert calls == [{"async_op": True}] and work.waits == [(datetime.timedelta(seconds=0.5),)]


def test_collective_async_returns_the_started_work():
    work = _Work()
    assert collective("c", 5, lambda *a, **k: work, async_op=True) is work
    assert work.waits == []  # the caller waits, through wait()


def test_collective_failure_names_step_and_collective():
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    for kw in ({}, {"timeout": 1}, {"async_op": True}):
        with pytest.raises(DistributedStepError, match=r"^D-Lion step 8: collective "
                                                       r"all_reduce\(x\) failed on rank -1: "
                                                       r"RuntimeError: boom\. ") as info:
            collective("all_reduce(x)", 8, broken, **kw)
        assert isinstance(info.value.__cause__, RuntimeError)


def test_collective_checks_the_timeout_first():
    calls = []
    with pytest.raises(ValueError, match="timeout must be"):
        collective("c", 1, lambda *a, **k: calls.append(1), timeout=-1)
    assert calls == []


def test_group_timeout_without_a_group():
    assert group_timeout() is None


# ----------------------------------------------------------------------------- real gloo ranks


NAME = "all_reduce(probe)"


def _probe_worker(rank, n, group, mode):
    """Group timeouts first (every rank), then one collective that the victim never joins."""
    import torch.distributed as dist

    from dlion_kernels.recipes.groups import fsdp_mesh
    from dlion_kernels.exchange import collectives

    mesh = fsdp_mesh(n, "cpu")  # the builders' FSDP2 mesh (one replica of n shards)
    # the fourth group's own timeout is 30 s, not less: making a group waits for its peers with
    # that timeout, and on a loaded machine a peer can be seconds late
    timeouts = [collectives.group_timeout(), collectives.group_timeout(group),
                collectives.group_timeout(collectives.new_group(range(n))),
                collectives.group_timeout(collectives.new_group([0, 1], timeout=30)),
                collectives.group_timeout(mesh["replicate"].get_group()),
                collectives.group_timeout(mesh["shard"].get_group())]
    start = time.monotonic()
    error = dict(label="probe", applied="nothing to undo")
    try:
        if mode == "sync":
            collectives.collective(NAME, 7, dist.all_reduce, torch.ones(4), group=group, **error)
        else:
            work = collectives.collective(NAME, 7, dist.all_reduce, torch.ones(4), group=group,
                                          async_op=True, **error)
            collectives.wait(work, 7, NAME, **error)
    except dk.DistributedStepError as e:
        return dict(timeouts=timeouts, step=e.step, collective=e.collective, rank=e.rank,
                    message=str(e), cause=type(e.__cause__).__name__,
                    elapsed=time.monotonic() - start)
    return dict(timeouts=timeouts, message=None)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_dead_peer_names_the_collective_and_step(mode):
    """Rank 2 of 3 is killed just before the collective: ranks 0 and 1 raise DistributedStepError
    naming it, the step and their rank, with the caller's label and what was applied, within
    the group's timeout plus a margin. The groups made by new_group, and those of the builders'
    FSDP2 mesh, take the default group's timeout (120 s in the harness, not torch's 30 min), or
    their own."""
    fault = Fault(rank=2, step=7, point=f"before:{NAME}", action="kill")
    results = run_with_fault(3, _probe_worker, fault, mode, pg_timeout=PG_TIMEOUT,
                             deadline=DEADLINE)
    assert results[2] is None  # the victim left nothing
    for r in (0, 1):
        res = results[r]
        assert res["timeouts"] == [datetime.timedelta(seconds=s) for s in (
            120, PG_TIMEOUT, 120, 30, 120, 120)]
        assert (res["step"], res["collective"], res["rank"]) == (7, NAME, r)
        assert res["message"].startswith(f"probe 7: collective {NAME} failed on rank {r}: ")
        assert "; nothing to undo. The process group is no longer usable" in res["message"]
        assert res["cause"] != "NoneType"  # the backend's exception is chained
        assert res["elapsed"] < PG_TIMEOUT + MARGIN, res["elapsed"]


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
