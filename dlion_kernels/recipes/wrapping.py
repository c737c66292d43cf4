"""How a model is wrapped for a strategy: DDP, or FSDP2 in nodes of L ranks (each unit, then
the root) on the shard dimension of the (N x L) mesh, or on the whole mesh (HSDP)."""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from .groups import fsdp_mesh


def wrap_ddp(model, bucket_mb: float):
    """``model`` in torch's DistributedDataParallel with buckets of ``bucket_mb`` MB (DDP
    broadcasts rank 0's parameters)."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, bucket_cap_mb=bucket_mb)


def fsdp_units(model):
    """The modules ``fully_shard`` wraps before the root: each child of the root that holds
    parameters, and for a ModuleList / ModuleDict child (whose forward never runs) each of its
    members instead."""
    for child in model.children():
        members = child.children() if isinstance(
            child, (torch.nn.ModuleList, torch.nn.ModuleDict)) else [child]
        yield from (m for m in members if next(m.parameters(), None) is not None)


def shard_model(model, L: int, hsdp: bool = False, mp_policy=None):
    """Shard ``model`` with FSDP2 in nodes of L ranks (each unit of ``fsdp_units``, then the
    root), on the shard dimension of the (N x L) mesh, or on the whole mesh (HSDP); returns
    (mesh, units). FSDP2 does not broadcast: every replica starts from rank 0's, as DDP."""
    from torch.distributed.fsdp import fully_shard

    mesh = fsdp_mesh(L, next(model.parameters()).device.type)
    with torch.no_grad():
        for t in itertools.chain(model.parameters(), model.buffers()):
            dist.broadcast(t, 0)
    kw = dict(mesh=mesh if hsdp else mesh["shard"])
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    units = list(fsdp_units(model))
    for unit in units:
        fully_shard(unit, **kw)
    fully_shard(model, **kw)
    return mesh, units
