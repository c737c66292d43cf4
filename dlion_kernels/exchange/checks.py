"""Argument validation at the Python boundary: clear ``ValueError``/``TypeError`` naming the
argument and what is allowed, raised before anything is modified."""

from __future__ import annotations

import math

import torch

from ..kernels import backends

MODES = ("vote", "average")
VOTES = ("binary", "ternary")
NONFINITE = ("raise", "skip")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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


def check_tensor(name: str, i: int, t, like: torch.Tensor | None, dtypes) -> None:
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
        check_tensor("params", i, p, None, DTYPES)
        # Found by fuzzing: meta (or other) tensors reached a backend and failed there with a
        # misleading message (meta tensors all have data_ptr 0, so they "aliased").
        if p.device.type not in ("cpu", "cuda"):
            raise ValueError(f"params[{i}] is on device {p.device}; allowed: cpu, cuda")
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
            check_tensor("grads", i, g, p, DTYPES)
            # what every backend's apply reads (kernel stages v2): found by fuzzing, a bf16
            # gradient of an fp32 parameter failed inside apply, after the exchange
            if g.dtype not in (p.dtype, torch.float32):
                raise TypeError(f"grads[{i}] has dtype {g.dtype}; allowed: the parameter's dtype "
                                f"({p.dtype}) or float32")
        check_tensor("exp_avgs", i, m, p, (torch.float32,))
    check_no_overlap(params, grads, exp_avgs)
    return device


def _span(t: torch.Tensor) -> tuple[int, int, int]:
    """(storage address, first byte, one past the last byte) that ``t`` can touch."""
    size = t.element_size()
    start = t.storage_offset() * size
    extent = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride())) + 1
    return t.untyped_storage().data_ptr(), start, start + extent * size


def _may_hold_an_element_twice(t: torch.Tensor) -> bool:
    """True unless each dimension, in increasing stride order, steps past everything the smaller
    ones reach (then no two indices meet). Conservative: some layouts that hold every element
    once but interleave (shape (3, 3), strides (2, 3)) count as overlapping too."""
    reach = 1  # elements spanned by the dimensions taken so far
    for stride, size in sorted((abs(s), n) for n, s in zip(t.shape, t.stride()) if n > 1):
        if stride < reach:
            return True
        reach = stride * (size - 1) + reach
    return False


def check_no_overlap(params, grads, exp_avgs) -> None:
    """params and exp_avgs are written: none may share memory with any tensor of the three
    lists, nor hold one element twice (an expanded tensor). Found by fuzzing: the same parameter
    twice was updated twice; an expanded parameter or momentum failed in the final write-back
    after the momenta had been written; a gradient aliasing a parameter gave backend-dependent
    results. Conservative: views whose byte ranges interleave without sharing an element (a[::2]
    and a[1::2]) are refused too."""
    spans = []
    for name, seq in (("params", params), ("grads", grads), ("exp_avgs", exp_avgs)):
        for i, t in enumerate(seq):
            if t is None or t.numel() == 0:
                continue
            ptr, lo, hi = _span(t)
            written = name != "grads"
            if written and _may_hold_an_element_twice(t):
                raise ValueError(f"{name}[{i}] has elements that share memory (an expanded "
                                 "tensor?); it is written in place: pass a tensor of its own")
            spans.append((ptr + lo, ptr + hi, written, f"{name}[{i}]"))
    spans.sort()
    # Sweep in address order: each span against the written span reaching furthest so far and
    # the previous span (enough to find some overlapping pair if one exists with a written one).
    reach, reach_name, reach_written = -1, "", False
    for lo, hi, written, name in spans:
        if lo < reach and (written or reach_written):
            raise ValueError(f"{name} and {reach_name} share memory; parameters and momenta are "
                             "written in place, so they may alias nothing in params, grads or "
                             "exp_avgs")
        if hi > reach:
            reach, reach_name, reach_written = hi, name, written
