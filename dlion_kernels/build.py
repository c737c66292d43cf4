"""A named strategy (``strategies.py``) built on one rank: the one place that turns a slug into
optimizers, wrappers and hooks, for the demo and ``bench/bench_training.py`` alike.

    built = build("dlion-vote-overlap", model, Settings(lion_lr=3e-4, bucket_mb=0.25))
    for x, y in data:
        built.zero_grad()
        loss = loss_fn(built(x), y)    # through the wrapper (DDP, gossip) if the strategy has one
        loss.backward()
        sent = built.step()            # the exchange and the update; the bytes this rank sent
    built.finish()                     # outstanding gossip

Every rank builds the same strategies in the same order (building is collective: DDP broadcasts
the parameters, topologies and hierarchies create process groups). One builder per family
(``BUILDERS``: allreduce, local, dlion, fsdp, decentralized, diloco); a new family adds its
builder here and its entries to ``strategies.py``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .accounting import fsdp_unit_bytes, ring_all_reduce_bytes
from .decentralized.wrapper import DecentralizedDataParallel
from .exchange import groups
from .exchange.collectives import gather_into_tensor, reduce_scatter_into_tensor
from .exchange.sharded import local, memory_per_rank
from .local.diloco import DiLoCo
from .optim.accum import AccumAdamW, AccumLion
from .optim.ddp_hook import register_ddp_comm_hook
from .optim.dlion import DistributedLion
from .strategies import Strategy, get


@dataclass(frozen=True)
class Settings:
    """What every strategy of a comparison shares: hyper-parameters and the job's layout."""

    lion_lr: float = 1e-4  # Lion, D-Lion, AccumLion
    adamw_lr: float = 1e-3  # AdamW, AccumAdamW
    weight_decay: float = 0.0
    backend: str | None = None  # dlion_kernels backend (None: the fastest available)
    accum_steps: int | None = None  # K of AccumAdamW / AccumLion; None: the number of ranks
    bucket_mb: float = 25.0  # DDP's buckets, D-Lion's overlap buckets, the gossip buckets
    ranks_per_node: int = 1  # L: the nodes of hierarchies and alternating-exp-ring
    sync_every: int = 8  # DiLoCo's H: inner steps between two syncs of a fragment
    fragments: int = 1  # DiLoCo's P (Streaming DiLoCo's fragments; H a multiple of P)
    diloco_dlion_lr: float | None = None  # diloco-dlion's outer lr (None: DiLoCo's default)
    diloco_nesterov_lr: float | None = None  # diloco-nesterov's outer lr (None: DiLoCo's)
    # diloco-dlion-ef-scale's outer lr (a scaled step: a fraction of 1) and diloco-sparseloco's
    diloco_scaled_lr: float = 1.0
    diloco_sparseloco_lr: float | None = None  # None: DiLoCo's default for SparseLoCo (1.0)

    def __post_init__(self):
        # the rest is checked by the optimizers and wrappers that take it
        _check_count("ranks_per_node", self.ranks_per_node)
        _check_count("sync_every", self.sync_every)
        _check_count("fragments", self.fragments)
        if self.sync_every % self.fragments:
            raise ValueError(f"Settings.sync_every ({self.sync_every}) must be a multiple of "
                             f"Settings.fragments ({self.fragments})")
        if self.accum_steps is not None:
            _check_count("accum_steps", self.accum_steps)


def _check_count(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"Settings.{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"Settings.{name} must be >= 1, got {value}")


class Built:
    """One strategy on one rank. ``module`` is what to call (the model, or DDP / the gossip
    wrapper around it), ``optimizer`` the optimizer to step (None when the wrapper steps during
    backward), ``stats`` the last ``StepStats`` of a D-Lion step (else None)."""

    def __init__(self, strategy: Strategy, model, module, optimizer, sent, source: str, *,
                 after_step=None, finish=None, evaluation=None, extra_state=None):
        self.strategy, self.model, self.module, self.optimizer = strategy, model, module, optimizer
        self._sent = sent  # () -> (bytes this step, bytes to other nodes or None)
        self.bytes_source = source  # where the byte counts come from
        self._after_step = after_step  # () -> None: after the optimizer (DiLoCo's outer step)
        self._finish = finish  # () -> None: end outstanding communication
        self._evaluation = evaluation  # () -> the context to evaluate in
        self._extra_state = extra_state  # () -> state bytes held outside the optimizer (DiLoCo)
        self.bytes_total = self.steps = 0
        self.inter_node_bytes = None  # of the last step (None: the strategy has no nodes)
        self._inter_node_total = 0

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def zero_grad(self) -> None:
        (self.optimizer or self.module).zero_grad(set_to_none=True)

    def step(self) -> int:
        """After ``loss.backward()``: the update (the exchange it still owes first); returns
        the bytes this rank sent in this step."""
        if self.optimizer is not None:
            self.optimizer.step()
        if self._after_step is not None:
            self._after_step()
        sent, self.inter_node_bytes = self._sent()
        self.bytes_total += sent
        self._inter_node_total += self.inter_node_bytes or 0
        self.steps += 1
        return sent

    @property
    def stats(self):
        """The last D-Lion ``StepStats`` when the byte counts come from them, else None (the
        Lion of an all-reduce strategy steps on a group of one: its stats count no bytes)."""
        return self.optimizer.last_stats if self.bytes_source.startswith("StepStats") else None

    def memory(self) -> dict:
        """Bytes this rank holds now for parameters, gradients and optimizer state, counted
        from the tensors (``exchange.sharded.memory_per_rank``: a DTensor counts its local
        shard) over the optimizer, or the gossip wrapper's optimizers; DiLoCo's theta_bar and
        outer momenta count as optimizer state."""
        opts = [self.optimizer] if self.optimizer is not None else self.module.optimizers
        counts = [memory_per_rank(o) for o in opts]
        out = {k: sum(c[k] for c in counts) for k in ("params", "grads", "optimizer_state")}
        if self._extra_state is not None:
            out["optimizer_state"] += self._extra_state()
        return out

    @property
    def bytes_per_step(self) -> int:
        """Mean bytes sent per step (alternating-exp-ring's groups change size step to step)."""
        return round(self.bytes_total / self.steps) if self.steps else 0

    @property
    def inter_node_bytes_per_step(self) -> int | None:
        """Mean bytes sent to other nodes per step (DiLoCo's only at its syncs), or None."""
        if self.inter_node_bytes is None or not self.steps:
            return None
        return round(self._inter_node_total / self.steps)

    def finish(self) -> None:
        """End outstanding communication (the last iteration's gossip)."""
        if self._finish is not None:
            self._finish()

    def evaluation(self):
        """The context to evaluate in: for ranks that hold different parameters (gossip), their
        average over all ranks; otherwise nothing to do."""
        return self._evaluation() if self._evaluation is not None else contextlib.nullcontext()


def build(slug: str, model: torch.nn.Module, settings: Settings) -> Built:
    """``slug``'s optimizer and exchange around ``model`` on this rank of the default process
    group. ValueError if the strategy cannot run on this group (``Strategy.problem``)."""
    strategy = get(slug)
    if not isinstance(settings, Settings):
        raise TypeError(f"settings must be a build.Settings, got {type(settings).__name__}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("build() needs an initialized default process group "
                           "(torch.distributed.init_process_group)")
    n = dist.get_world_size()
    reason = strategy.problem(n, settings.ranks_per_node)
    if reason is not None:
        raise ValueError(reason)
    return BUILDERS[strategy.family](strategy, model, n, settings)


# ----------------------------------------------------------------------------- groups

# Every rank creates every group once per default group, in the same order (dist.new_group is
# collective), with the job's timeout (exchange/groups.py).


def _cached(what, make):
    return groups.cached("build", None, make, what)


def _solo_group():
    """A group of this rank alone (None on a one-rank job: the default group is one)."""
    n, rank = dist.get_world_size(), dist.get_rank()
    if n == 1:
        return None
    return _cached("solo", lambda: [groups.new_group([r]) for r in range(n)][rank])


def _node_groups(L: int):
    """(this rank's node of L consecutive ranks, its group of same-local-rank peers)."""
    n, rank = dist.get_world_size(), dist.get_rank()
    return _cached(("nodes", L), lambda: (
        [groups.new_group(range(s, s + L)) for s in range(0, n, L)][rank // L],
        [groups.new_group(range(j, n, L)) for j in range(L)][rank % L]))


# ----------------------------------------------------------------------------- builders


def _local_optimizer(name: str, params, s: Settings, group):
    if name == "adamw":
        return torch.optim.AdamW(params, lr=s.adamw_lr, weight_decay=s.weight_decay)
    # Plain Lion is D-Lion on a group of one with ternary votes (the exact sign).
    return DistributedLion(params, lr=s.lion_lr, votes="ternary", group=group,
                           weight_decay=s.weight_decay, backend=s.backend)


def _allreduce(strategy: Strategy, model, n: int, s: Settings) -> Built:
    """DDP's gradient all-reduce (fp32, or through a compressing / hierarchical comm hook),
    then the optimizer on each rank alone. Bytes: the ring formula (DDP does not count)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model, bucket_cap_mb=s.bucket_mb)
    wire, d, L = strategy.options["wire"], sum(p.numel() for p in model.parameters()), 1
    if wire == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif wire == "bf16":  # torch's bf16_compress_hook refuses gloo ("needs NCCL")
        ddp.register_comm_hook(None, _bf16_hook)
    elif wire == "hier-fp32":
        L = s.ranks_per_node
        ddp.register_comm_hook(_node_groups(L), _hier_hook)
    opt = _local_optimizer(strategy.optimizer, list(model.parameters()), s, _solo_group())
    if wire == "hier-fp32":  # reduce-scatter + all-gather in the node, the shard's ring across
        inter = round(ring_all_reduce_bytes(n // L, 4 * d / L))
        sent = (round(ring_all_reduce_bytes(L, 4 * d)) + inter, inter)
    else:
        sent = (round(ring_all_reduce_bytes(n, (4 if wire == "fp32" else 2) * d)), None)
    return Built(strategy, model, ddp, opt, lambda: sent, "formula")


def _bf16_hook(state, bucket):
    buf = bucket.buffer()
    low = buf.to(torch.bfloat16).div_(dist.get_world_size())

    def back(fut):
        buf.copy_(fut.value()[0])
        return buf

    return dist.all_reduce(low, async_op=True).get_future().then(back)


@functools.cache
def _hier_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1)  # one thread: buckets in one order on every rank


def _hier_hook(groups, bucket):
    """Reduce-scatter in the node, all-reduce of the shard across nodes, all-gather in the
    node, on one side thread (gloo's reduce-scatter work has no future to chain on)."""
    intra, inter = groups
    buf = bucket.buffer()
    fut = torch.futures.Future()
    gather = gather_into_tensor()
    scatter = reduce_scatter_into_tensor()

    def run():
        try:
            L = dist.get_world_size(intra)
            numel, pad = buf.numel(), (-buf.numel()) % L
            flat = torch.cat([buf, buf.new_zeros(pad)]) if pad else buf
            shard = flat.new_empty(flat.numel() // L)
            scatter(shard, flat, group=intra)
            dist.all_reduce(shard, group=inter)
            shard.div_(dist.get_world_size())
            gather(flat, shard, group=intra)
            if pad:
                buf.copy_(flat[:numel])
            fut.set_result(buf)
        except Exception as e:  # noqa: BLE001 - handed to DDP through the future
            fut.set_exception(e)

    _hier_pool().submit(run)
    return fut


def _stats_bytes(opt):
    """() -> (bytes sent, bytes sent to other nodes) of ``opt``'s last D-Lion step."""
    def sent():
        stats = opt.last_stats
        return stats.bytes_sent, getattr(stats, "inter_node_bytes_sent", None)

    return sent


def _local(strategy: Strategy, model, n: int, s: Settings) -> Built:
    """D-Lion with its exchange replaced by a tally on a group of this rank alone."""
    opt = DistributedLion(model.parameters(), lr=s.lion_lr, group=_solo_group(),
                          weight_decay=s.weight_decay, backend=s.backend)
    return Built(strategy, model, model, opt, _stats_bytes(opt), "StepStats")


def _dlion(strategy: Strategy, model, n: int, s: Settings) -> Built:
    o = strategy.options
    kw = dict(lr=s.lion_lr, mode=o["mode"], weight_decay=s.weight_decay, backend=s.backend)
    if o["hierarchy"]:
        kw["hierarchy"] = s.ranks_per_node
    if o["overlap"]:
        kw.update(overlap=True, bucket_mb=s.bucket_mb)
    module = model
    if o["ddp_hook"]:
        from torch.nn.parallel import DistributedDataParallel

        module = DistributedDataParallel(model, bucket_cap_mb=s.bucket_mb)
        opt = DistributedLion(module.parameters(), **kw)
        register_ddp_comm_hook(module, opt)
    else:
        opt = DistributedLion(model.parameters(), **kw)
    return Built(strategy, model, module, opt, _stats_bytes(opt), "StepStats")


# ----------------------------------------------------------------------------- FSDP2


def _fsdp_mesh(L: int, device_type: str):
    """The (N replicas x L shards) device mesh, dims "replicate" and "shard"."""
    from torch.distributed.device_mesh import init_device_mesh

    n = dist.get_world_size()
    return _cached(("mesh", L, device_type), lambda: init_device_mesh(
        device_type, (n // L, L), mesh_dim_names=("replicate", "shard")))


def _fsdp_units(model):
    """The modules ``fully_shard`` wraps before the root: each child of the root that holds
    parameters, and for a ModuleList / ModuleDict child (whose forward never runs) each of its
    members instead."""
    for child in model.children():
        members = child.children() if isinstance(
            child, (torch.nn.ModuleList, torch.nn.ModuleDict)) else [child]
        yield from (m for m in members if next(m.parameters(), None) is not None)


def _padded_shard(p, L: int) -> int:
    """Elements of a parameter's local shard as FSDP2 pads it: ceil(rows / L) rows."""
    rows = p.shape[0] if p.dim() else 1
    return math.ceil(rows / L) * (p.numel() // rows if rows else 0)


def _fsdp_bytes(units, model, L: int, N: int, reduce_bytes: int, hsdp: bool):
    """(bytes inside the node, bytes between nodes) a rank sends per step in FSDP2's own
    collectives (``accounting.fsdp_unit_bytes`` per unit, the root gathered once: its parameters
    stay unsharded between forward and backward), the gradients in ``reduce_bytes`` per element.
    Checked against the counted collectives in python_tests/test_build.py."""
    own = {id(p) for u in units for p in u.parameters()}
    root = [p for p in model.parameters() if id(p) not in own]
    intra = inter = 0
    for params, gathers in [(list(u.parameters()), 2) for u in units] + [(root, 1)]:
        shard = sum(_padded_shard(p, L) for p in params)
        gathered = sum(_padded_shard(p, L) * p.element_size() for p in params)
        a, b = fsdp_unit_bytes(shard, gathered, L, N, reduce_bytes=reduce_bytes, gathers=gathers,
                               replicas_all_reduce=hsdp)
        intra, inter = intra + round(a), inter + round(b)
    return intra, inter


class _ShardLion:
    """Plain Lion (``_local_optimizer``, as lion-allreduce) on this rank's shards of HSDP's
    parameters, whose gradients FSDP2 has averaged over all n ranks: every replica of a shard
    takes the same step. DistributedLion refuses HSDP's (Replicate, Shard) DTensors (it would
    vote between the replicas itself), so it steps aliases of their local tensors (the same
    storage), made at the first step, after FSDP2's lazy initialization may have re-padded
    the shards."""

    def __init__(self, params, s: Settings):
        self.params, self.settings, self.inner = list(params), s, None

    @property
    def param_groups(self):
        return self.inner.param_groups if self.inner is not None else []

    @property
    def state(self):
        return self.inner.state if self.inner is not None else {}

    def step(self):
        if self.inner is None:
            aliases = [local(p).detach().requires_grad_() for p in self.params]
            self.inner = _local_optimizer("lion", aliases, self.settings, _solo_group())
        for p, x in zip(self.params, self.inner.param_groups[0]["params"]):
            x.grad = local(p.grad)
        self.inner.step()

    def zero_grad(self, set_to_none: bool = True):
        for p in self.params:
            p.grad = None
        if self.inner is not None:
            self.inner.zero_grad(set_to_none=True)


def _fully_shard(model, L: int, hsdp: bool = False, mp_policy=None):
    """Shard ``model`` with FSDP2 in nodes of L ranks (each unit of ``_fsdp_units``, then the
    root), on the shard dimension of the (N x L) mesh, or on the whole mesh (HSDP); returns
    (mesh, units). FSDP2 does not broadcast: every replica starts from rank 0's, as DDP."""
    from torch.distributed.fsdp import fully_shard

    mesh = _fsdp_mesh(L, next(model.parameters()).device.type)
    with torch.no_grad():
        for t in itertools.chain(model.parameters(), model.buffers()):
            dist.broadcast(t, 0)
    kw = dict(mesh=mesh if hsdp else mesh["shard"])
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    units = list(_fsdp_units(model))
    for unit in units:
        fully_shard(unit, **kw)
    fully_shard(model, **kw)
    return mesh, units


def _fsdp(strategy: Strategy, model, n: int, s: Settings) -> Built:
    """FSDP2 in nodes of L ranks (each ModuleList member / child, then the root): on the shard
    dimension with D-Lion's vote between the N = n / L replicas, or HSDP on the whole mesh
    (FSDP2 all-reduces the replicas' shards itself) with Lion on each shard. Bytes: D-Lion's
    StepStats between nodes; FSDP2's own collectives by the ring formulas (``_fsdp_bytes``)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    o, L = strategy.options, s.ranks_per_node
    hsdp = o["sync"] == "allreduce"
    policy = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) if o.get("wire") == "bf16" \
        else None
    mesh, units = _fully_shard(model, L, hsdp, policy)
    intra, inter = _fsdp_bytes(units, model, L, n // L, 2 if o.get("wire") == "bf16" else 4,
                               hsdp)
    if hsdp:
        opt = _ShardLion(model.parameters(), s)
        return Built(strategy, model, model, opt, lambda: (intra + inter, inter), "formula")
    kw = dict(lr=s.lion_lr, mode=o["mode"], weight_decay=s.weight_decay, backend=s.backend,
              device_mesh=mesh)
    if o["overlap"]:
        kw.update(overlap=True, bucket_mb=s.bucket_mb)
    opt = DistributedLion(model.parameters(), **kw)

    def sent():
        stats = opt.last_stats
        return stats.bytes_sent + intra, stats.inter_node_bytes_sent

    return Built(strategy, model, model, opt, sent, "StepStats + formula (FSDP2)")


def _decentralized(strategy: Strategy, model, n: int, s: Settings) -> Built:
    """DecentralizedDataParallel with the named optimizer per bucket (it steps in backward)."""
    K, name = s.accum_steps or n, strategy.optimizer
    if name == "accum-adamw":
        def opt_fn(ps):
            return AccumAdamW(ps, lr=s.adamw_lr, weight_decay=s.weight_decay, accum_steps=K,
                              backend=s.backend)
    elif name == "accum-lion":
        def opt_fn(ps):
            return AccumLion(ps, lr=s.lion_lr, weight_decay=s.weight_decay, accum_steps=K,
                             backend=s.backend)
    else:
        def opt_fn(ps):
            return torch.optim.AdamW(ps, lr=s.adamw_lr, weight_decay=s.weight_decay)
    ddp = DecentralizedDataParallel(model, opt_fn, topology=strategy.options["topology"],
                                    bucket_mb=s.bucket_mb, local_world_size=s.ranks_per_node)
    last = [0]  # the wrapper counts from its construction on

    def sent():
        delta, last[0] = ddp.bytes_sent - last[0], ddp.bytes_sent
        return delta, None

    return Built(strategy, model, ddp, None, sent, "DecentralizedDataParallel.bytes_sent",
                 finish=ddp.synchronize, evaluation=ddp.global_average)


def _diloco(strategy: Strategy, model, n: int, s: Settings) -> Built:
    """Local AdamW steps (no communication), and every H / P inner steps DiLoCo's sync of one
    fragment with the strategy's outer step. ``diloco-*-fsdp``: the model sharded by FSDP2 in
    nodes of L ranks (as fsdp-dlion), DiLoCo on the local shards with the outer step between
    the replicas. Bytes: DiLoCo's count of each sync (SyncStats), 0 between syncs, plus with
    FSDP2 its own collectives inside the node by the ring formulas (``_fsdp_bytes``) every step.
    Evaluated on theta_bar: between syncs, and with P > 1 fragments at any step, the ranks'
    local parameters differ."""
    o, L = strategy.options, s.ranks_per_node
    intra, kw = 0, {}
    if o.get("fsdp"):
        mesh, units = _fully_shard(model, L)
        intra = _fsdp_bytes(units, model, L, n // L, 4, False)[0]
        kw["device_mesh"] = mesh
    inner = torch.optim.AdamW(model.parameters(), lr=s.adamw_lr, weight_decay=s.weight_decay)
    lr = {"dlion": s.diloco_dlion_lr, "nesterov": s.diloco_nesterov_lr,
          "sparseloco": s.diloco_sparseloco_lr}[o["outer"]]
    if o["outer"] == "dlion":
        kw.update(mode=o["mode"], backend=s.backend)
    if o.get("error_feedback") or o.get("scale"):  # DLionOuterOptions
        kw["outer_options"] = dict(error_feedback=o["error_feedback"], scale=o["scale"])
        lr = s.diloco_scaled_lr if o["scale"] else lr
    diloco = DiLoCo(model, inner, s.sync_every, o["outer"], outer_lr=lr,
                    fragments=s.fragments, **kw)
    last, applied = [0], [None]

    def after_step():
        applied[0] = diloco.step()  # the sync applied in this step (no overlap_steps), or None

    def sent():
        delta, last[0] = diloco.bytes_sent - last[0], diloco.bytes_sent
        if not o.get("fsdp"):
            return delta, None
        stats = applied[0]
        return delta + intra, stats.inter_node_bytes_sent if stats is not None else 0

    @contextlib.contextmanager
    def synced():
        params = [local(p) for ps in diloco.fragment_params for p in ps]
        with torch.no_grad():
            saved = [p.detach().clone() for p in params]
            torch._foreach_copy_(params, diloco.theta_bar)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(params, saved)

    source = "SyncStats + formula (FSDP2)" if o.get("fsdp") else "SyncStats"
    def outer_state():  # theta_bar, the outer momenta and error feedback's residuals, fp32
        residuals = getattr(diloco.options_runtime, "residual", None) or []
        return 4 * (sum(t.numel() for t in diloco.theta_bar + diloco.outer_momenta)
                    + sum(r.numel() for r in residuals if r is not None))

    return Built(strategy, model, model, inner, sent, source, after_step=after_step,
                 evaluation=synced, extra_state=outer_state)


BUILDERS = {"allreduce": _allreduce, "local": _local, "dlion": _dlion, "fsdp": _fsdp,
            "decentralized": _decentralized, "diloco": _diloco}
