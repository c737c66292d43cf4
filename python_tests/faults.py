"""Kill or stall one rank of a real gloo job at a chosen point of a step, and collect what the
other ranks saw.

    fault = Fault(rank=1, step=2, point="after:all_to_all_single(votes)", action="kill")
    results = run_with_fault(n, worker, fault, pg_timeout=3.0)

``worker(rank, n, group, *args)`` runs in each of n fresh processes (forked from the tests' rank
server) and returns a picklable result (survivors usually catch the error and return what they
saw). ``group`` is a gloo group of
all ranks whose own timeout is ``pg_timeout``; it is made after a warm-up (imports, backend
loading, a barrier on the default group, whose timeout is long), so that a slow start on a loaded
machine is not mistaken for a stall. Workers may also warm up on the default group and switch to
``group`` just before the step under test. In the victim, the fault fires at ``point`` of step
``step``:

- ``"before:<name>"`` / ``"after:<name>"``: just before / after the collective called
  ``<name>`` (the names ``dlion_kernels.exchange.collectives.collective`` is given, e.g.
  ``all_to_all_single(votes)``, ``all_gather(aggregate)``), at its ``occurrence``-th call in
  the step (1 = the first; buckets of an overlapped step call the same names in turn);
- ``"apply"``: after the first ``apply`` launch of the step (so in the middle of applying when the
  step has several launches, e.g. several param groups).

Any module of the package that calls the stages or the collectives through those names is covered
without change, so overlap, hierarchy and decentralized steps can reuse this harness: give their
collective names as points. ``action`` is ``"kill"`` (SIGKILL) or ``"stop"`` (SIGSTOP, a stall).
Everything is bounded: the run ends after ``deadline`` seconds and every process still alive
(stopped ones included) is killed, even when the test fails.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback

import rankserver


@dataclasses.dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    point: str  # "before:<collective>" | "after:<collective>" | "apply"
    action: str = "kill"  # "kill" | "stop"
    occurrence: int = 1  # fire at the k-th call of that collective in the step (buckets)


def _fire(action: str) -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL if action == "kill" else signal.SIGSTOP)


def _arm(fault: Fault) -> None:
    """Patch this (the victim's) process so that the fault fires at its point."""
    import dlion_kernels.exchange.collectives as collectives
    from dlion_kernels.kernels import backends

    original = collectives.collective
    current = {"step": None}
    calls: dict = {}

    def collective(name, step, fn, *args, **kwargs):
        current["step"] = step
        here = step == fault.step and fault.point.partition(":")[2] == name
        if here:
            calls[name] = calls.get(name, 0) + 1
            here = calls[name] == fault.occurrence
        if here and fault.point == f"before:{name}":
            _fire(fault.action)
        work = original(name, step, fn, *args, **kwargs)  # async_op=True: the started Work
        if here and fault.point == f"after:{name}":
            _fire(fault.action)
        return work

    # Every module that imported the function by name gets the patched one.
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("dlion_kernels") and \
                getattr(mod, "collective", None) is original:
            mod.collective = collective

    real_get = backends.get

    class _Kernels:
        def __init__(self, inner):
            self._inner = inner

        def __getattr__(self, attr):
            return getattr(self._inner, attr)

        def apply(self, *args, **kwargs):
            out = self._inner.apply(*args, **kwargs)
            if fault.point == "apply" and current["step"] == fault.step:
                _fire(fault.action)
            return out

    backends.get = lambda name: _Kernels(real_get(name))


def _entry(rank, n, worker, store, out_dir, pg_timeout, fault, args):
    import torch
    import torch.distributed as dist

    path = os.path.join(out_dir, f"rank{rank}.pkl")
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=n,
                                timeout=datetime.timedelta(seconds=120))
        torch.set_num_threads(1)
        import dlion_kernels

        dlion_kernels.available_backends()  # loads the native module and triton: slow under load
        dist.barrier()
        group = dist.new_group(list(range(n)), timeout=datetime.timedelta(seconds=pg_timeout))
        if fault is not None and fault.rank == rank:
            _arm(fault)
        result = ("ok", worker(rank, n, group, *args))
    except BaseException:
        result = ("error", traceback.format_exc())
    with open(path + ".tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(path + ".tmp", path)
    # No destroy_process_group: with a dead or stopped peer it may block. Leave at once.
    os._exit(0)


def run_with_fault(n: int, worker, fault: Fault | None, *args, pg_timeout: float = 3.0,
                   deadline: float = 60.0) -> list:
    """Run ``worker`` on n ranks with ``fault`` injected; return each rank's result (None for a
    rank that left none, e.g. the victim). Raises RuntimeError if a survivor raised outside the
    worker or left no result before ``deadline``."""
    survivors = [r for r in range(n) if fault is None or r != fault.rank]
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        paths = {r: os.path.join(tmp, f"rank{r}.pkl") for r in range(n)}
        # forked from the tests' rank server (torch imported once); the victim's death or stall
        # does not end the others, and every rank still running at the end is killed
        rankserver.run_bare(n, _entry, worker, store, tmp, pg_timeout, fault, args,
                            done=lambda: all(os.path.exists(paths[r]) for r in survivors),
                            deadline=deadline)
        results = []
        for r in range(n):
            if os.path.exists(paths[r]):
                with open(paths[r], "rb") as f:
                    results.append(pickle.load(f))
            else:
                results.append(None)
    problems = []
    for r in survivors:
        if results[r] is None:
            problems.append(f"rank {r}: no result after {deadline}s (hung?)")
        elif results[r][0] == "error":
            problems.append(f"rank {r}:\n{results[r][1]}")
    if problems:
        raise RuntimeError("fault run failed\n" + "\n".join(problems))
    return [None if res is None else res[1] for res in results]


# ----------------------------------------------------------------------------- checks


def snapshot(opt, params) -> tuple[list, list]:
    """Clones of ``params`` and of their momenta in ``opt`` (None before a parameter's first
    step)."""
    moms = [opt.state[p]["exp_avg"].clone() if "exp_avg" in opt.state[p] else None
            for p in params]
    return [p.detach().clone() for p in params], moms


def attempt(calls) -> dict | None:
    """Run ``calls`` ([(where, fn), ...]) in order; at a ``DistributedStepError`` return what it
    said, where and how long that call took; None when every call returned."""
    import dlion_kernels as dk

    for where, fn in calls:
        start = time.monotonic()
        try:
            fn()
        except dk.DistributedStepError as e:
            return dict(error=str(e), step=e.step, collective=e.collective, where=where,
                        elapsed=time.monotonic() - start)
    return None


def check_survivors(results, fault: Fault, n: int, *, steps, names, limit: float,
                    where=None) -> None:
    """Every survivor raised DistributedStepError at one of ``steps`` naming one of ``names``
    (the message names both), within ``limit`` seconds of the call that raised (in ``where``,
    if given); the failing step left its parameters and momenta exactly as before (all before),
    and the steps completed before it agree bit for bit between survivors (all after).

    A survivor's result: dict(error, step, collective, where, elapsed, before, now, completed)
    with ``before``/``now`` snapshots (``snapshot``) and ``completed`` the parameters after each
    completed step."""
    import torch

    survivors = [r for r in range(n) if r != fault.rank]
    assert results[fault.rank] is None  # the victim never got to report
    for r in survivors:
        res = results[r]
        assert res["error"] is not None, f"rank {r} finished without noticing the dead peer"
        assert res["step"] in steps, (r, res["step"], res["error"])
        assert res["collective"] in names, (r, res["collective"], res["error"])
        assert f"step {res['step']}:" in res["error"] and res["collective"] in res["error"]
        assert res["elapsed"] < limit, (r, res["elapsed"])
        if where is not None:
            assert res["where"] in where, (r, res["where"], res["error"])
        for a, b in zip(res["now"][0], res["before"][0], strict=True):
            assert torch.equal(a, b), f"rank {r}: a parameter moved in the failed step"
        for a, b in zip(res["now"][1], res["before"][1], strict=True):
            assert (a is None and b is None) or torch.equal(a, b), \
                f"rank {r}: a momentum moved in the failed step"
        assert len(res["completed"]) == res["step"], (r, len(res["completed"]), res["step"])
    first = results[survivors[0]]["completed"]
    for r in survivors[1:]:
        for mine, theirs in zip(results[r]["completed"], first):
            for a, b in zip(mine, theirs, strict=True):
                assert torch.equal(a, b), f"rank {r} disagrees on a completed step"
