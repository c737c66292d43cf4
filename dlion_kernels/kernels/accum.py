"""AccumAdamW and AccumLion steps: the argument checks and the backend dispatch.

One call updates a whole list of tensors of one parameter dtype with ONE fused multi-tensor kernel
on the ``cpu`` (C++, ``csrc/cpu/accum_kernels.cpp``), ``cuda`` (``csrc/cuda/accum_kernels.cu``)
and ``triton`` (``accum_triton.py``) backends; the ``torch`` backend is the readable reference
(``accum_reference.py``), the oracle of the others.

    adamw(params, grads, accs, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay,
          accum_steps, step, sources=None)
    lion(params, grads, accs, exp_avgs, *, lr, beta1, beta2, weight_decay, accum_steps, step,
         sources=None)

``step`` is the step count t >= 1 of every tensor of the call (the optimizers group tensors by
it). Params and grads share a dtype (fp32, bf16 or fp16); accs, exp_avgs, exp_avg_sqs are fp32.
Every grad is a tensor (the optimizers skip parameters without one).

``sources`` (optional, a list as long as params; an entry None = the param itself): the step
reads x from ``sources[i]`` instead of ``params[i]`` and writes the result to ``params[i]``; the
source is not modified. Same shape, dtype and device as its param, contiguous, and either the
param itself (today's in-place step) or overlapping no tensor the call writes (params, accs,
exp_avgs, exp_avg_sqs). This fuses a copy x = y into the step: ``DecentralizedDataParallel``
hands the received gossip buffer (the mixed parameters) as sources instead of copying it into
the parameters first, which saves that copy pass: 2 * itemsize bytes per element (read 4 +
write 4 = 8 bytes for fp32, 4 for bf16 / fp16). The step itself moves the same bytes either way
(x is read from the source instead of the param).

The per-element math, in order, and its scalars: ``accum_reference.py``.
"""

from __future__ import annotations

import bisect

import torch

from . import accum_native, backends
from .accum_reference import adamw_reference, lion_reference

_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_lists(params, grads, states: dict) -> None:
    """What memory safety and the kernels need: equal lengths, one device, contiguous, one param
    dtype shared by the grads, fp32 states of the params' sizes. Raises before anything runs."""
    n = len(params)
    for name, ts in (("grads", grads), *states.items()):
        if len(ts) != n:
            raise ValueError(f"{name} has {len(ts)} tensors, params has {n}")
    if n == 0:
        return
    device, dtype = params[0].device, params[0].dtype
    if dtype not in _PARAM_DTYPES:
        raise TypeError(f"params must be float32, bfloat16 or float16, got {dtype}")
    for i, (x, g) in enumerate(zip(params, grads)):
        if x.dtype != dtype or g is None or g.dtype != dtype:
            raise TypeError(
                f"params[{i}] and grads[{i}] must both be {dtype} (one dtype per call), got "
                f"{x.dtype} and {None if g is None else g.dtype}"
            )
        if g.is_sparse or x.is_sparse:
            raise TypeError(f"params[{i}] / grads[{i}]: sparse tensors are not supported")
        for name, t in (("params", x), ("grads", g)):
            if t.device != device:
                raise ValueError(f"{name}[{i}] is on {t.device}, params[0] on {device}")
            if not t.is_contiguous():
                raise ValueError(f"{name}[{i}] must be contiguous")
        if g.numel() != x.numel():
            raise ValueError(f"grads[{i}] has {g.numel()} elements, params[{i}] {x.numel()}")
        for name, ts in states.items():
            t = ts[i]
            if t.dtype != torch.float32 or t.device != device or not t.is_contiguous():
                raise TypeError(f"{name}[{i}] must be a contiguous float32 tensor on {device}")
            if t.numel() != x.numel():
                raise ValueError(f"{name}[{i}] has {t.numel()} elements, params[{i}] {x.numel()}")


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def check_sources(sources, params, written) -> list:
    """``sources`` as a list of tensors (None entries -> the param itself); raises before
    anything runs. ``written``: every other tensor list the call writes. A source that is not
    its param must overlap no written tensor (the kernels read and write in parallel)."""
    if sources is None:
        return list(params)
    sources = list(sources)
    if len(sources) != len(params):
        raise ValueError(f"sources has {len(sources)} tensors, params has {len(params)}")
    out, apart = [], []
    for i, (y, x) in enumerate(zip(sources, params)):
        if y is None or y is x:
            out.append(x)
            continue
        if not isinstance(y, torch.Tensor):
            raise TypeError(f"sources[{i}] must be a tensor or None, got {type(y).__name__}")
        if y.dtype != x.dtype or y.device != x.device or y.shape != x.shape:
            raise TypeError(
                f"sources[{i}] must have params[{i}]'s dtype, device and shape ({x.dtype}, "
                f"{x.device}, {tuple(x.shape)}), got {y.dtype}, {y.device}, {tuple(y.shape)}"
            )
        if y.is_sparse or not y.is_contiguous():
            raise ValueError(f"sources[{i}] must be a contiguous dense tensor")
        out.append(y)
        if y.numel() and y.data_ptr() != x.data_ptr():
            apart.append(i)
    if apart:
        ranges = sorted(_byte_range(t) for ts in (params, *written) for t in ts if t.numel())
        starts, ends, reach = [r[0] for r in ranges], [], 0
        for _, end in ranges:
            reach = max(reach, end)
            ends.append(reach)  # the furthest end of any range starting at or before this one
        for i in apart:
            lo, hi = _byte_range(out[i])
            j = bisect.bisect_left(starts, hi)
            if j and ends[j - 1] > lo:
                raise ValueError(
                    f"sources[{i}] overlaps a tensor the step writes (params, accs or moments); "
                    "a source must be its param or lie apart from them"
                )
    return out


def _impl(backend: str):
    if backend == "torch":
        return None
    if backend == "triton":
        from . import accum_triton  # triton is optional: imported once its backend is chosen

        return accum_triton
    return accum_native.backend(backend)


def _check_hyper(lr, beta1, beta2, weight_decay, accum_steps, step, eps=None) -> None:
    if not lr >= 0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    for name, b in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {b}")
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    if eps is not None and not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if int(accum_steps) != accum_steps or accum_steps < 1:
        raise ValueError(f"accum_steps must be an integer >= 1, got {accum_steps}")
    if int(step) != step or step < 1:
        raise ValueError(f"step must be an integer >= 1, got {step}")


def adamw(params, grads, accs, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay,
          accum_steps, step, sources=None, backend=None):
    """One AccumAdamW step of every tensor (module docstring), in place, on ``backend`` (None:
    ``$DLION_BACKEND`` or the best for the tensors' device). ``sources``: x read from there."""
    _check_hyper(lr, beta1, beta2, weight_decay, accum_steps, step, eps)
    check_lists(params, grads, {"accs": accs, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs})
    # K = 1 never touches the accumulators, so they do not count as written
    sources = check_sources(sources, params,
                            (exp_avgs, exp_avg_sqs) + ((accs,) if accum_steps > 1 else ()))
    if not params:
        return
    name = backends.resolve(backend, params[0].device)
    impl = _impl(name)
    kw = {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay,
              "accum_steps": int(accum_steps), "step": int(step), "sources": sources}
    if impl is None:
        adamw_reference(params, grads, accs, exp_avgs, exp_avg_sqs, **kw)
    else:
        impl.adamw(params, grads, accs, exp_avgs, exp_avg_sqs, **kw)


def lion(params, grads, accs, exp_avgs, *, lr, beta1, beta2, weight_decay, accum_steps, step,
         sources=None, backend=None):
    """One AccumLion step of every tensor (module docstring), in place. ``sources``: x read
    from there."""
    _check_hyper(lr, beta1, beta2, weight_decay, accum_steps, step)
    check_lists(params, grads, {"accs": accs, "exp_avgs": exp_avgs})
    sources = check_sources(sources, params, (exp_avgs,) + ((accs,) if accum_steps > 1 else ()))
    if not params:
        return
    name = backends.resolve(backend, params[0].device)
    impl = _impl(name)
    kw = {"lr": lr, "beta1": beta1, "beta2": beta2, "weight_decay": weight_decay,
              "accum_steps": int(accum_steps), "step": int(step), "sources": sources}
    if impl is None:
        lion_reference(params, grads, accs, exp_avgs, **kw)
    else:
        impl.lion(params, grads, accs, exp_avgs, **kw)
