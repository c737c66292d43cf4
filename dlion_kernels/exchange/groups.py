"""The process groups the library makes itself: made once, kept, and made again when they can no
longer be trusted.

- ``cached(kind, parent, make, *key)``: the group (or tuple of groups) ``make()`` returns, kept
  for ``parent`` (the group it is derived from; None: the default group). An entry is valid only
  while ``parent`` and the default group are the very objects they were when it was made: after
  ``destroy_process_group()`` and a new ``init_process_group()`` (which may reuse an object's
  ``id``), the groups are made again instead of handing out a group of a dead job.
- ``solo_group()``: a group of this rank alone, made by this rank only, kept like the others.
- ``new_group(ranks, timeout)``: ``dist.new_group`` with the job's timeout (``timeout``, else the
  default group's). ``dist.new_group`` alone gives the backend's default (30 minutes for gloo),
  so a stalled peer in a library-made group would hang the job that long.
- ``retire(*groups)``: forget every entry holding one of ``groups``. A collective that failed or
  timed out on a group may leave work pending on it, on this rank or on a peer; the next
  collective on that group would then pair with the stale one (gloo aborts the process on the
  size mismatch). A retired group is never handed out again: the next user makes a new one.

``dist.new_group`` is collective: every rank of the job (``use_local_synchronization=True``:
every member) must make the same groups in the same order. Callers make them at points every
rank reaches in the same order (construction, or the first step of an object).
"""

from __future__ import annotations

import torch.distributed as dist

from .collectives import as_timedelta, group_timeout

_CACHE: dict = {}


def job_timeout(timeout=None):
    """``timeout`` (seconds or a timedelta) as a timedelta, else the default group's timeout."""
    limit = as_timedelta(timeout)
    return limit if limit is not None else group_timeout()


def new_group(ranks, timeout=None, **kwargs):
    """``dist.new_group(ranks, **kwargs)`` made with the job's timeout (``job_timeout``)."""
    return dist.new_group(list(ranks), timeout=job_timeout(timeout), **kwargs)


def cached(kind: str, parent, make, *key):
    """``make()``'s result, made once per (``kind``, ``parent``, ``key``) while ``parent`` (None:
    the default group) and the default group are the same objects (module docstring)."""
    world = dist.group.WORLD
    parent = world if parent is None else parent
    entry = (kind, id(parent), *key)
    hit = _CACHE.get(entry)
    if hit is not None and hit[0] is parent and hit[1] is world:
        return hit[2]
    value = make()
    _CACHE[entry] = (parent, world, value)  # holds parent: its id cannot be reused meanwhile
    return value


def solo_group():
    """A process group of this rank alone with the job's timeout, made by this rank only (no
    other rank takes part: ``use_local_synchronization``), once per default group (``cached``)."""
    me = dist.get_rank()
    return cached("solo", None, lambda: new_group([me], use_local_synchronization=True), me)


def _members(value):
    if isinstance(value, (tuple, list)):
        for v in value:
            yield from _members(v)
    elif value is not None:
        yield value


def retire(*groups) -> None:
    """Forget every cached entry that holds one of ``groups`` (module docstring)."""
    doomed = [g for g in groups if g is not None]
    if not doomed:
        return
    for entry, (_, _, value) in list(_CACHE.items()):
        if any(m is g for m in _members(value) for g in doomed):
            del _CACHE[entry]
