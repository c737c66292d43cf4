"""Gossip topologies of decentralized training (SPEC §7).

Each step t's mixing matrix W(t) is a set of disjoint groups of ranks that average with equal
weights (so W(t) is doubly stochastic and the mean over ranks is kept). ``schedule(name, n, L, t)``
is the pure function that gives those groups; ``Topology`` binds it to a process group, creating
every subgroup once (``dist.new_group`` is collective: every rank creates every group, in the same
order, so the groups are enumerated over one period of the schedule in a fixed order).

- ``complete``: all n ranks, weight 1/n.
- ``ring`` (n even): t even pairs (2k, 2k+1), t odd pairs (2k+1, 2k+2 mod n).
- ``one-peer-exp`` (n a power of two): rank j pairs with j XOR 2^(t mod log2 n).
- ``alternating-exp-ring`` (nodes of L consecutive ranks, N = n / L nodes, N a power of two >= 2):
  round r = (t // 2) mod log2 N pairs node u with u XOR 2^r; pair number p (pairs counted from the
  lowest node index up) averages over its 2L ranks at steps with (t + p) odd and inside each of
  its two nodes at the other steps, so neighbouring pairs are in opposite phase.

n = 1 is allowed for every topology: the one rank is its own group (no communication).
"""

from __future__ import annotations

import os

import torch.distributed as dist

from ..exchange.collectives import as_timedelta, new_group

TOPOLOGIES = ("complete", "ring", "one-peer-exp", "alternating-exp-ring")
# (id of the default group, global ranks, timeout) -> (default group, subgroup)
_GROUPS: dict = {}


def _log2_exact(value: int) -> int | None:
    return value.bit_length() - 1 if value > 0 and value & (value - 1) == 0 else None


def check(name: str, n: int, local: int = 1) -> None:
    """ValueError naming what the topology ``name`` allows if it cannot run on n ranks of
    ``local`` ranks per node."""
    if name not in TOPOLOGIES:
        raise ValueError(f"topology must be one of {TOPOLOGIES}, got {name!r}")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"the world size must be an integer >= 1, got {n!r}")
    if n == 1:
        return
    if name == "ring" and n % 2:
        raise ValueError(f"topology 'ring' needs an even number of ranks, got {n}")
    if name == "one-peer-exp" and _log2_exact(n) is None:
        raise ValueError(f"topology 'one-peer-exp' needs a power-of-two number of ranks, got {n}")
    if name == "alternating-exp-ring":
        if not isinstance(local, int) or local < 1 or n % local:
            raise ValueError(
                f"topology 'alternating-exp-ring' needs the world size ({n}) to be a multiple of "
                f"the ranks per node (LOCAL_WORLD_SIZE = {local})"
            )
        nodes = n // local
        if nodes < 2 or _log2_exact(nodes) is None:
            raise ValueError(
                f"topology 'alternating-exp-ring' needs a power-of-two number >= 2 of nodes; "
                f"{n} ranks with LOCAL_WORLD_SIZE = {local} make {nodes} node(s) "
                "(use 'complete' or 'one-peer-exp' for one node)"
            )


def period(name: str, n: int, local: int = 1) -> int:
    """Steps after which the schedule repeats."""
    check(name, n, local)
    if n == 1 or name == "complete":
        return 1
    if name == "ring":
        return 2
    if name == "one-peer-exp":
        return _log2_exact(n)
    return 2 * _log2_exact(n // local)


def schedule(name: str, n: int, local: int, t: int) -> list[tuple[int, ...]]:
    """The groups of step t (t >= 0): disjoint sorted rank tuples covering 0..n-1, sorted."""
    check(name, n, local)
    if n == 1:
        return [(0,)]
    if name == "complete":
        return [tuple(range(n))]
    if name == "ring":
        if t % 2 == 0:
            return [(2 * k, 2 * k + 1) for k in range(n // 2)]
        return sorted(tuple(sorted((2 * k + 1, (2 * k + 2) % n))) for k in range(n // 2))
    if name == "one-peer-exp":
        bit = 1 << (t % _log2_exact(n))
        return [(j, j ^ bit) for j in range(n) if j < j ^ bit]
    nodes = n // local
    bit = 1 << ((t // 2) % _log2_exact(nodes))
    groups = []
    pairs = [(u, u ^ bit) for u in range(nodes) if u < u ^ bit]
    for p, (u, w) in enumerate(pairs):
        ranks_u = tuple(range(u * local, (u + 1) * local))
        ranks_w = tuple(range(w * local, (w + 1) * local))
        if (t + p) % 2 == 1:
            groups.append(ranks_u + ranks_w)
        else:
            groups += [ranks_u, ranks_w]
    return sorted(groups)


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
        # Cached per default group: a re-initialised process group needs fresh subgroups.
        world = dist.group.WORLD
        key = (id(world), global_ranks, self.timeout)
        hit = _GROUPS.get(key)
        if hit is None or hit[0] is not world:
            hit = (world, new_group(global_ranks, self.timeout))
            _GROUPS[key] = hit
        return hit[1]

    def group_at(self, t: int):
        """(ranks of this rank's group at step t, its process group or None if alone)."""
        return self._mine[t % self.period]

    def __repr__(self) -> str:
        return f"Topology({self.name!r}, n={self.n}, local={self.local})"
