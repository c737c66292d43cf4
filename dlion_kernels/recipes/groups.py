"""The process groups and the device mesh the builders create: every rank creates every one
once per default group, in the same order (``dist.new_group`` is collective), with the job's
timeout (``exchange/groups.py``)."""

from __future__ import annotations

import torch.distributed as dist

from ..exchange import groups


def cached(what, make):
    """``make()`` once per default group (``what`` names it), then the same object."""
    return groups.cached("build", None, make, what)


def solo_group():
    """A group of this rank alone (``groups.solo_group``; None on a one-rank job: the default
    group is one)."""
    return None if dist.get_world_size() == 1 else groups.solo_group()


def node_groups(L: int):
    """(this rank's node of L consecutive ranks, its group of same-local-rank peers)."""
    n, rank = dist.get_world_size(), dist.get_rank()
    return cached(("nodes", L), lambda: (
        [groups.new_group(range(s, s + L)) for s in range(0, n, L)][rank // L],
        [groups.new_group(range(j, n, L)) for j in range(L)][rank % L]))


def fsdp_mesh(L: int, device_type: str):
    """The (N replicas x L shards) device mesh, dims "replicate" and "shard": row i holds ranks
    i L .. i L + L - 1. Built on ``node_groups`` (a row is a node, a column the same-local-rank
    peers) rather than by ``init_device_mesh``, whose groups would take torch's default timeout
    instead of the job's."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    def make():
        shard, replicate = node_groups(L)
        n = dist.get_world_size()
        return DeviceMesh.from_group([replicate, shard], device_type,
                                     mesh=torch.arange(n).view(n // L, L),
                                     mesh_dim_names=("replicate", "shard"))
    return cached(("mesh", L, device_type), make)
