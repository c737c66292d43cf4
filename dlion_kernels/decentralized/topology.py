"""A gossip topology bound to a process group: ``Topology`` creates every subgroup
of the schedule once (``dist.new_group`` is collective: every rank creates every group, in the
same order, so the groups are enumerated over one period of the schedule in a fixed order). The
rules themselves (names, ``check``, ``period``, ``schedule``) are ``dlion_kernels/topologies.py``.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from ..exchange.collectives import as_timedelta
from ..exchange.groups import cached, new_group
from ..topologies import check, period, schedule


def local_world_size(default: int = 1) -> int:
    """LOCAL_WORLD_SIZE as torchrun sets it, else ``default``."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value else default


class Topology:
    """A schedule bound to a process group: ``group_at(t)`` gives this rank's (ranks, subgroup)
    of step t, ranks counted in ``group``; subgroup is None for a group of one rank.

    All subgroups are created in the constructor, which every rank of the default group must
    call with the same arguments (``dist.new_group`` is collective over the whole world, also for
    a subgroup ``group``). Created groups are cached per process, so several topologies share
    them. Their timeout is ``timeout`` (seconds or a timedelta) or else the default group's
    (``dist.new_group`` alone would give the backend's 30 minutes)."""

    def __init__(self, name: str, group=None, local: int | None = None, timeout=None):
        self.name = name
        self.group = group
        self.timeout = as_timedelta(timeout)
        if dist.is_available() and dist.is_initialized():
            self.n = dist.get_world_size(group)
            self.rank = dist.get_rank(group)
        else:
            self.n, self.rank = 1, 0
        if local is None:
            local = local_world_size(1 if name != "alternating-exp-ring" else self.n)
        self.local = local
        check(name, self.n, local if name == "alternating-exp-ring" else 1)
        self.period = period(name, self.n, local)
        self._mine: list[tuple[tuple[int, ...], object]] = []
        distinct: list[tuple[int, ...]] = []
        for t in range(self.period):
            for g in schedule(name, self.n, local, t):
                if len(g) > 1 and g not in distinct:
                    distinct.append(g)
        made = {g: self._new_group(g) for g in distinct}  # same order on every rank
        for t in range(self.period):
            mine = next(g for g in schedule(name, self.n, local, t) if self.rank in g)
            self._mine.append((mine, made.get(mine)))

    def _new_group(self, ranks: tuple[int, ...]):
        if self.group is None:
            global_ranks = ranks
        else:
            global_ranks = tuple(dist.get_global_rank(self.group, r) for r in ranks)
        if len(global_ranks) == dist.get_world_size():
            return dist.group.WORLD if self.group is None else self.group
        # the library's group cache: per default group (a re-initialised process group gets
        # fresh subgroups), made with the job's timeout, never a retired group
        return cached("topology", None, lambda: new_group(global_ranks, self.timeout),
                      global_ranks, self.timeout)

    def groups(self) -> list:
        """The process groups of this rank over one period (None where it is alone)."""
        return [pg for _, pg in self._mine if pg is not None]

    def group_at(self, t: int):
        """(ranks of this rank's group at step t, its process group or None if alone)."""
        return self._mine[t % self.period]

    def __repr__(self) -> str:
        return f"Topology({self.name!r}, n={self.n}, local={self.local})"
