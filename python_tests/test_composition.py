"""Features used together (docs/composition.md): the pairs that no other test runs together
against a reference, and the refusals that no other test shows. One launch of 2 gloo processes
runs every case in turn; each test checks one pair from its results.

Pairs that work, each bit for bit against its reference after every step (DiLoCo: every sync):

- ``group-overlap``: ``DistributedLion(group=g, overlap=True)``, g an explicit group (every
  collective of the steps runs on it), against ``overlap=False`` on the default group;
- ``ddp-overlap``: DDP's comm hook on a ``DistributedLion(overlap=True)`` (DDP's buckets take over
  the exchange), against ``overlap=False`` without DDP;
- ``ddp-group``: ``DDP(process_group=g)`` with the hook on ``DistributedLion(group=g)``, against
  the plain optimizer on the default group;
- ``group-scaler``, ``fsdp-scaler``: ``torch.amp.GradScaler`` with an overflow on rank 1 at one
  step, on ``group=g`` and on FSDP2 parameters (2 replicas x 1 shard), against the same run
  without a scaler and without that step (power-of-two scales unscale exactly); every rank skips
  that step and the scales stay equal;
- ``overlap-ckpt``, ``ddp-ckpt``, ``scaler-ckpt``: ``dk.save_state`` in the middle of a run, then
  a fresh model and optimizer (and DDP wrapper with its hook, and scaler) load it and go on,
  against the run never interrupted;
- ``group-diloco``, ``group-stream``: ``DiLoCo(group=g)`` with D-Lion's outer options, and with
  Nesterov on 2 fragments streamed (``overlap_steps=1``), against the default group;
- ``scaler-diloco``, ``scaler-stream``: a GradScaler on DiLoCo's inner optimizer, with an overflow
  on rank 1 (that rank alone skips its inner step: inner steps are local), plain and with 2
  fragments streamed, against no scaler and rank 1 leaving out that inner step;
- ``options-stream``: D-Lion's outer options and SparseLoCo with 2 fragments streamed: at each
  sync's apply, theta_bar and the outer state are what ``test_outer_options.py``'s and
  ``test_sparseloco.py``'s references compute from the snapshots at the sync's start, and the
  parameters the documented merge;
- ``fsdp-options``: DiLoCo's outer options and SparseLoCo on FSDP2 parameters: 2 replicas x 1 shard
  against the unsharded run; 1 replica x 2 shards against those references on each rank's local
  shards (the options' "tensor" is the local shard there).

Refusals, each the same error on every rank, with the live optimizers, hooks and groups
untouched (they go on stepping exactly as twins that never saw the refusal):

- ``hierarchy-group``: ``DistributedLion(hierarchy=2 or "auto", group=g, overlap=True)`` beside
  a live ``DistributedLion(group=g, overlap=True)`` on the same parameters;
- ``diloco-inner``: ``DiLoCo`` over a ``DistributedLion`` with ``overlap=True``, with
  ``hierarchy=2`` and one that runs DDP's comm hook (with fragments, overlap_steps, options);
- ``ddp-scaler``: a GradScaler with DDP's comm hook: ``ValueError`` at the first
  ``scaler.step(opt)``, nothing updated, and the next steps go on as if it had not been tried;
- ``ddp-hierarchy``: ``register_ddp_comm_hook`` with a hierarchical optimizer: ``ValueError``, no
  hook registered (DDP takes another afterwards);
- ``elastic-triple``: ``manager=`` with ``hierarchy=2`` and ``overlap=True`` (three features at
  once) beside a live overlap optimizer on the same parameters.
"""

from __future__ import annotations

import os
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
from decisions import outcome, same_decision
from workers import run_workers

import dlion_kernels as dk
from dlion_kernels.exchange import sharded

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.join(HERE, "local_steps") not in sys.path:  # the DiLoCo tests' models and references
    sys.path.insert(0, os.path.join(HERE, "local_steps"))

import test_diloco_fsdp as loco_fsdp  # noqa: E402
from outer_runs import run as diloco_run  # noqa: E402
from test_outer_options import reference as options_reference  # noqa: E402
from test_sparseloco import reference as sparse_reference  # noqa: E402

N = 2
STEPS = 4
OVERFLOW = (2, 1)  # (step, rank): an inf in that rank's gradient, after its backward
SAVE_AT = 2  # the checkpoint cases save after this many steps (GradScaler: after the overflow)
TINY = 40 * 4 / 2**20  # bucket_mb: about 40 fp32 elements, several buckets per step
OPTS = dk.DLionOuterOptions(error_feedback=True, scale=True, ef_decay=0.5)
SPARSE = dk.SparseLoCoOptions(chunk=16, topk=3, ef_decay=0.9)


# ----------------------------------------------------------------------------- helpers


def _mlp():
    torch.manual_seed(0)  # the same initial weights on every rank
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


def _loss(model, rank, t):
    gen = torch.Generator().manual_seed(100 * t + rank)  # each rank its own data
    return model(torch.randn(4, 6, generator=gen)).square().mean()


def _momentum(opt, p):
    m = opt.state[p]["exp_avg"]
    return sharded.momentum_local(m) if sharded.is_dtensor(m) else m


def _snap(params, opt) -> list:
    """This rank's parameters (local shards) and momenta, copied."""
    return [sharded.own_shard(p).detach().clone() for p in params] + \
        [_momentum(opt, p).clone() for p in params]


def _train(model, opt, rank, steps, *, call=None, loss=_loss, scaler=None, overflow=None,
           leave_out=None) -> list:
    """Steps ``steps`` of ``opt`` on ``model`` (``call``: the module to run, a DDP wrapper);
    ``scaler``: a GradScaler; ``overflow``: (step, rank) where an inf lands in the gradient;
    ``leave_out``: a step the optimizer does not take (a reference without the overflowed step).
    Returns the snapshot after each step, with the skip flag and the scale."""
    call = call or model
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for t in steps:
        opt.zero_grad()
        value = loss(call, rank, t)
        if scaler is None:
            value.backward()
            if t != leave_out:
                opt.step()
        else:
            scaler.scale(value).backward()
            if (t, rank) == overflow:
                sharded.own_shard(params[0].grad).view(-1)[0] = float("inf")
            scaler.step(opt)
            scaler.update()
        skipped = opt.last_stats.skipped if t != leave_out else True
        out.append((_snap(params, opt), skipped, scaler.get_scale() if scaler else None))
    return out


class _Groups:
    """The ``group=`` of every collective called inside (each runs as it would without this)."""

    NAMES = ("all_to_all_single", "all_gather_single", "all_gather_into_tensor", "all_gather",
             "all_reduce", "broadcast")

    def __enter__(self):
        self.seen, self.saved = [], {k: getattr(dist, k) for k in self.NAMES if hasattr(dist, k)}
        for name, fn in self.saved.items():
            setattr(dist, name, self._wrap(fn))
        return self

    def _wrap(self, fn):
        def call(*args, **kwargs):
            self.seen.append(kwargs.get("group"))
            return fn(*args, **kwargs)
        return call

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)

    def only(self, group) -> bool:
        """Whether collectives ran, every one on ``group``."""
        return bool(self.seen) and all(g is group for g in self.seen)


def _ddp(model, group=None):
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, process_group=group, bucket_cap_mb=TINY)


# ----------------------------------------------------------------------------- pairs that work


def _group_overlap(rank, sub):
    model = _mlp()
    opt = dk.DistributedLion(model.parameters(), lr=1e-2, weight_decay=0.1, group=sub,
                             overlap=True, bucket_mb=TINY)
    with _Groups() as seen:
        got = _train(model, opt, rank, range(STEPS))
    buckets = opt.last_stats.buckets
    ref_model = _mlp()
    ref = dk.DistributedLion(ref_model.parameters(), lr=1e-2, weight_decay=0.1)
    return dict(got=got, ref=_train(ref_model, ref, rank, range(STEPS)), on_group=seen.only(sub),
                buckets=buckets)


def _ddp_overlap(rank, sub):
    model = _mlp()
    opt = dk.DistributedLion(model.parameters(), lr=1e-2, weight_decay=0.1, overlap=True,
                             bucket_mb=TINY)
    ddp = _ddp(model)
    dk.register_ddp_comm_hook(ddp, opt)
    got = _train(model, opt, rank, range(STEPS), call=ddp)
    hooked, buckets = opt.ddp_hooked, opt.last_stats.buckets
    ref_model = _mlp()
    ref = dk.DistributedLion(ref_model.parameters(), lr=1e-2, weight_decay=0.1)
    return dict(got=got, ref=_train(ref_model, ref, rank, range(STEPS)), hooked=hooked,
                buckets=buckets)


def _ddp_group(rank, sub):
    model = _mlp()
    opt = dk.DistributedLion(model.parameters(), lr=1e-2, weight_decay=0.1, group=sub)
    ddp = _ddp(model, sub)
    dk.register_ddp_comm_hook(ddp, opt)
    with _Groups() as seen:
        got = _train(model, opt, rank, range(STEPS), call=ddp)
    ref_model = _mlp()
    ref = dk.DistributedLion(ref_model.parameters(), lr=1e-2, weight_decay=0.1)
    return dict(got=got, ref=_train(ref_model, ref, rank, range(STEPS)), on_group=seen.only(sub),
                hooked=opt.ddp_hooked)


def _group_scaler(rank, sub):
    model = _mlp()
    opt = dk.DistributedLion(model.parameters(), lr=1e-2, weight_decay=0.1, group=sub)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    with _Groups() as seen:
        got = _train(model, opt, rank, range(STEPS), scaler=scaler, overflow=OVERFLOW)
    ref_model = _mlp()
    ref = dk.DistributedLion(ref_model.parameters(), lr=1e-2, weight_decay=0.1)
    return dict(got=got, ref=_train(ref_model, ref, rank, range(STEPS), leave_out=OVERFLOW[0]),
                on_group=seen.only(sub))


def _net_loss(net, rank, t):
    gen = torch.Generator().manual_seed(1000 * t + rank)
    return net([torch.randn(s, generator=gen) for s in loco_fsdp.SHAPES])


def _fsdp_scaler(rank, sub):
    mesh = loco_fsdp._mesh(2, 1)  # 2 replicas of 1 shard: the replicas vote
    net = loco_fsdp._fsdp(mesh)
    opt = dk.DistributedLion(net.parameters(), lr=1e-2, weight_decay=0.1, device_mesh=mesh)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    got = _train(net, opt, rank, range(STEPS), loss=_net_loss, scaler=scaler, overflow=OVERFLOW)
    plain = loco_fsdp.Net()
    ref = dk.DistributedLion(plain.parameters(), lr=1e-2, weight_decay=0.1)
    return dict(got=got, ref=_train(plain, ref, rank, range(STEPS), loss=_net_loss,
                                    leave_out=OVERFLOW[0]), sharded=opt.sharded)


def _resumed(rank, build, root, name, steps=STEPS + 2, save_at=SAVE_AT):
    """The run of ``build()`` (model, optimizer, module to call, scaler) whole, and saved after
    ``save_at`` steps then resumed by a fresh one (the model's weights and the scaler's state
    saved beside ``dk.save_state``'s files): the snapshots after each step of both."""
    model, opt, call, scaler = build()
    whole = _train(model, opt, rank, range(steps), call=call, scaler=scaler, overflow=OVERFLOW)
    model, opt, call, scaler = build()
    first = _train(model, opt, rank, range(save_at), call=call, scaler=scaler, overflow=OVERFLOW)
    where = os.path.join(root, name)
    dk.save_state(opt, where)
    kept = dict(model=model.state_dict(), scaler=scaler.state_dict() if scaler else None)
    torch.save(kept, os.path.join(where, f"model-{rank}.pt"))
    model, opt, call, scaler = build()
    kept = torch.load(os.path.join(where, f"model-{rank}.pt"), weights_only=False)
    model.load_state_dict(kept["model"])
    if scaler is not None:
        scaler.load_state_dict(kept["scaler"])
    dk.load_state(opt, where)
    rest = _train(model, opt, rank, range(save_at, steps), call=call, scaler=scaler,
                  overflow=OVERFLOW)
    return dict(got=first + rest, ref=whole)


def _overlap_ckpt(rank, sub, root):
    def build():
        model = _mlp()
        return model, dk.DistributedLion(model.parameters(), lr=1e-2, overlap=True,
                                         bucket_mb=TINY), None, None
    return _resumed(rank, build, root, "overlap")


def _ddp_ckpt(rank, sub, root):
    def build():
        model = _mlp()
        opt = dk.DistributedLion(model.parameters(), lr=1e-2, weight_decay=0.1)
        ddp = _ddp(model)
        dk.register_ddp_comm_hook(ddp, opt)
        return model, opt, ddp, None
    return _resumed(rank, build, root, "ddp")


def _scaler_ckpt(rank, sub, root):
    def build():
        model = _mlp()
        return model, dk.DistributedLion(model.parameters(), lr=1e-2), None, \
            torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    # saved after the overflow: the skip and the back-off are in the saved state
    return _resumed(rank, build, root, "scaler", steps=STEPS + 3, save_at=OVERFLOW[0] + 1)


def _loco(model, rank, t, inner, scaler=None, overflow=None, leave_out=None):
    """One inner step of a DiLoCo run (test_diloco's data); with ``scaler``, scaled."""
    gen = torch.Generator().manual_seed(1000 * rank + t)
    x, y = torch.randn(8, 7, generator=gen), torch.randn(8, 3, generator=gen)
    inner.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    if scaler is None:
        loss.backward()
        if (t, rank) != leave_out:
            inner.step()
        return
    scaler.scale(loss).backward()
    if (t, rank) == overflow:
        next(model.parameters()).grad.view(-1)[0] = float("inf")
    scaler.step(inner)
    scaler.update()


def _diloco(rank, steps, *, scaler=False, leave_out=None, **kw):
    """A DiLoCo run on test_diloco's model; the snapshot after every step (parameters, theta_bar,
    outer momenta) and the scale."""
    from test_diloco import _model

    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    diloco = dk.DiLoCo(model, inner, **kw)
    amp = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2) if scaler else None
    out = []
    for t in range(1, steps + 1):
        _loco(model, rank, t, inner, amp, OVERFLOW, leave_out)
        diloco.step()
        out.append(([p.detach().clone() for p in model.parameters()],
                    [x.clone() for x in diloco.theta_bar],
                    [m.clone() for m in diloco.outer_momenta],
                    amp.get_scale() if amp else None))
    return out, diloco


def _group_diloco(rank, sub):
    kw = dict(sync_every=2, outer_lr=0.5, outer_options=OPTS)
    with _Groups() as seen:
        got, diloco = _diloco(rank, 6, group=sub, **kw)
    return dict(got=got, ref=_diloco(rank, 6, **kw)[0], on_group=seen.only(sub),
                residuals=diloco.outer_residuals is not None)


def _group_stream(rank, sub):
    kw = dict(sync_every=4, outer="nesterov", fragments=2, overlap_steps=1)
    with _Groups() as seen:
        got, _ = _diloco(rank, 9, group=sub, **kw)
    return dict(got=got, ref=_diloco(rank, 9, **kw)[0], on_group=seen.only(sub))


def _scaler_diloco(rank, sub):
    kw = dict(sync_every=2, outer_lr=5e-2)
    return dict(got=_diloco(rank, 6, scaler=True, **kw)[0],
                ref=_diloco(rank, 6, leave_out=OVERFLOW, **kw)[0])


def _scaler_stream(rank, sub):
    kw = dict(sync_every=4, outer_lr=5e-2, fragments=2, overlap_steps=1)
    return dict(got=_diloco(rank, 9, scaler=True, **kw)[0],
                ref=_diloco(rank, 9, leave_out=OVERFLOW, **kw)[0])


STREAMED = {  # options-stream: DiLoCo keywords (outer_runs.run adds the outer betas)
    # average: two binary votes tie, and the reference has no tie rule
    "options": dict(sync_every=4, fragments=2, overlap_steps=1, outer_lr=0.5, mode="average",
                    outer_weight_decay=0.1, outer_options=OPTS),
    "sparseloco": dict(sync_every=4, fragments=2, overlap_steps=1, outer="sparseloco",
                       outer_lr=0.8, outer_weight_decay=0.1, outer_options=SPARSE),
}


def _options_stream(rank, sub):
    return {name: diloco_run(rank, N, 9, **kw) for name, kw in STREAMED.items()}


def _fsdp_snap(net, diloco):
    """outer_runs.snap on local shards: (params, theta_bar, momenta, residuals)."""
    residual = diloco.outer_residuals
    return ([sharded.own_shard(p).detach().clone() for p in net.parameters()],
            [t.clone() for t in diloco.theta_bar], [m.clone() for m in diloco.outer_momenta],
            None if residual is None else [r.clone() for r in residual])


def _fsdp_diloco(rank, mesh, steps=4, **kw):
    """DiLoCo on test_diloco_fsdp's model: FSDP2 over ``mesh``, or plain (None); the snapshot
    before and after every step."""
    net = loco_fsdp.Net() if mesh is None else loco_fsdp._fsdp(mesh)
    inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
    diloco = dk.DiLoCo(net, inner, **kw, **({} if mesh is None else dict(device_mesh=mesh)))
    records = []
    for t in range(1, steps + 1):
        loco_fsdp._inner_step(net, inner, rank, t)
        before = _fsdp_snap(net, diloco)
        diloco.step()
        records.append(dict(before=before, after=_fsdp_snap(net, diloco)))
    return records


FSDP_OPTIONS = {  # fsdp-options: DiLoCo keywords
    "options": dict(sync_every=2, outer_lr=0.5, outer_weight_decay=0.1, outer_options=OPTS),
    "sparseloco": dict(sync_every=2, outer="sparseloco", outer_lr=0.8, outer_options=SPARSE),
}


def _fsdp_options(rank, sub):
    out = {}
    replicas, shards = loco_fsdp._mesh(2, 1), None
    for name, kw in FSDP_OPTIONS.items():
        out[name, "2x1"] = _fsdp_diloco(rank, replicas, **kw)
        out[name, "plain"] = _fsdp_diloco(rank, None, **kw)
    dist.barrier()
    shards = loco_fsdp._mesh(1, 2)  # one replica sharded over both ranks
    for name, kw in FSDP_OPTIONS.items():
        out[name, "1x2"] = _fsdp_diloco(rank, shards, **kw)
    return out


# ----------------------------------------------------------------------------- refusals


def _same_state(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _hierarchy_group(rank, sub):
    """A live overlap optimizer on group=g; the refused ones would take over its hooks."""
    model, twin = _mlp(), _mlp()
    kw = dict(lr=1e-2, group=sub, overlap=True, bucket_mb=TINY)
    live = dk.DistributedLion(model.parameters(), **kw)
    first = _train(model, live, rank, range(1))
    refused = {  # hierarchy="auto" takes no overlap=True (refused on its own)
        2: outcome(lambda: dk.DistributedLion(model.parameters(), hierarchy=2, **kw)),
        "auto": outcome(lambda: dk.DistributedLion(model.parameters(), hierarchy="auto",
                                                   group=sub))}
    got = first + _train(model, live, rank, range(1, 3))
    ref = _train(twin, dk.DistributedLion(twin.parameters(), **kw), rank, range(3))
    return dict(refused=refused, got=got, ref=ref)


def _inner_kinds(rank, kind):
    """(model, a DistributedLion of ``kind`` over it, the module to call)."""
    model = _mlp()
    if kind == "overlap":
        return model, dk.DistributedLion(model.parameters(), lr=1e-2, overlap=True,
                                         bucket_mb=TINY), model
    if kind == "hierarchy":
        return model, dk.DistributedLion(model.parameters(), lr=1e-2, hierarchy=2), model
    opt = dk.DistributedLion(model.parameters(), lr=1e-2)
    ddp = _ddp(model)
    dk.register_ddp_comm_hook(ddp, opt)
    return model, opt, ddp


INNER = {  # diloco-inner: the inner DistributedLion, and DiLoCo's keywords
    "overlap": dict(sync_every=4, fragments=2, overlap_steps=1, outer_options=OPTS),
    "hierarchy": dict(sync_every=2, outer="nesterov"),
    "ddp-hook": dict(sync_every=4, fragments=2, outer="sparseloco"),
}


def _diloco_inner(rank, sub):
    out = {}
    for kind, kw in INNER.items():
        model, opt, call = _inner_kinds(rank, kind)
        first = _train(model, opt, rank, range(1), call=call)
        refused = outcome(lambda: dk.DiLoCo(model, opt, **kw))
        got = first + _train(model, opt, rank, range(1, 3), call=call)
        twin, twin_opt, twin_call = _inner_kinds(rank, kind)
        ref = _train(twin, twin_opt, rank, range(3), call=twin_call)
        out[kind] = dict(refused=refused, got=got, ref=ref)
    return out


def _ddp_scaler(rank, sub):
    """fp16 GradScaler with DDP's comm hook: refused at the first scaler.step, nothing changed,
    and the same optimizer goes on (the refused step left out)."""
    model = _mlp()
    opt = dk.DistributedLion(model.parameters(), lr=1e-2, weight_decay=0.1)
    ddp = _ddp(model)
    dk.register_ddp_comm_hook(ddp, opt)
    params = list(model.parameters())
    got = _train(model, opt, rank, range(1), call=ddp)
    opt.zero_grad()
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(_loss(ddp, rank, 1)).backward()
    before = _snap(params, opt)
    refused = outcome(lambda: scaler.step(opt))
    unchanged = _same_state(before, _snap(params, opt))
    got += _train(model, opt, rank, range(2, 4), call=ddp)
    twin = _mlp()
    twin_opt = dk.DistributedLion(twin.parameters(), lr=1e-2, weight_decay=0.1)
    twin_ddp = _ddp(twin)
    dk.register_ddp_comm_hook(twin_ddp, twin_opt)
    ref = _train(twin, twin_opt, rank, (0, 2, 3), call=twin_ddp)
    return dict(refused=refused, unchanged=unchanged, got=got, ref=ref)


def _ddp_hierarchy(rank, sub):
    """A hierarchical optimizer (overlap=True: live hooks) refused by DDP's comm hook; DDP has no
    hook afterwards (it takes one), and the optimizer steps as its twin."""
    model, twin = _mlp(), _mlp()
    kw = dict(lr=1e-2, hierarchy=2, overlap=True, bucket_mb=TINY)
    opt = dk.DistributedLion(model.parameters(), **kw)
    first = _train(model, opt, rank, range(1))
    ddp = _ddp(model)
    refused = outcome(lambda: dk.register_ddp_comm_hook(ddp, opt))
    got = first + _train(model, opt, rank, range(1, 3))  # without DDP's forward: its own hooks
    ref = _train(twin, dk.DistributedLion(twin.parameters(), **kw), rank, range(3))
    flat = dk.DistributedLion(model.parameters(), lr=1e-2)
    takes_another = outcome(lambda: dk.register_ddp_comm_hook(ddp, flat))
    return dict(refused=refused, got=got, ref=ref, takes_another=takes_another)


def _elastic_triple(rank, sub):
    """manager= with hierarchy=2 and overlap=True beside a live overlap optimizer on the same
    parameters. The checks come before torchft's servers are reached, so a Manager without them
    is enough here (test_elastic.py does the same)."""
    try:
        from torchft.manager import Manager
    except ImportError:
        return None
    manager = Manager.__new__(Manager)
    manager._use_async_quorum = False
    model, twin = _mlp(), _mlp()
    kw = dict(lr=1e-2, overlap=True, bucket_mb=TINY)
    live = dk.DistributedLion(model.parameters(), **kw)
    got = _train(model, live, rank, range(1))
    refused = outcome(lambda: dk.DistributedLion(model.parameters(), hierarchy=2,
                                                 manager=manager, **kw))
    got += _train(model, live, rank, range(1, 3))
    ref = _train(twin, dk.DistributedLion(twin.parameters(), **kw), rank, range(3))
    return dict(refused=refused, got=got, ref=ref)


CASES = {
    "group-overlap": _group_overlap, "ddp-overlap": _ddp_overlap, "ddp-group": _ddp_group,
    "group-scaler": _group_scaler, "fsdp-scaler": _fsdp_scaler,
    "overlap-ckpt": _overlap_ckpt, "ddp-ckpt": _ddp_ckpt, "scaler-ckpt": _scaler_ckpt,
    "group-diloco": _group_diloco, "group-stream": _group_stream,
    "scaler-diloco": _scaler_diloco, "scaler-stream": _scaler_stream,
    "options-stream": _options_stream, "fsdp-options": _fsdp_options,
    "hierarchy-group": _hierarchy_group, "diloco-inner": _diloco_inner,
    "ddp-scaler": _ddp_scaler, "ddp-hierarchy": _ddp_hierarchy, "elastic-triple": _elastic_triple,
}
CHECKPOINTS = ("overlap-ckpt", "ddp-ckpt", "scaler-ckpt")


def _worker(rank, n, root):
    torch.set_num_threads(1)
    sub = dist.new_group([0, 1])  # an explicit group: not the default one
    out = {}
    for name, case in CASES.items():
        args = (root,) if name in CHECKPOINTS else ()
        out[name] = case(rank, sub, *args)
        dist.barrier()  # every rank is done with the case
    return out


@pytest.fixture(scope="module")
def ranks():
    with tempfile.TemporaryDirectory() as root:
        yield run_workers(N, _worker, root)


# ----------------------------------------------------------------------------- checks


def _equal(a, b) -> bool:
    """The same values, tensor by tensor, in nested dicts, lists and tuples of tensors."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and \
            all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _matches(ranks, case, key=None):
    """Every rank's run equals its reference after every step, and the ranks hold the same
    parameters (the replicas' synced state)."""
    for r, res in enumerate(ranks):
        got = res[case] if key is None else res[case][key]
        assert len(got["got"]) == len(got["ref"]) > 0, (case, r)
        for t, (a, b) in enumerate(zip(got["got"], got["ref"])):
            assert _equal(a, b), (case, key, r, t)


def test_overlap_with_an_explicit_group(ranks):
    _matches(ranks, "group-overlap")
    for res in ranks:
        assert res["group-overlap"]["on_group"] and res["group-overlap"]["buckets"] >= 2


def test_overlap_under_ddps_comm_hook(ranks):
    _matches(ranks, "ddp-overlap")
    for res in ranks:
        assert res["ddp-overlap"]["hooked"] and res["ddp-overlap"]["buckets"] >= 2


def test_ddps_comm_hook_on_an_explicit_group(ranks):
    _matches(ranks, "ddp-group")
    for res in ranks:
        assert res["ddp-group"]["on_group"] and res["ddp-group"]["hooked"]


def _overflow_skipped_everywhere(ranks, case):
    for res in ranks:
        runs = res[case]["got"]
        assert [s for _, s, _ in runs] == [t == OVERFLOW[0] for t in range(len(runs))], case
        scales = [s for _, _, s in runs]
        assert scales[OVERFLOW[0]] < scales[OVERFLOW[0] - 1], (case, scales)
        assert scales == [s for _, _, s in ranks[0][case]["got"]], case  # equal on every rank


def test_grad_scaler_with_an_explicit_group(ranks):
    for res in ranks:  # the reference has no scale: its state and skips
        got, ref = res["group-scaler"]["got"], res["group-scaler"]["ref"]
        assert all(_equal(a[:2], b[:2]) for a, b in zip(got, ref)) and len(got) == len(ref)
        assert res["group-scaler"]["on_group"]
    _overflow_skipped_everywhere(ranks, "group-scaler")


def test_grad_scaler_with_fsdp2(ranks):
    for res in ranks:
        got, ref = res["fsdp-scaler"]["got"], res["fsdp-scaler"]["ref"]
        assert res["fsdp-scaler"]["sharded"]
        assert all(_equal(a[:2], b[:2]) for a, b in zip(got, ref)) and len(got) == len(ref)
    _overflow_skipped_everywhere(ranks, "fsdp-scaler")


def test_overlap_resumes_from_a_checkpoint(ranks):
    _matches(ranks, "overlap-ckpt")


def test_ddps_comm_hook_resumes_from_a_checkpoint(ranks):
    _matches(ranks, "ddp-ckpt")


def test_grad_scaler_resumes_from_a_checkpoint(ranks):
    _matches(ranks, "scaler-ckpt")
    _overflow_skipped_everywhere(ranks, "scaler-ckpt")


def test_diloco_outer_options_on_an_explicit_group(ranks):
    _matches(ranks, "group-diloco")
    for res in ranks:
        assert res["group-diloco"]["on_group"] and res["group-diloco"]["residuals"]


def test_diloco_fragments_streamed_on_an_explicit_group(ranks):
    _matches(ranks, "group-stream")
    for res in ranks:
        assert res["group-stream"]["on_group"]


def _inner_overflow_on_one_rank(ranks, case):
    """Rank 1's scale backed off at the overflow, rank 0's did not (inner steps are local)."""
    t = OVERFLOW[0] - 1  # the snapshot after inner step OVERFLOW[0] (steps count from 1)
    scales = [[s[3] for s in res[case]["got"]] for res in ranks]
    assert scales[1][t] < scales[1][t - 1] and scales[0][t] >= scales[0][t - 1], scales


def test_grad_scaler_on_diloco_inner_steps(ranks):
    for res in ranks:
        got, ref = res["scaler-diloco"]["got"], res["scaler-diloco"]["ref"]
        assert len(got) == len(ref) and all(_equal(a[:3], b[:3]) for a, b in zip(got, ref))
    _inner_overflow_on_one_rank(ranks, "scaler-diloco")


def test_grad_scaler_on_diloco_fragments_streamed(ranks):
    for res in ranks:
        got, ref = res["scaler-stream"]["got"], res["scaler-stream"]["ref"]
        assert len(got) == len(ref) and all(_equal(a[:3], b[:3]) for a, b in zip(got, ref))
    _inner_overflow_on_one_rank(ranks, "scaler-stream")


def _applied(records, kw):
    """(start, apply, fragment) of every sync of a streamed run (tau = 1)."""
    from dlion_kernels.local_steps import fragments as frag

    h, P, tau = kw["sync_every"], kw["fragments"], kw["overlap_steps"]
    return [(t, t + tau, frag.due(t, h, P)) for t in range(1, len(records) + 1 - tau)
            if frag.due(t, h, P) is not None]


def _check_streamed(runs, name, kw, n, alpha=0.5):
    """Each sync of ``runs`` (every rank's records, outer_runs.run's) against the reference
    computed from the snapshots at its start; applied tau steps later with the merge."""
    syncs = _applied(runs[0]["records"], kw)
    assert len(syncs) >= 4, syncs
    for start, apply, f in syncs:
        idx = runs[0]["fragments"][f]
        before = [r["records"][start - 1]["before"] for r in runs]
        if name == "sparseloco":
            theta, slots = sparse_reference(before, idx, n, kw)
            residuals = None
        else:
            theta, slots, residuals = options_reference(
                before, idx, n, kw["outer_options"], mode=kw["mode"], outer_lr=kw["outer_lr"],
                wd=kw["outer_weight_decay"])
        for r, run in enumerate(runs):
            record = run["records"][apply - 1]
            params, thetas, moms, res = record["after"]
            for k, i in enumerate(idx):
                assert torch.equal(thetas[i], theta[k]), (name, start, r, i)
                assert torch.equal(moms[i], slots[r][k]), (name, start, r, i)
                if residuals is not None:
                    assert torch.equal(res[i], residuals[r][k]), (name, start, r, i)
                merged = torch.lerp(thetas[i], record["before"][0][i], alpha)
                assert torch.equal(params[i], merged), (name, start, r, i)


def test_outer_options_with_fragments_streamed(ranks):
    for name, kw in STREAMED.items():
        _check_streamed([res["options-stream"][name] for res in ranks], name, kw, N)


def test_outer_options_on_fsdp2(ranks):
    from dlion_kernels.local_steps import fragments as frag

    for name, kw in FSDP_OPTIONS.items():
        # 2 replicas x 1 shard: the unsharded run, bit for bit
        for res in ranks:
            assert _equal(res["fsdp-options"][name, "2x1"], res["fsdp-options"][name, "plain"])
        # 1 replica x 2 shards: each rank's local shards follow the reference alone (n = 1)
        for res in ranks:
            records = res["fsdp-options"][name, "1x2"]
            syncs = [t for t in range(1, len(records) + 1)
                     if frag.due(t, kw["sync_every"], 1) is not None]
            assert len(syncs) >= 2
            for t in syncs:
                before, after = records[t - 1]["before"], records[t - 1]["after"]
                idx = [i for i, p in enumerate(before[0]) if p.numel()]  # shards held here
                cfg = dict(kw, outer_weight_decay=kw.get("outer_weight_decay", 0.0))
                if name == "sparseloco":
                    theta, slots = sparse_reference([before], idx, 1, cfg)
                else:
                    theta, slots, _ = options_reference(
                        [before], idx, 1, kw["outer_options"], outer_lr=kw["outer_lr"],
                        wd=cfg["outer_weight_decay"])
                for k, i in enumerate(idx):
                    assert torch.equal(after[1][i], theta[k]), (name, t, i)
                    assert torch.equal(after[2][i], slots[0][k]), (name, t, i)
                    assert torch.equal(after[0][i], after[1][i]), (name, t, i)
        # the two ranks hold different shards (sharded, not replicated)
        a, b = (res["fsdp-options"][name, "1x2"][-1]["after"][0] for res in ranks)
        assert [x.shape for x in a] != [x.shape for x in b] or not _equal(a, b)


def _refused(ranks, got, kind, words):
    same_decision(got, kind, words, "refusal")


def test_hierarchy_with_an_explicit_group_is_refused(ranks):
    for L in (2, "auto"):
        _refused(ranks, [res["hierarchy-group"]["refused"][L] for res in ranks], "ValueError",
                 ["group=None", "nothing was built"] if L == 2 else ["group=None"])
    _matches(ranks, "hierarchy-group")


def test_diloco_refuses_a_distributed_lion_inner_optimizer(ranks):
    for kind in INNER:
        _refused(ranks, [res["diloco-inner"][kind]["refused"] for res in ranks], "ValueError",
                 ["inner_optimizer is a DistributedLion", "nothing was built on any rank"])
        _matches(ranks, "diloco-inner", kind)


def test_grad_scaler_with_ddps_comm_hook_is_refused_at_the_first_step(ranks):
    _refused(ranks, [res["ddp-scaler"]["refused"] for res in ranks], "ValueError",
             ["GradScaler cannot be combined with overlap=True or the DDP comm hook",
              "nothing was updated"])
    for res in ranks:
        assert res["ddp-scaler"]["unchanged"]
    _matches(ranks, "ddp-scaler")


def test_ddps_comm_hook_refuses_hierarchy_and_registers_nothing(ranks):
    _refused(ranks, [res["ddp-hierarchy"]["refused"] for res in ranks], "ValueError",
             ["hierarchy (L > 1) cannot run in DDP's comm hook"])
    for res in ranks:
        assert res["ddp-hierarchy"]["takes_another"] == ("ok", None)
    _matches(ranks, "ddp-hierarchy")



def test_elastic_hierarchy_with_overlap_is_refused(ranks):
    """Three features at once: refused at construction on every rank, before the gate or any
    backward hook exists."""
    if ranks[0]["elastic-triple"] is None:
        pytest.skip("torchft is not installed")
    _refused(ranks, [res["elastic-triple"]["refused"] for res in ranks], "ValueError",
             ["manager= with hierarchy does not combine with overlap=True",
              "nothing was built on any rank"])
    _matches(ranks, "elastic-triple")


# ----------------------------------------------------------------------------- the docs' table


def test_the_docs_table_names_a_test_for_every_pair():
    """docs/composition.md: every pair of its features once, each "works" or "refused", and every
    test the page names exists (``file::test`` under python_tests/)."""
    import itertools
    import re

    page = open(os.path.join(HERE, os.pardir, "docs", "composition.md")).read()
    features_part, pairs_part = page.split("## Every pair")
    features = re.findall(r"^\| ([\w= ]+) \| .* \| .* \|$",
                          features_part.split("## The features")[1], re.M)
    features = [f for f in features if f != "name"]
    assert len(features) == 10, features
    rows = re.findall(r"^\| ([\w= ]+) \| ([\w= ]+) \| (.*) \| (.*) \|$",
                      pairs_part.split("\n## ")[0], re.M)
    rows = [r for r in rows if r[0] != "feature"]
    pairs = [frozenset(r[:2]) for r in rows]
    assert sorted(map(sorted, pairs)) == sorted(
        map(sorted, map(frozenset, itertools.combinations(features, 2)))), pairs
    for a, b, result, shown in rows:
        assert result.startswith(("works", "refused")), (a, b, result)
        assert "::" in shown, (a, b, shown)
    for path, name in set(re.findall(r"`([\w/]+\.py)::(\w+)`", page)):
        source = open(os.path.join(HERE, path)).read()
        assert re.search(rf"^def {name}\(", source, re.M), f"{path}::{name} does not exist"
