"""One decision for dk.DiLoCo (the same verdict on every rank), on real gloo processes: a mistake
on one rank only (an argument the others do not share, one only that rank gets wrong, other
starting weights, a loaded state of another inner step or another theta_bar) makes every rank
raise the same error within the bound given (``timeout=``), with nothing built or loaded
anywhere; ranks resumed at different inner steps make Nesterov's outer step raise
``StepMismatchError`` on every rank with nothing applied (its all-reduce carries every rank's
step, as D-Lion's header does). Plain DiLoCo on 4 ranks and DiLoCo over FSDP2 on a 2 x 2 mesh
(``device_mesh=`` and ``group=``), in one launch of 4 processes, each case on a fresh model;
afterwards the same groups still sync.
"""

import torch
import torch.distributed as dist
from decisions import check_cases, outcome
from test_diloco import _inner, _inner_step, _model
from test_diloco_fsdp import _fsdp
from test_diloco_fsdp import _inner_step as _fsdp_inner_step
from workers import run_workers

from dlion_kernels.exchange import sharded
from dlion_kernels.local_steps.diloco import DiLoCo

H = 2
BOUND = 30  # seconds: every wait of the verdict (the object's timeout=)


def _theta(d):
    return [t.clone() for t in d.theta_bar] + [m.clone() for m in d.outer_momenta]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _load_case(build, step, rank, odd_rank, change):
    """3 inner steps (one sync), then every rank loads its own state, ``change``d on
    ``odd_rank``: the outcome, and whether this rank's DiLoCo is as before the load."""
    net, inner, d = build()
    for t in range(1, 4):
        step(net, inner, rank, t)
        d.step()
    sd = d.state_dict()
    before = (d.inner_step, _theta(d))
    loaded = change(sd) if rank == odd_rank else sd
    result = outcome(lambda: d.load_state_dict(loaded))
    return result, before[0] == d.inner_step and _same(before[1], _theta(d))


def _resume_case(build, step, rank, odd_rank):
    """Nesterov, one sync done; ``odd_rank``'s counter then moved a whole window ahead (as a rank
    that resumed from another save would be): the next sync raises on every rank, nothing
    applied, the counter not advanced."""
    net, inner, d = build()
    for t in range(1, H + 1):
        step(net, inner, rank, t)
        d.step()
    if rank == odd_rank:
        d.inner_step += H
    start = d.inner_step
    for t in range(H + 1, 2 * H):
        step(net, inner, rank, t)
        d.step()
    step(net, inner, rank, 2 * H)
    before = (_theta(d), [sharded.own_shard(p).detach().clone() for p in net.parameters()])
    result = outcome(d.step)
    after = (_theta(d), [sharded.own_shard(p).detach().clone() for p in net.parameters()])
    unchanged = _same(before[0], after[0]) and _same(before[1], after[1])
    return result, unchanged and d.inner_step == start + H - 1


def _with(sd, **changes):
    return {**sd, **changes}


def _perturb(net):
    with torch.no_grad():
        sharded.own_shard(next(net.parameters())).view(-1)[0] += 1e-3
    return net


def _worker(rank, n):
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    kw = dict(timeout=BOUND, outer_lr=5e-2)

    def plain(sync_every=H, perturb=False, outer="nesterov", **extra):
        net = _model()
        if perturb:
            _perturb(net)
        inner = _inner("adamw", net)
        return net, inner, DiLoCo(net, inner, sync_every=sync_every, outer=outer,
                                  **{**kw, **extra})

    out["sync_every"] = outcome(lambda: plain(4 if rank == 3 else 2))
    out["bad fragments"] = outcome(lambda: plain(fragments=3 if rank == 3 else 1))
    out["weights"] = outcome(lambda: plain(perturb=rank == 1))
    out["load step"] = _load_case(plain, _inner_step, rank, 2,
                                  lambda sd: _with(sd, inner_step=sd["inner_step"] + 2))
    out["load theta"] = _load_case(
        plain, _inner_step, rank, 0,
        lambda sd: _with(sd, theta_bar=[t + 1.0 for t in sd["theta_bar"]]))
    out["load broken"] = _load_case(plain, _inner_step, rank, 1,
                                    lambda sd: _with(sd, outer="dlion"))
    out["nesterov resume"] = _resume_case(plain, _inner_step, rank, 1)

    # FSDP2, 2 replicas x 2 shards
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    replicate = mesh.get_group("replicate")

    def fsdp(sync_every=H, perturb=False, outer="nesterov", where=None, **extra):
        net = _fsdp(mesh)
        if perturb:
            _perturb(net)
        inner = _inner("adamw", net)
        where = dict(device_mesh=mesh) if where is None else where
        return net, inner, DiLoCo(net, inner, sync_every=sync_every, outer=outer,
                                  **{**kw, **where, **extra})

    out["fsdp sync_every"] = outcome(lambda: fsdp(4 if rank == 3 else 2, outer="dlion"))
    out["fsdp bad alpha"] = outcome(lambda: fsdp(merge_alpha=2.0 if rank == 3 else 0.5))
    out["fsdp weights"] = outcome(lambda: fsdp(perturb=rank == 2))
    out["fsdp group="] = outcome(
        lambda: fsdp(4 if rank == 1 else 2, where=dict(group=replicate)))
    out["fsdp load step"] = _load_case(fsdp, _fsdp_inner_step, rank, 3,
                                       lambda sd: _with(sd, inner_step=sd["inner_step"] + 2))
    out["fsdp nesterov resume"] = _resume_case(fsdp, _fsdp_inner_step, rank, 3)

    # after every refusal the same groups still sync, and the replicas agree
    net, inner, d = plain()
    for t in range(1, H + 1):
        _inner_step(net, inner, rank, t)
        d.step()
    out["plain after"] = _theta(d)[: len(d.theta_bar)]
    net, inner, d = fsdp()
    for t in range(1, H + 1):
        _fsdp_inner_step(net, inner, rank, t)
        d.step()
    out["fsdp after"] = _theta(d)[: len(d.theta_bar)]
    out["world"] = dist.get_world_size()
    return out


EXPECTED = {  # case: (error type, what every message names)
    "sync_every": ("ValueError", ["ranks [3] sync_every=4; rank 0 sync_every=2",
                                  "nothing was built on any rank"]),
    "bad fragments": ("ValueError", ["DiLoCo(...) failed on ranks [3]",
                                     "must be a multiple of fragments"]),
    "weights": ("ValueError", ["the model's parameters on ranks [1] differ from rank 0's",
                               "same weights"]),
    "load step": ("StepMismatchError", ["ranks [2] (inner_step, in-flight (fragment, step))=(5",
                                        "nothing was loaded on any rank"]),
    "load theta": ("ValueError", ["theta_bar on ranks [0] differ from rank 1's"]),
    "load broken": ("ValueError", ["DiLoCo.load_state_dict failed on ranks [1]",
                                   "saved with outer='dlion'"]),
    "nesterov resume": ("StepMismatchError", ["different inner steps: [[4, 6, 4, 4]]",
                                              "nothing of this sync was applied on any rank"]),
    "fsdp sync_every": ("ValueError", ["ranks [3] sync_every=4; rank 0 sync_every=2"]),
    "fsdp bad alpha": ("ValueError", ["failed on ranks [3]", "merge_alpha"]),
    # rank 2 is rank 0's replica: the same shard
    "fsdp weights": ("ValueError", ["the model's parameters on ranks [2] differ from rank 0's"]),
    "fsdp group=": ("ValueError", ["ranks [1] sync_every=4; rank 0 sync_every=2"]),
    "fsdp load step": ("StepMismatchError", ["ranks [3] (inner_step, in-flight"]),
    # rows: the mesh's ranks, each with its replicate group's steps; rank 3 is replica 1 of
    # shard 1, so the rows of ranks 1 and 3 (shard 1's group) hold its 6
    "fsdp nesterov resume": ("StepMismatchError",
                             ["different inner steps: [[4, 4], [4, 6], [4, 4], [4, 6]]"]),
}


def test_one_decision_on_every_rank():
    ranks = run_workers(4, _worker, timeout=600)
    check_cases(ranks, EXPECTED)  # the same error everywhere; load cases: nothing loaded
    for r in range(4):
        assert _same(ranks[r]["plain after"], ranks[0]["plain after"])
        assert _same(ranks[r]["fsdp after"], ranks[r ^ 2]["fsdp after"])  # replicas of a shard
