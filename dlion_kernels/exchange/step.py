"""``fused_dlion_step``: one Distributed Lion step for a list of tensors, on one rank.

Per step, for one flat bucket of all tensors (block layout of ``layout.py``):

    local step -> packed votes -> all_to_all_single -> tally of the owned shard
               -> all_gather_into_tensor of the packed aggregate -> apply

Rank r owns shard r of the (zero-padded) vote vector: it receives every rank's votes for that
shard, tallies them, and everyone gathers the tallied shards. With one rank there is no
collective: the three stages run back to back.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..kernels import backends
from ..kernels.layout import aggregate_planes, block_offsets, shard_blocks, vote_planes
from .checks import (
    check_hyperparameters,
    check_options,
    check_tensors,
)
from .collectives import collective

_WORD_BYTES = 4
_auto_step = itertools.count()


class NonFiniteGradientError(FloatingPointError):
    """A gradient held inf or NaN on some rank; no rank changed anything."""


@dataclass(frozen=True)
class StepStats:
    """What one step did on this rank. Bytes are what this rank's collectives sent/received."""

    bytes_sent: int
    bytes_received: int
    numel: int
    world_size: int
    mode: str
    votes: str
    backend: str
    skipped: bool = False

    @property
    def allreduce_fp32_bytes(self) -> int:
        """Bytes a ring all-reduce of fp32 gradients would send per rank: 2 (n-1)/n * 4d."""
        n = self.world_size
        return round(2 * (n - 1) / n * 4 * self.numel)


@dataclass
class Segment:
    """Tensors that share hyper-parameters (a param group)."""

    params: list
    grads: list
    exp_avgs: list
    lr: float
    beta1: float
    beta2: float
    weight_decay: float


# ----------------------------------------------------------------------------- the step


def _all_gather(output, input, group) -> None:
    """all_gather_into_tensor, under the name torch uses from 2.13 on (all_gather_single)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, input, group=group)


def _resolve_group(group):
    if group is not None:
        return group, dist.get_world_size(group)
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD, dist.get_world_size()
    return None, 1


def _check_group_device(group, n: int, device: torch.device) -> None:
    if n == 1:
        return
    name = str(dist.get_backend(group)).lower()
    if device.type == "cpu" and name == "nccl":
        raise ValueError("CPU tensors need a gloo process group; this group uses NCCL")
    if device.type == "cuda" and "nccl" not in name:
        raise ValueError(f"CUDA tensors need an NCCL process group; this group uses {name}")


def _any_nonfinite(kernels, grads, device, group, n, step) -> tuple[bool, int]:
    """Whether any rank has an inf/NaN gradient, and the bytes this rank sent to find out."""
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    for part in _by_dtype([(g,) for g in grads if g is not None and g.numel() > 0]):
        flag |= kernels.nonfinite([g for (g,) in part])
    if n == 1:
        return bool(flag.item()), 0
    flags = torch.empty(n, dtype=torch.int32, device=device)
    # every rank takes the same decision
    collective("all_gather(non-finite flags)", step, _all_gather, flags, flag, group)
    return bool(flags.any().item()), (n - 1) * _WORD_BYTES


def _by_dtype(items):
    """Group (tensor-or-None, ...) tuples by the dtype of their first tensor, keeping order."""
    groups: dict = {}
    for item in items:
        key = item[0].dtype if item[0] is not None else None
        groups.setdefault(key, []).append(item)
    if None in groups and len(groups) > 1:  # None gradients ride along with any launch
        first = next(k for k in groups if k is not None)
        groups[first] += groups.pop(None)
    return list(groups.values())


def run_step(segments, *, mode, votes, group, backend, step, nonfinite) -> StepStats:
    """The step for already-validated segments: one exchange for all of them."""
    tensors = [t for s in segments for t in s.params]
    numel = sum(t.numel() for t in tensors)
    group, n = _resolve_group(group)
    device = tensors[0].device if tensors else torch.device("cpu")
    _check_group_device(group, n, device)
    name = backends.resolve(backend, device)
    kernels = backends.get(name)
    if step is None:
        step = next(_auto_step)

    ternary = votes == "ternary"
    offsets, total = block_offsets(t.numel() for t in tensors)

    # Non-contiguous tensors are worked on through contiguous copies, written back at the end.
    write_back = []

    def contiguous(t, keep):
        if t is None or t.is_contiguous():
            return t
        c = t.contiguous()
        if keep:
            write_back.append((t, c))
        return c

    work = []
    offset_iter = iter(offsets)
    for s in segments:
        rows = [
            (contiguous(p, True), contiguous(g, False), contiguous(m, True), next(offset_iter))
            for p, g, m in zip(s.params, s.grads, s.exp_avgs)
        ]
        rows = [row for row in rows if row[0].numel() > 0]  # empty tensors own no block
        work.append((s, rows))

    grads = [g for _, rows in work for _, g, _, _ in rows]
    nonfinite_found, flag_bytes = _any_nonfinite(kernels, grads, device, group, n, step)
    if nonfinite_found:
        if nonfinite == "raise":
            raise NonFiniteGradientError(
                "a gradient holds inf or NaN on at least one rank; nothing was updated on any "
                "rank (pass nonfinite='skip' to skip such steps instead)"
            )
        return StepStats(flag_bytes, flag_bytes, numel, n, mode, votes, name, skipped=True)

    p_in, p_out = vote_planes(votes), aggregate_planes(mode, votes, n)
    shard = shard_blocks(total, n)
    votes_buf = torch.zeros(n * shard * p_in, dtype=torch.int32, device=device)

    for s, rows in work:
        for part in _by_dtype([(g, m, off) for _, g, m, off in rows]):
            g, m, off = zip(*part)
            kernels.local_step(list(g), list(m), votes_buf, list(off), s.beta1, s.beta2, ternary)

    aggregate = torch.empty(n * shard * p_out, dtype=torch.int32, device=device)
    if n == 1:
        kernels.tally(votes_buf.view(1, -1), aggregate, 1, mode, ternary, step)
        sent = 0
    else:
        received = torch.empty(n, shard * p_in, dtype=torch.int32, device=device)
        collective("all_to_all_single(votes)", step, dist.all_to_all_single, received.view(-1),
                   votes_buf, group=group)
        owned = torch.empty(shard * p_out, dtype=torch.int32, device=device)
        kernels.tally(received, owned, n, mode, ternary, step)
        collective("all_gather(aggregate)", step, _all_gather, aggregate, owned, group)
        sent = flag_bytes + (n - 1) * shard * (p_in + p_out) * _WORD_BYTES

    # Apply only now, after the last collective returned: a peer that dies or stalls during the
    # exchange raises DistributedStepError above with every parameter still untouched.
    for s, rows in work:
        for part in _by_dtype([(p, off) for p, _, _, off in rows]):
            p, off = zip(*part)
            kernels.apply(list(p), aggregate, list(off), s.lr, s.weight_decay, n, mode, ternary)

    for original, copy in write_back:
        original.copy_(copy)
    return StepStats(sent, sent, numel, n, mode, votes, name)


@torch.no_grad()
def fused_dlion_step(
    params,
    grads,
    exp_avgs,
    *,
    lr,
    betas=(0.9, 0.99),
    weight_decay=0.0,
    mode="vote",
    votes="binary",
    group=None,
    backend=None,
    step=None,
    nonfinite="raise",
) -> StepStats:
    """One Distributed Lion step; updates ``params`` and ``exp_avgs`` in place.

    params, grads, exp_avgs: equal-length lists of same-shape tensors on one device. params and
    grads are fp32, bf16 or fp16 (a ``None`` grad counts as zero); exp_avgs are fp32.
    mode: "vote" (majority, sign of the vote sum) or "average" (vote sum / n).
    votes: "binary" (1 bit, c > 0 votes +1 else -1) or "ternary" (sign(c), zero abstains).
    group: process group; None = the default group if initialized, else a single process. Every
        rank of the group must call with the same tensor shapes in the same order.
    backend: None (auto, or $DLION_BACKEND) | "cuda" | "triton" | "cpu" | "torch".
    step: step counter for the even-n binary tie rule (layout.py); None counts calls in this
        process, which agrees across ranks as long as every rank makes the same calls.
    nonfinite: "raise" (default) raises NonFiniteGradientError on every rank when any rank has an
        inf/NaN gradient; "skip" skips the step on every rank. Either way nothing is modified.
    Returns StepStats with the bytes this rank sent and received.
    """
    beta1, beta2 = check_hyperparameters(lr, betas, weight_decay)
    check_options(mode, votes, backend, nonfinite)
    check_tensors(params, grads, exp_avgs)
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        raise ValueError(f"step must be an int >= 0 or None, got {step!r}")
    segment = Segment(list(params), list(grads), list(exp_avgs), float(lr), beta1, beta2,
                      float(weight_decay))
    return run_step([segment], mode=mode, votes=votes, group=group, backend=backend, step=step,
                    nonfinite=nonfinite)
