"""``fused_dlion_step``: one Distributed Lion step for a list of tensors, on one rank.

Per step, for one flat bucket of all tensors (block layout of ``layout.py``):

    check + local step -> packed votes + header -> all_to_all_single -> tally of the owned shard
               -> all_gather_into_tensor of the packed aggregate -> apply (or skip)

Rank r owns shard r of the (zero-padded) vote vector: it receives every rank's votes for that
shard, tallies them, and everyone gathers the tallied shards. The non-finite flag and the step
number ride in a two-word header of every all_to_all chunk (``pipeline.py``), so a step makes two
collectives. With one rank there is no collective: the stages run back to back.
"""

from __future__ import annotations

import itertools

import torch

from ..kernels.layout import block_offsets
from .checks import (
    check_hyperparameters,
    check_options,
    check_tensors,
)
from .header import StepMismatchError  # noqa: F401  (re-exported)
from .pipeline import (  # noqa: F401  (re-exported)
    NonFiniteGradientError,
    Segment,
    StepStats,
    run_buckets,
)

_auto_step = itertools.count()


def run_step(segments, *, mode, votes, group, backend, step, nonfinite, found_inf=None,
             streams=None) -> StepStats:
    """The step for already-validated segments: one bucket holding all of them (the same
    two-collective protocol as the overlapped buckets, ``pipeline.py``).

    found_inf: None, or a one-element tensor from a check the caller made on every gradient
    (GradScaler): nonzero on any rank skips the step on every rank, whatever ``nonfinite`` says.
    step: an int, None (counts calls in this process) or the step counter on the device (an
    int64 tensor of one element: read there and advanced there, ``pipeline.StepCounter``).
    """
    counter = None
    if isinstance(step, torch.Tensor):
        step, counter = None, step
    elif step is None:
        step = next(_auto_step)
    sizes = [(s, i, t.numel()) for s, seg in enumerate(segments) for i, t in enumerate(seg.params)]
    offsets, total = block_offsets(numel for _, _, numel in sizes)
    entries = [(s, i, off) for (s, i, _), off in zip(sizes, offsets)]
    return run_buckets(segments, [(total, entries)], mode=mode, votes=votes, group=group,
                       backend=backend, step=step, nonfinite=nonfinite, found_inf=found_inf,
                       streams=streams, counter=counter)


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
    hierarchy=None,
) -> StepStats:
    """One Distributed Lion step; updates ``params`` and ``exp_avgs`` in place.

    params, grads, exp_avgs: equal-length lists of same-shape tensors on one device. params and
    grads are fp32, bf16 or fp16, each the dtype of its parameter or fp32 (a ``None`` grad counts
    as zero); exp_avgs are fp32.
    mode: "vote" (majority, sign of the vote sum) or "average" (vote sum / n).
    votes: "binary" (1 bit, c > 0 votes +1 else -1) or "ternary" (sign(c), zero abstains).
    group: process group; None = the default group if initialized, else a single process. Every
        rank of the group must call with the same tensor shapes in the same order.
    backend: None (auto, or $DLION_BACKEND) | "cuda" | "triton" | "cpu" | "torch".
    step: step counter for the even-n binary tie rule (layout.py); None counts calls in this
        process, which agrees across ranks as long as every rank makes the same calls. Ranks on
        different steps raise ``StepMismatchError`` on every rank (header.py). An int64 tensor
        of one element on the parameters' device is a counter kept there: the step reads it on
        the device and adds one to it unless the step is skipped, never reading it back. That
        is what a step captured in a CUDA graph needs (``torch.cuda.graph``, one rank,
        ``nonfinite="skip"``; run it once outside capture first, with the same tensors, so that
        its launch tables exist): every replay is then the next step.
    nonfinite: "raise" (default) raises NonFiniteGradientError on every rank when any rank has an
        inf/NaN gradient; "skip" skips the step on every rank. Either way nothing is modified.
    hierarchy: None (flat), "node" ($LOCAL_WORLD_SIZE ranks per node) or an int L: hierarchical
        D-Lion over nodes of L consecutive ranks (hierarchy.py); only the elements of this rank's
        momentum shard of ``exp_avgs`` are read and written.
    Returns StepStats with the bytes this rank sent and received.
    """
    beta1, beta2 = check_hyperparameters(lr, betas, weight_decay)
    check_options(mode, votes, backend, nonfinite)
    check_tensors(params, grads, exp_avgs)
    if isinstance(step, torch.Tensor):
        device = params[0].device if len(params) else step.device
        if step.dtype != torch.int64 or step.numel() != 1 or step.device != device:
            raise ValueError(f"step as a tensor must be an int64 counter of one element on the "
                             f"parameters' device ({device}), got {step.dtype} of "
                             f"{step.numel()} on {step.device}")
        if hierarchy is not None:
            raise ValueError("step as a device counter runs a flat step: pass hierarchy=None")
    elif step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        raise ValueError(f"step must be an int >= 0, an int64 tensor or None, got {step!r}")
    segment = Segment(list(params), list(grads), list(exp_avgs), float(lr), beta1, beta2,
                      float(weight_decay))
    from . import hierarchy as hier  # imports this module's neighbours

    ranks_per_node = hier.resolve_hierarchy(hierarchy)
    if ranks_per_node > 1:
        if step is None:
            step = next(_auto_step)
        return hier.run_hierarchical_step(
            [segment], hier.FullMomentum(exp_avgs), ranks_per_node=ranks_per_node, mode=mode,
            votes=votes, group=group, backend=backend, step=step, nonfinite=nonfinite)
    return run_step([segment], mode=mode, votes=votes, group=group, backend=backend, step=step,
                    nonfinite=nonfinite)
