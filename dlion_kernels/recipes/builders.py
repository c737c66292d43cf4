"""``build``: a named strategy on this rank, by its family's builder (``BUILDERS``: allreduce,
local, dlion, fsdp, decentralized, diloco). A new family adds its builder here and its entries
to ``strategies.py``. Building is collective: every rank builds the same strategies in the
same order."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..accounting import ddp_all_reduce_bytes, fsdp_model_bytes
from ..decentralized.wrapper import DecentralizedDataParallel
from ..exchange.sharded import own_shard
from ..local_steps.diloco import DiLoCo
from ..optim.accum import AccumAdamW, AccumLion
from ..optim.ddp_hook import register_ddp_comm_hook
from ..optim.dlion import DistributedLion
from ..strategies import Strategy, get
from .baselines import ShardLion, bf16_hook, hier_hook, local_optimizer
from .built import Built
from .groups import node_groups, solo_group
from .settings import Settings
from .wrapping import shard_model, wrap_ddp


def build(slug: str, model: torch.nn.Module, settings: Settings) -> Built:
    """``slug``'s optimizer and exchange around ``model`` on this rank of the default process
    group. ValueError if the strategy cannot run on this group (``Strategy.problem``)."""
    strategy = get(slug)
    if not isinstance(settings, Settings):
        raise TypeError(f"settings must be a recipes.Settings, got {type(settings).__name__}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("build() needs an initialized default process group "
                           "(torch.distributed.init_process_group)")
    n = dist.get_world_size()
    reason = strategy.problem(n, settings.ranks_per_node)
    if reason is not None:
        raise ValueError(reason)
    return BUILDERS[strategy.family](strategy, model, n, settings)


def _allreduce(strategy: Strategy, model, n: int, s: Settings) -> Built:
    """DDP's gradient all-reduce (fp32, or through a compressing / hierarchical comm hook),
    then the optimizer on each rank alone. Bytes: the ring formula (DDP does not count)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    wrapped = wrap_ddp(model, s.bucket_mb)
    wire, d = strategy.options["wire"], sum(p.numel() for p in model.parameters())
    if wire == "fp16":
        wrapped.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif wire == "bf16":  # torch's bf16_compress_hook refuses gloo ("needs NCCL")
        wrapped.register_comm_hook(None, bf16_hook)
    elif wire == "hier-fp32":
        wrapped.register_comm_hook(node_groups(s.ranks_per_node), hier_hook)
    opt = local_optimizer(strategy.optimizer, list(model.parameters()), s, solo_group())
    if wire == "hier-fp32":  # reduce-scatter + all-gather in the node, the shard's ring across
        sent = ddp_all_reduce_bytes(n, d, ranks_per_node=s.ranks_per_node)
    else:
        sent = ddp_all_reduce_bytes(n, d, wire_bytes=4 if wire == "fp32" else 2)
    return Built(strategy, model, wrapped, opt, lambda: sent, "formula")


def _stats_bytes(opt):
    """() -> (bytes sent, bytes sent to other nodes) of ``opt``'s last D-Lion step."""
    def sent():
        stats = opt.last_stats
        return stats.bytes_sent, stats.inter_node_bytes_sent if stats.nodes is not None else None

    return sent


def _no_comm(strategy: Strategy, model, n: int, s: Settings) -> Built:
    """D-Lion with its exchange replaced by a tally on a group of this rank alone."""
    opt = DistributedLion(model.parameters(), lr=s.lion_lr, group=solo_group(),
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
        module = wrap_ddp(model, s.bucket_mb)
        opt = DistributedLion(module.parameters(), **kw)
        register_ddp_comm_hook(module, opt)
    else:
        opt = DistributedLion(model.parameters(), **kw)
    return Built(strategy, model, module, opt, _stats_bytes(opt), "StepStats")


def _fsdp(strategy: Strategy, model, n: int, s: Settings) -> Built:
    """FSDP2 in nodes of L ranks (each ModuleList member / child, then the root): on the shard
    dimension with D-Lion's vote between the N = n / L replicas, or HSDP on the whole mesh
    (FSDP2 all-reduces the replicas' shards itself) with Lion on each shard. Bytes: D-Lion's
    StepStats between nodes; FSDP2's own collectives by the ring formulas
    (``accounting.fsdp_model_bytes``)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    o, L = strategy.options, s.ranks_per_node
    hsdp = o["sync"] == "allreduce"
    policy = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) if o.get("wire") == "bf16" \
        else None
    mesh, units = shard_model(model, L, hsdp, policy)
    intra, inter = fsdp_model_bytes(units, model, L, n // L,
                                    2 if o.get("wire") == "bf16" else 4, hsdp)
    if hsdp:
        opt = ShardLion(model.parameters(), s)
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
    FSDP2 its own collectives inside the node by the ring formulas every step
    (``accounting.fsdp_model_bytes``).
    Evaluated on theta_bar: between syncs, and with P > 1 fragments at any step, the ranks'
    local parameters differ."""
    o, L = strategy.options, s.ranks_per_node
    intra, kw = 0, {}
    if o.get("fsdp"):
        mesh, units = shard_model(model, L)
        intra = fsdp_model_bytes(units, model, L, n // L, 4, False)[0]
        kw["device_mesh"] = mesh
    inner = torch.optim.AdamW(model.parameters(), lr=s.adamw_lr, weight_decay=s.weight_decay)
    lr = {"dlion": s.diloco_dlion_lr, "nesterov": s.diloco_nesterov_lr,
          "sparseloco": s.diloco_sparseloco_lr}[o["outer"]]
    if o["outer"] == "dlion":
        kw.update(mode=o["mode"], backend=s.backend)
    if o.get("error_feedback") or o.get("scale"):  # DLionOuterOptions
        kw["outer_options"] = {k: o[k] for k in ("error_feedback", "scale", "ef_decay") if k in o}
        lr = s.diloco_scaled_lr if o["scale"] else lr
    elif o["outer"] == "dlion":  # diloco-dlion: the plain 1-bit step, every option off
        kw["outer_options"] = {}
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
        params = [own_shard(p) for ps in diloco.fragment_params for p in ps]
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
        residuals = diloco.outer_residuals or []
        return 4 * sum(t.numel() for t in diloco.theta_bar + diloco.outer_momenta + residuals)

    return Built(strategy, model, model, inner, sent, source, after_step=after_step,
                 evaluation=synced, extra_state=outer_state)


BUILDERS = {"allreduce": _allreduce, "no-comm": _no_comm, "dlion": _dlion, "fsdp": _fsdp,
            "decentralized": _decentralized, "diloco": _diloco}
