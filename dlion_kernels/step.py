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
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import backends
from .layout import aggregate_planes, block_offsets, shard_blocks, vote_planes

MODES = ("vote", "average")
VOTES = ("binary", "ternary")
NONFINITE = ("raise", "skip")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
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


# ----------------------------------------------------------------------------- validation


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_hyperparameters(lr, betas, weight_decay) -> tuple[float, float]:
    if not _is_real(lr) or lr < 0:
        raise ValueError(f"lr must be a finite number >= 0, got {lr!r}")
    if (
        not isinstance(betas, (tuple, list))
        or len(betas) != 2
        or not all(_is_real(b) and 0.0 <= b < 1.0 for b in betas)
    ):
        raise ValueError(f"betas must be a pair of numbers in [0, 1), got {betas!r}")
    if not _is_real(weight_decay) or weight_decay < 0:
        raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")
    return float(betas[0]), float(betas[1])


def check_options(mode, votes, backend, nonfinite) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if votes not in VOTES:
        raise ValueError(f"votes must be one of {VOTES}, got {votes!r}")
    if backend is not None and backend not in backends.BACKENDS:
        raise ValueError(f"backend must be one of {backends.BACKENDS} or None, got {backend!r}")
    if nonfinite not in NONFINITE:
        raise ValueError(f"nonfinite must be one of {NONFINITE}, got {nonfinite!r}")


def _check_tensor(name: str, i: int, t, like: torch.Tensor | None, dtypes) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{name}[{i}] must be a dense (strided) tensor, got layout {t.layout}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name}[{i}] must have dtype {allowed}; got {t.dtype}")
    if like is not None:
        if t.shape != like.shape:
            raise ValueError(
                f"{name}[{i}] has shape {tuple(t.shape)}, params[{i}] has {tuple(like.shape)}"
            )
        if t.device != like.device:
            raise ValueError(
                f"{name}[{i}] is on device {t.device}, params[{i}] on device {like.device}"
            )


def check_params(params) -> torch.device | None:
    """Each param is a dense fp32/bf16/fp16 tensor, all on one device; return that device."""
    device = None
    for i, p in enumerate(params):
        _check_tensor("params", i, p, None, DTYPES)
        if device is None:
            device = p.device
        elif p.device != device:
            raise ValueError(
                f"all tensors must be on one device: params[{i}] is on {p.device}, "
                f"params[0] on {device}"
            )
    return device


def check_tensors(params, grads, exp_avgs) -> torch.device | None:
    """Validate the three lists; return their common device (None for empty lists)."""
    for name, seq in (("params", params), ("grads", grads), ("exp_avgs", exp_avgs)):
        if isinstance(seq, torch.Tensor) or not isinstance(seq, (list, tuple)):
            raise TypeError(f"{name} must be a list or tuple of tensors, got {type(seq).__name__}")
    if not len(params) == len(grads) == len(exp_avgs):
        raise ValueError(
            "params, grads and exp_avgs must have equal lengths, got "
            f"{len(params)}, {len(grads)}, {len(exp_avgs)}"
        )
    device = check_params(params)
    for i, (p, g, m) in enumerate(zip(params, grads, exp_avgs)):
        if g is not None:
            _check_tensor("grads", i, g, p, DTYPES)
        _check_tensor("exp_avgs", i, m, p, (torch.float32,))
        if m.data_ptr() == p.data_ptr() and p.numel() > 0:
            raise ValueError(f"exp_avgs[{i}] aliases params[{i}]; momentum needs its own storage")
    return device


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


def _any_nonfinite(kernels, grads, device, group, n) -> tuple[bool, int]:
    """Whether any rank has an inf/NaN gradient, and the bytes this rank sent to find out."""
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    for part in _by_dtype([(g,) for g in grads if g is not None and g.numel() > 0]):
        flag |= kernels.nonfinite([g for (g,) in part])
    if n == 1:
        return bool(flag.item()), 0
    flags = torch.empty(n, dtype=torch.int32, device=device)
    _all_gather(flags, flag, group)  # every rank takes the same decision
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
    nonfinite_found, flag_bytes = _any_nonfinite(kernels, grads, device, group, n)
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
        dist.all_to_all_single(received.view(-1), votes_buf, group=group)
        owned = torch.empty(shard * p_out, dtype=torch.int32, device=device)
        kernels.tally(received, owned, n, mode, ternary, step)
        _all_gather(aggregate, owned, group)
        sent = flag_bytes + (n - 1) * shard * (p_in + p_out) * _WORD_BYTES

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
