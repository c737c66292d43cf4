"""One decision at every step of ``DistributedLion`` over FSDP2 parameters, on a 2 x 2 gloo mesh
(4 real processes, one launch): a mistake on one rank only (rank 3: replica 1, shard 1) makes
every rank of the mesh raise the same error, naming rank 3 and what it found, within the bound
given (``timeout=``), with every rank's local shards and momenta unchanged bit for bit. Overlap
off and on. The mistakes: a non-finite gradient, a local gradient shard of another shape, a
negative lr or another lr set on that rank after construction (before or after backward),
other betas, and a closure that raises there. After each case the settings are put back and
the same optimizer steps again, then a new one on the same model and mesh: every replica of
each shard holds the same bits (nothing was left in flight on any group).
"""

import datetime
import gc

import pytest
import torch
import torch.distributed as dist
from decisions import outcome, same_decision
from test_fsdp import _data, _fsdp, _groups, _locals, _momenta, _replicas_identical, _same
from workers import run_workers

import dlion_kernels as dk
from dlion_kernels.exchange import sharded

BOUND = 20  # seconds: the bound of every wait of a step (the optimizer's timeout=)
LIMIT = 40  # seconds: the mesh groups' own timeout (FSDP's collectives), so no case hangs long
ODD = 3  # the rank that makes the mistake

# case: (the error type every rank raises, words every message holds)
CASES = {
    "non-finite gradient": ("NonFiniteGradientError", ["inf or NaN"]),
    "gradient of another shape": ("ValueError", [f"failed on ranks [{ODD}]", "shape"]),
    "negative lr": ("ValueError", [f"failed on ranks [{ODD}]", "lr must be"]),
    "negative lr before backward": ("ValueError", [f"failed on ranks [{ODD}]", "lr must be"]),
    "other lr": ("ValueError", [f"ranks [{ODD}]", "0.5", "nothing was updated on any rank"]),
    "other lr before backward": ("ValueError", [f"ranks [{ODD}]", "0.5"]),
    "other betas": ("ValueError", [f"ranks [{ODD}]", "(0.8, 0.5)"]),
    "closure fails": ("RuntimeError", [f"failed on ranks [{ODD}]", "closure failed here"]),
}


def _attempt(net, opt, rank, case):
    """Backward of step 1 and ``opt.step()``, with ``case``'s mistake made on rank ``ODD``."""
    odd = rank == ODD
    last = opt.param_groups[-1]
    if odd and case == "negative lr before backward":
        last["lr"] = -1.0
    if odd and case == "other lr before backward":
        last["lr"] = 0.5
    xs = _data(1, rank)
    if odd and case == "non-finite gradient":
        xs[0][20, 3] = float("nan")  # a row of the (33, 6) weight that rank 3's shard holds
    net(xs).backward()
    if odd:
        if case == "gradient of another shape":
            grad = sharded.own_shard(list(net.parameters())[0].grad)
            grad.data = torch.zeros(3)  # the local shard FSDP reduced, replaced here
        elif case == "negative lr":
            last["lr"] = -1.0
        elif case == "other lr":
            last["lr"] = 0.5
        elif case == "other betas":
            last["betas"] = (0.8, 0.5)  # beta2 only: with overlap, beta1 was read in backward
    closure = None
    if case == "closure fails":
        def closure():
            if odd:
                raise RuntimeError("closure failed here")
    opt.step(closure)


def _case(rank, mesh, overlap, case):
    replicate = mesh["replicate"].get_group()
    net = _fsdp(mesh)

    def make():
        return dk.DistributedLion(_groups(net), device_mesh=mesh, overlap=overlap,
                                  bucket_mb=1e-6, timeout=BOUND)

    opt = make()
    net(_data(0, rank)).backward()
    opt.step()  # one good step (forms the buckets)
    opt.zero_grad(set_to_none=True)
    settings = [dict(lr=g["lr"], betas=g["betas"], weight_decay=g["weight_decay"])
                for g in opt.param_groups]
    before = (_locals(net), _momenta(opt, net))
    seen = outcome(lambda: _attempt(net, opt, rank, case))
    unchanged = _same(before[0], _locals(net)) and _same(before[1], _momenta(opt, net))
    if seen[0] in ("DistributedStepError", "RuntimeError") and "closure" not in case:
        # a rank waited out a timeout: the groups are not fit for more (and the case failed)
        return dict(error=seen, unchanged=unchanged, after=(("not run", None),) * 2,
                    identical=False)
    # put everything back: the same optimizer steps again, then a new one, on the same mesh
    for g, s in zip(opt.param_groups, settings):
        g.update(s)

    def again():
        for t in (2, 3):
            opt.zero_grad(set_to_none=True)
            net(_data(t, rank)).backward()
            opt.step()

    after = outcome(again)
    # a new optimizer on the same model and mesh (the old one's hooks go with it)
    opt = None
    gc.collect()

    def anew():
        fresh = make()
        for t in (4, 5):
            fresh.zero_grad(set_to_none=True)
            net(_data(t, rank)).backward()
            fresh.step()

    renewed = outcome(anew)
    identical = after == renewed == ("ok", None) and _replicas_identical(net, replicate)
    return dict(error=seen, unchanged=unchanged, after=(after, renewed), identical=identical)


def _bounded_mesh():
    """The 2 x 2 mesh ("replicate", "shard") of init_device_mesh, on groups with LIMIT's
    timeout: a rank left waiting in FSDP's own collectives fails the case in bounded time."""
    from torch.distributed.device_mesh import DeviceMesh

    limit = datetime.timedelta(seconds=LIMIT)
    shard = [dist.new_group(r, timeout=limit) for r in ([0, 1], [2, 3])]
    replicate = [dist.new_group(r, timeout=limit) for r in ([0, 2], [1, 3])]
    me = dist.get_rank()
    return DeviceMesh.from_group([replicate[me % 2], shard[me // 2]], "cpu",
                                 mesh=torch.arange(4).view(2, 2),
                                 mesh_dim_names=("replicate", "shard"))


# The mistake found during backward with overlap on, its own test: giving the step up inside
# FSDP's reduce-scatter hook would wait there for the whole mesh while the shard group's peer
# waits for this rank in FSDP's next reduce-scatter; it is left for step() to raise.
IN_BACKWARD = (True, "negative lr before backward")
ORDER = [(o, c) for o in (False, True) for c in CASES if (o, c) != IN_BACKWARD] + [IN_BACKWARD]


def _worker(rank, n):
    mesh = _bounded_mesh()
    out = {}
    for overlap, case in ORDER:
        dist.barrier()  # the default group's long timeout: every rank is done with the last
        out[(overlap, case)] = _case(rank, mesh, overlap, case)
    return out


@pytest.fixture(scope="module")
def results():
    return run_workers(4, _worker, timeout=900)


def _wrong(results, keys):
    wrong = []
    for key in keys:
        kind, words = CASES[key[1]]
        got = [r[key] for r in results]
        try:
            assert all(g["unchanged"] for g in got), "changed"
            assert all(g["after"] == (("ok", None),) * 2 for g in got), "next steps failed"
            assert all(g["identical"] for g in got), "replicas differ"
            same_decision([g["error"] for g in got], kind, words, key)
        except AssertionError as e:
            wrong.append((key, str(e)[:800], [g["after"] for g in got]))
    return wrong


def test_one_decision_at_every_step_on_a_mesh(results):
    wrong = _wrong(results, ORDER[:-1])
    assert not wrong, "\n".join(map(str, wrong))


def test_setting_found_wrong_during_backward_with_overlap(results):
    wrong = _wrong(results, [IN_BACKWARD])
    assert not wrong, "\n".join(map(str, wrong))
