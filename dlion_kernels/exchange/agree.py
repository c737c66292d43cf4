"""One verdict on every rank for a check whose inputs can differ between ranks.

Arguments, initial weights and a loaded state are checked on each rank, but a rank that raises
alone leaves its peers waiting in the next collective until the group's timeout. So each such
check runs in three parts:

1. every rank computes its local problem (an exception it caught, or None) and its *facts*
   (values that must be equal across ranks: the arguments, a digest of the weights, a step
   count) without raising;
2. one all_gather of a small fixed-size row per rank (a digest of each fact, whether the rank
   has a problem); only when something is wrong, one more of every rank's details (its problem,
   or the printed values of its facts), so the error can name the ranks and the values;
3. every rank raises the same error, built from the same gathered rows, or proceeds. The caller
   changes nothing before this returns.

Stages: the rows may be gathered in up to two groups in turn (FSDP2: the replicate group, then
the shard group), after which every rank of the job holds every rank's row. A fact with
``within=True`` (the weights of a shard) is compared only inside the first group's blocks; the
others across the whole job.

The collectives go through ``collectives.collective`` (the group's timeout, or ``timeout=``): a
peer that died raises ``DistributedStepError`` naming ``AGREE``. The row layout depends only on
the caller's code, never on the arguments, so ranks with different arguments still send rows of
one size.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import sharded
from .collectives import as_timedelta, collective
from .header import HEADER_WORDS, StepMismatchError, check_settings, settings_differ
from .pipeline import ABORTED, StepAbortedError, all_gather

AGREE = "all_gather(agreement)"
DETAILS = "all_gather(agreement details)"
_DIGEST = 8  # bytes per fact
_SHOWN = 240  # characters of a fact's printed value in an error
# exception types a verdict may re-raise by name (others become ValueError)
_TYPES = {t.__name__: t for t in (ValueError, TypeError, StepMismatchError, RuntimeError)}


@dataclass(frozen=True)
class Fact:
    """A value every rank (``within``: every rank of the same first-stage block) must share.
    ``value`` is compared by a digest of ``repr(value)`` (bytes by their own digest) and, when
    ranks differ, shown as ``name=value`` unless ``show`` is False. ``error``: the exception
    raised when it differs; ``hint``: what the user should do."""

    name: str
    value: object
    within: bool = False
    error: type = ValueError
    show: bool = True
    hint: str = ""


def digest(tensors) -> bytes:
    """A 16-byte digest of the tensors' bytes (shapes and dtypes included), copied to the host
    one tensor at a time."""
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        t = t.detach()
        h.update(repr((tuple(t.shape), str(t.dtype))).encode())
        flat = t.reshape(-1).contiguous().cpu()
        if flat.numel():
            h.update(flat.view(torch.uint8).numpy().tobytes())
    return h.digest()


def start_groups(params, device_mesh=None, group=None) -> tuple[list, int]:
    """The groups a start check of these arguments gathers in, found without a collective and
    without raising (bad arguments are the check's problem, not a reason to skip it), and the
    block: how many ranks of the first group hold replicas of the same tensors (1: none).

    Plain parameters: the exchange group (``group``, else the default group), one block. FSDP2
    parameters: the replicate group, then the shard group (``device_mesh``'s two dimensions, or
    ``group=`` and the parameters' mesh); a 1-D mesh or no group: the shard group alone, blocks
    of 1. ``params``: a list of tensors (an empty or unreadable one counts as plain)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [], 1
    world = dist.group.WORLD
    try:
        first = params[0] if params else None
        dtensors = sharded.is_dtensor(first)
        if device_mesh is not None:
            if device_mesh.ndim == 1:
                return [device_mesh.get_group()], 1
            names = device_mesh.mesh_dim_names or ()
            rep, shd = ((names.index(sharded.REPLICATE), names.index(sharded.SHARD))
                        if sharded.REPLICATE in names and sharded.SHARD in names else (0, 1))
            return [device_mesh.get_group(rep), device_mesh.get_group(shd)], \
                device_mesh.size(rep)
        if group is None:
            return [world], 1 if dtensors else dist.get_world_size()
        if not isinstance(group, dist.ProcessGroup):
            return [world], 1
        if dtensors:
            shard = first.device_mesh.get_group()
            ranks = set(dist.get_process_group_ranks(group))
            if ranks & set(dist.get_process_group_ranks(shard)) != {dist.get_rank()}:
                return [world], 1  # not a replicate group: resolving it raises, on every rank
            return [group, shard], len(ranks)
        return [group], dist.get_world_size(group)
    except Exception:  # a broken argument: the default group, where the problem is reported
        return [world], 1


def bound(timeout):
    """``timeout`` as a timedelta, or None (the group's own) when it is not a valid one: a rank
    whose ``timeout=`` is the problem still takes part in the verdict."""
    try:
        return as_timedelta(timeout)
    except (TypeError, ValueError):
        return None


def _fact_digest(value) -> bytes:
    data = value if isinstance(value, bytes) else repr(value).encode()
    return hashlib.blake2b(data, digest_size=_DIGEST).digest()


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def _device(group) -> torch.device:
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gather(row: torch.Tensor, groups, what: str, name: str, step, timeout) -> torch.Tensor:
    """``row`` (uint8) of every rank, gathered in each group in turn: [ranks, width] on the
    host."""
    rows = row.view(1, -1)
    for g in groups:
        size = dist.get_world_size(g)
        flat = rows.reshape(-1).to(_device(g))
        out = torch.empty(size * flat.numel(), dtype=torch.uint8, device=flat.device)
        collective(name, step, all_gather, out, flat, g, timeout=timeout, label=what,
                   applied="nothing was changed")
        rows = out.view(size * rows.shape[0], -1)
    return rows.cpu()


def _pack(value: int, width: int) -> list[int]:
    return list(int(value).to_bytes(width, "little"))


def _unpack(row) -> int:
    return int.from_bytes(bytes(row.tolist()), "little")


def agree(problem: BaseException | None, facts: list[Fact], groups, *, what: str,
          changed: str = "nothing was changed on any rank", block: int | None = None, step=0,
          timeout=None) -> None:
    """The verdict of one check on every rank of ``groups`` (process groups gathered in turn;
    empty or of size 1: this rank alone). Raises on every rank the same error when any rank has
    a ``problem`` (the first such rank's exception type, every rank's message), else when a fact
    differs (its ``error``); returns otherwise. ``facts`` must be the same list of names on
    every rank (their values may differ). ``what`` names the call in messages and in a
    ``DistributedStepError``; ``step`` too. ``block``: facts with ``within`` are compared in
    runs of this many rows (default: the first group's size; ``start_groups`` gives it)."""
    groups = [g for g in groups if g is not None and dist.get_world_size(g) > 1]
    if not groups:
        if problem is not None:
            raise problem
        return
    me = dist.get_rank()
    details = {"rank": me}
    if problem is not None:
        details["problem"] = [type(problem).__name__, str(problem)]
        digests = b"\0" * (_DIGEST * len(facts))
    else:
        details["facts"] = [_shown(f.value) if f.show else "" for f in facts]
        digests = b"".join(_fact_digest(f.value) for f in facts)
    text = json.dumps(details).encode()
    row = _pack(me, 8) + [int(problem is not None)] + _pack(len(text), 8) + list(digests)
    rows = _gather(torch.tensor(row, dtype=torch.uint8), groups, what, AGREE, step, timeout)
    ranks = [_unpack(r[:8]) for r in rows]
    failed = [int(r[8]) for r in rows]
    block = block or dist.get_world_size(groups[0])
    table = rows[:, 17:].reshape(len(ranks), len(facts), _DIGEST)
    differs = []  # (fact index, reference row, rows whose fact differs from the reference's)
    for k, f in enumerate(facts):
        for start in range(0, len(ranks), block if f.within else len(ranks)):
            run = range(start, start + (block if f.within else len(ranks)))
            values = [bytes(table[i, k].tolist()) for i in run]
            # the reference: the value most ranks hold (the lowest rank's among equals)
            ref = run[max(range(len(values)), key=lambda j: (values.count(values[j]), -j))]
            odd = [i for i in run if values[i - start] != values[ref - start]]
            if odd:
                differs.append((k, ref, odd))
    if not any(failed) and not differs:
        return
    # Something is wrong: every rank's details, to name the ranks and the values alike.
    width = max(_unpack(r[9:17]) for r in rows)
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[: len(text)] = torch.tensor(list(text), dtype=torch.uint8)
    texts = _gather(padded, groups, what, DETAILS, step, timeout)
    info = [json.loads(bytes(t.tolist()).rstrip(b"\0").decode()) for t in texts]
    raise _verdict(info, failed, differs, facts, what, changed) from problem


def _verdict(info, failed, differs, facts, what: str, changed: str) -> Exception:
    if any(failed):
        by_message: dict = {}
        for i in (i for i, bad in enumerate(failed) if bad):
            kind, message = info[i]["problem"]
            by_message.setdefault((kind, message), []).append(info[i]["rank"])
        kind = next(iter(by_message))[0]
        parts = [f"{_ranks(r)}: {k}: {m}" for (k, m), r in by_message.items()]
        return _TYPES.get(kind, ValueError)(
            f"{what} failed on {_ranks(sorted(sum(by_message.values(), [])))}; {changed}. "
            + " | ".join(parts))
    # the first fact that differs sets the error type; every differing fact is named
    error, parts, hints = facts[differs[0][0]].error, [], []
    for k, ref, odd in differs:
        f = facts[k]
        ref = info[ref]
        if f.show:
            values: dict = {}
            for i in odd:
                values.setdefault(info[i]["facts"][k], []).append(info[i]["rank"])
            shown = ", ".join(f"{_ranks(r)} {f.name}={v}" for v, r in values.items())
            parts.append(f"{shown}; rank {ref['rank']} {f.name}={ref['facts'][k]}")
        else:
            parts.append(f"{f.name} on {_ranks([info[i]['rank'] for i in odd])} differ from "
                         f"rank {ref['rank']}'s")
        if f.hint and f.hint not in hints:
            hints.append(f.hint)
    return error(f"{what}: the ranks disagree; {changed}. " + "; ".join(parts)
                 + (". " + " ".join(hints) if hints else ""))


def explain_step(headers, problem, segments, groups, step, timeout=None) -> None:
    """A step's verdict, when a rank gave the step up or the ranks' settings differ
    (``headers``: [.., n, 2], the same on every rank of ``groups``, read on the host here):
    every rank raises the same error, naming the ranks and what they found (``problem``: this
    rank's own error, or None) or set (``segments``' lr, betas and weight_decay), through
    ``agree``: two small all_gathers over ``groups``, only then. Otherwise returns."""
    words = headers.cpu()
    rows = words.view(-1, words.shape[-2], HEADER_WORDS).tolist()
    gave_up = sorted({r for b in rows for r, h in enumerate(b) if h[0] & ABORTED})
    if not gave_up and not bool(settings_differ(words[..., 0])):
        return
    settings = [(s.lr, (s.beta1, s.beta2), s.weight_decay) for s in segments or []]
    agree(problem if isinstance(problem, Exception) else None,
          [Fact("param group settings (lr, betas, weight_decay)", settings)], groups,
          what=f"D-Lion step {step}", changed="nothing was updated on any rank", step=step,
          timeout=timeout)
    if gave_up:  # no rank told why (an interrupt): the flag alone
        raise StepAbortedError(step, gave_up)
    for bucket in rows:
        check_settings(bucket, step)  # a digest alone differs: name the ranks


def _ranks(ranks) -> str:
    return f"ranks {list(ranks)}"


__all__ = ["AGREE", "DETAILS", "Fact", "agree", "bound", "digest", "explain_step",
           "start_groups"]
