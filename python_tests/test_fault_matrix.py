"""Errors a step can raise, then a fresh start; and ranks dying or stalling at the collectives of
a step on a mesh.

"Errors then a fresh start" (no rank dies, so many cases run in one launch): every error a
step can raise -- a second backward, a non-finite gradient, ranks on different steps, bad input
on one rank found after buckets were sent -- leaves no collective pending on any group the
library made. Each case then builds a NEW optimizer on the same process group, steps, and checks
that every rank holds bit-identical parameters; the processes exit 0 (``run_workers`` fails
otherwise). A second backward with ``overlap=True`` once left the gathers of the given up
exchange pending on a group the overlap had made for them, and the next optimizer's first step
aborted a rank (gloo: "Received data size doesn't match expected size").

The fault matrix (one launch per fault, since a rank dies): on a 2 x 2 FSDP2 mesh a rank is
killed or stalled at each collective of a step, with overlap on and off; every survivor raises
``DistributedStepError`` naming the step and the collective within the timeout, and no rank has
applied the step (the step's last collective runs over the whole mesh).
"""

import gc
import os
import sys

import pytest
import torch
from decisions import Net, identical, loss, outcome, stepped_once
from workers import run_workers

import dlion_kernels as dk
from dlion_kernels.exchange import sharded
from dlion_kernels.exchange.pipeline import A2A, GATHER


def _fresh_step(net, rank, overlap, hierarchy=None, t=7) -> bool:
    """A new optimizer on the same group takes two steps; parameters identical everywhere."""
    opt = dk.DistributedLion(net.parameters(), lr=1e-2, overlap=overlap, bucket_mb=1e-6,
                             hierarchy=hierarchy)
    for k in range(2):
        opt.zero_grad(set_to_none=True)
        loss(net, rank, t + k).backward()
        opt.step()
    return identical(list(net.parameters()))


def _errors_then_fresh_start(rank, n):
    out = {}
    for overlap, hierarchy in ((True, None), (False, None), (True, 2)):
        for case in ("second backward", "non-finite", "mismatch", "bad input on one rank",
                     "bad input everywhere"):
            if case == "second backward" and not overlap:
                continue  # without overlap a second backward only accumulates
            if hierarchy and case.startswith("bad input"):
                continue  # hierarchy checks its input at the step's first bucket
            net, opt = stepped_once(rank, lr=1e-2, overlap=overlap, bucket_mb=1e-6,
                                    hierarchy=hierarchy)
            if case == "mismatch" and rank == 0:  # before backward: overlap sends it there
                for p in net.parameters():
                    opt.state[p]["step"] += 5
            before = [p.detach().clone() for p in net.parameters()]
            if case == "second backward":
                loss(net, rank, 1).backward()
                seen = outcome(lambda: loss(net, rank, 2).backward())
            else:
                loss(net, rank, 1, nan=case == "non-finite" and rank == 1).backward()
                if case.startswith("bad input") and (rank == 2 or "everywhere" in case):
                    net.unused.weight.grad = torch.zeros(4, 4).to_sparse()  # refused
                seen = outcome(opt.step)
            unchanged = all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
            del opt  # its hooks go with it: the new optimizer is the only one on the model
            gc.collect()
            out[(overlap, hierarchy, case)] = dict(
                error=seen, unchanged=unchanged, fresh=_fresh_step(net, rank, overlap, hierarchy))
    return out


EXPECTED = {
    "second backward": {r: "RuntimeError" for r in range(4)},
    "non-finite": {r: "NonFiniteGradientError" for r in range(4)},
    "mismatch": {r: "StepMismatchError" for r in range(4)},
    # one decision: the same error on every rank, naming rank 2's (python_tests/optim/
    # test_dlion_step_decisions.py has more mistakes on one rank only)
    "bad input on one rank": {r: "TypeError" for r in range(4)},
    "bad input everywhere": {r: "TypeError" for r in range(4)},
}


def test_errors_then_fresh_start():
    """Flat, 4 ranks, overlap on and off, and hierarchy=2 with overlap: each error on every
    rank alike (one decision), the step changed nothing, and a new optimizer on the same group
    then steps with bit-identical parameters on every rank; every process exits 0."""
    results = run_workers(4, _errors_then_fresh_start)
    wrong = [(r, key, got) for r, res in enumerate(results) for key, got in res.items()
             if got["error"][0] != EXPECTED[key[2]][r] or not got["unchanged"]
             or not got["fresh"]]
    assert not wrong, wrong
    assert len(results[0]) == 4 + 5 + 3
    for r, res in enumerate(results):
        for (overlap, hierarchy, case), got in res.items():
            where = (r, overlap, hierarchy, case, got["error"])
            if case == "second backward":
                assert "no_sync" in got["error"][1], where
            if case == "bad input on one rank":
                assert "failed on ranks [2]" in got["error"][1], where
            assert got["unchanged"], where
            assert got["fresh"], where


def _built_again_worker(rank, n):
    """A second overlap optimizer on the same model while the first still lives: once after a
    finished step, once with the first one's step in flight (backward done, no step())."""
    out = {}
    for when in ("after step", "in flight"):
        net, old = stepped_once(rank, lr=1e-2, overlap=True, bucket_mb=1e-6)
        if when == "in flight":
            loss(net, rank, 1).backward()  # buckets exchanged during backward, step() not called
        new = dk.DistributedLion(net.parameters(), lr=1e-2, overlap=True, bucket_mb=1e-6)
        new.zero_grad(set_to_none=True)
        before = [p.detach().clone() for p in net.parameters()]
        seen = outcome(old.step)  # the old one refuses, changing nothing
        unchanged = all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
        # the new one steps as an optimizer built alone on a model in this state would
        twin = Net()
        twin.load_state_dict(net.state_dict())
        alone = dk.DistributedLion(twin.parameters(), lr=1e-2, overlap=True, bucket_mb=1e-6)
        for t in (2, 3, 4):
            for model, opt in ((net, new), (twin, alone)):
                opt.zero_grad(set_to_none=True)
                loss(model, rank, t).backward()
                opt.step()
        same = all(torch.equal(a, b) for a, b in zip(net.parameters(), twin.parameters()))
        out[when] = dict(error=seen, unchanged=unchanged, same=same,
                         identical=identical(list(net.parameters())))
    return out


def test_overlap_optimizer_built_again_on_the_same_model():
    """Two overlap optimizers on one model: the newer takes over the parameters' backward hooks
    (without it, its first backward met the older one's hooks and was refused as a second
    backward); the older one's in-flight collectives are completed, and its step() raises on
    every rank, changing nothing."""
    results = run_workers(2, _built_again_worker)
    for r, res in enumerate(results):
        for when, got in res.items():
            assert got["error"][0] == "RuntimeError", (r, when, got)
            assert "took over" in got["error"][1], (r, when, got)
            assert got["unchanged"] and got["same"] and got["identical"], (r, when, got)


# ----------------------------------------------------------------------------- the fault matrix

HERE = os.path.dirname(os.path.abspath(__file__))
for sub in ("optim", "local_steps"):  # the FSDP2 and DiLoCo tests' models and helpers
    if os.path.join(HERE, sub) not in sys.path:
        sys.path.insert(0, os.path.join(HERE, sub))  # spawned ranks inherit sys.path

PG_TIMEOUT, MARGIN, FAULT_STEP, DEADLINE = 5.0, 20.0, 2, 300.0


FSDP_CASES = [
    # (overlap, victim, action, point, collectives the survivors may name). Every survivor
    # raises at FAULT_STEP: the agreement over the whole mesh is the step's last collective,
    # and no rank completes it unless every rank reached it.
    (False, 3, "kill", "after:" + A2A, {A2A, GATHER, sharded.HEADERS}),
    (False, 2, "kill", "before:" + GATHER, {A2A, GATHER, sharded.HEADERS}),
    (True, 1, "stop", "before:" + sharded.HEADERS, {sharded.HEADERS}),
    (True, 3, "kill", "before:" + sharded.HEADERS, {sharded.HEADERS}),
]


@pytest.mark.parametrize("overlap,victim,action,point,names", FSDP_CASES,
                         ids=[f"{'overlap' if c[0] else 'plain'}-{c[2]}-{c[3].split('(')[0]}"
                              for c in FSDP_CASES])
def test_fsdp_rank_dies_or_stalls_nothing_applied(overlap, victim, action, point, names):
    """2 x 2 FSDP2: a rank killed or stalled at a collective of step FAULT_STEP; every survivor
    raises DistributedStepError naming that step and a collective of it, in bounded time, with
    its shards and momenta as they were: no rank applied the step."""
    from faults import Fault, check_survivors, run_with_fault
    from test_fsdp import _fault_worker  # the FSDP2 fault worker, with overlap on or off

    fault = Fault(rank=victim, step=FAULT_STEP, point=point, action=action)
    results = run_with_fault(4, _fault_worker, fault, FAULT_STEP + 2, overlap,
                             pg_timeout=PG_TIMEOUT, deadline=DEADLINE)
    check_survivors(results, fault, 4, steps={FAULT_STEP}, names=names,
                    limit=2 * PG_TIMEOUT + MARGIN, where={"step"})


def _diloco_fsdp_worker(rank, n, group, outer):
    from test_failures_diloco import fsdp_worker

    return fsdp_worker(rank, n, group, outer)


@pytest.mark.parametrize("outer", ["dlion", "nesterov"])
def test_diloco_fsdp_stall_before_last_collective(outer):
    """DiLoCo on a 2 x 2 FSDP2 mesh, rank 3 stalled just before the sync's last collective
    (D-Lion's agreement, Nesterov's non-finite flag): it runs over the whole mesh, so every
    survivor raises at that sync with theta_bar, the momenta and the parameters as before (with
    it inside the shard group, ranks 0 and 1 used to apply the sync)."""
    from faults import Fault, run_with_fault
    from test_failures_diloco import FAULT_SYNC, _check_survivors

    from dlion_kernels.local_steps.diloco import FLAGS

    last = sharded.HEADERS if outer == "dlion" else FLAGS
    fault = Fault(rank=3, step=FAULT_SYNC, point=f"before:{last}", action="stop")
    results = run_with_fault(4, _diloco_fsdp_worker, fault, outer, pg_timeout=PG_TIMEOUT,
                             deadline=DEADLINE)
    _check_survivors(results, 4, 3, FAULT_SYNC, 0, {last}, replicas=[(0, 2)])
