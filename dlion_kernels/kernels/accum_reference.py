"""AccumAdamW and AccumLion: the fp32 reference and its scalars, the oracle of every
backend, and the ``torch`` backend of ``accum.py``. A leaf (it imports only torch): the dispatch
(``accum.py``) and the backends (``accum_native.py``, ``accum_triton.py``) import it, and no
backend imports the dispatch.

Per element, in fp32, in this order (one IEEE rounding per operation, no fused multiply-add).
The scalars are computed in double on the host and rounded to fp32 once (``adamw_scalars``,
``lion_scalars``).

AccumAdamW (k = ceil(t / K), flush = t mod K == 0):
    x  = x * decay                                   decay = 1 - lr * wd
    a  = a + g * inv_k                               inv_k = 1 / K            (K > 1 only)
    mt = m + omb1 * g ;  vt = v + omb2 * (g * g)
    x  = x - step_size * (mt / (sqrt(vt) / bc2_sqrt + eps))
                                                     step_size = lr / (1 - b1^k)
                                                     bc2_sqrt = sqrt(1 - b2^k)
    flush: s = a (K > 1) or g (K = 1) ; m = b1 * (m + omb1 * s) ; v = b2 * (v + omb2 * (s * s))
           a = 0 (K > 1)

AccumLion:
    c = b1 * m + omb1 * g ;  x = x - lr * (sign(c) + wd * x)
    a = a + g * inv_k                                (K > 1 only)
    flush: s = a (K > 1) or g (K = 1) ; m = b2 * m + omb2 * s ; a = 0 (K > 1)

With K = 1 the accumulator is never read or written (a = g / 1 = g exactly, and is reset at
once), which saves 8 of 36 bytes per element of AccumAdamW; the result is identical.
"""

from __future__ import annotations

import math

import torch

_F32 = torch.float32
ADAMW_SCALARS = ("decay", "inv_k", "b1", "omb1", "b2", "omb2", "step_size", "bc2_sqrt", "eps")
LION_SCALARS = ("lr", "wd", "inv_k", "b1", "omb1", "b2", "omb2")


def adamw_scalars(lr, beta1, beta2, eps, weight_decay, accum_steps, step) -> dict:
    """The per-call scalars of AccumAdamW, in double (each kernel rounds them to fp32 once)."""
    k = -(-int(step) // int(accum_steps))
    return {
        "decay": 1.0 - lr * weight_decay,
        "inv_k": 1.0 / accum_steps,
        "b1": beta1,
        "omb1": 1.0 - beta1,
        "b2": beta2,
        "omb2": 1.0 - beta2,
        "step_size": lr / (1.0 - beta1**k),
        "bc2_sqrt": math.sqrt(1.0 - beta2**k),
        "eps": eps,
    }


def lion_scalars(lr, beta1, beta2, weight_decay, accum_steps) -> dict:
    return {
        "lr": lr,
        "wd": weight_decay,
        "inv_k": 1.0 / accum_steps,
        "b1": beta1,
        "omb1": 1.0 - beta1,
        "b2": beta2,
        "omb2": 1.0 - beta2,
    }


def _f32s(values: dict, device) -> dict:
    # Python floats rounded to fp32 once, as a kernel argument is.
    return {k: torch.tensor(v, dtype=_F32, device=device) for k, v in values.items()}


def adamw_reference(params, grads, accs, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps,
                    weight_decay, accum_steps, step, sources=None):
    """AccumAdamW on each tensor, fp32, in the order of the module docstring (x read from
    ``sources[i]`` when given, written to ``params[i]``; xf is never updated in place, so a
    source is not modified)."""
    K = int(accum_steps)
    flush = step % K == 0
    sources = sources or [None] * len(params)
    for x, y, g, a, m, v in zip(params, sources, grads, accs, exp_avgs, exp_avg_sqs):
        s = _f32s(adamw_scalars(lr, beta1, beta2, eps, weight_decay, K, step), x.device)
        xf = (x if y is None else y).reshape(-1).to(_F32)
        gf = g.reshape(-1).to(_F32)
        af, mf, vf = a.view(-1), m.view(-1), v.view(-1)
        xf = xf * s["decay"]
        if K > 1:
            af.copy_(af + gf * s["inv_k"])
        mt = mf + s["omb1"] * gf
        vt = vf + s["omb2"] * (gf * gf)
        # torch's vectorised CPU sqrt is not correctly rounded; sqrt in fp64 rounded once to
        # fp32 is (53 >= 2 * 24 + 2 bits), as sqrtps, CUDA's sqrtf and tl.sqrt_rn are.
        root = torch.sqrt(vt.double()).to(_F32)
        xf = xf - s["step_size"] * (mt / (root / s["bc2_sqrt"].expand_as(vt) + s["eps"]))
        x.copy_(xf.view_as(x).to(x.dtype))
        if flush:
            src = af if K > 1 else gf
            mf.copy_(s["b1"] * (mf + s["omb1"] * src))
            vf.copy_(s["b2"] * (vf + s["omb2"] * (src * src)))
            if K > 1:
                af.zero_()


def lion_reference(params, grads, accs, exp_avgs, *, lr, beta1, beta2, weight_decay,
                   accum_steps, step, sources=None):
    """AccumLion on each tensor, fp32, in the order of the module docstring (x read from
    ``sources[i]`` when given, written to ``params[i]``)."""
    K = int(accum_steps)
    flush = step % K == 0
    sources = sources or [None] * len(params)
    for x, y, g, a, m in zip(params, sources, grads, accs, exp_avgs):
        s = _f32s(lion_scalars(lr, beta1, beta2, weight_decay, K), x.device)
        xf = (x if y is None else y).reshape(-1).to(_F32)
        gf = g.reshape(-1).to(_F32)
        af, mf = a.view(-1), m.view(-1)
        c = s["b1"] * mf + s["omb1"] * gf
        sign = (c > 0).to(_F32) - (c < 0).to(_F32)  # 0 for 0 and NaN, as the kernels do
        xf = xf - s["lr"] * (sign + s["wd"] * xf)
        x.copy_(xf.view_as(x).to(x.dtype))
        if K > 1:
            af.copy_(af + gf * s["inv_k"])
        if flush:
            src = af if K > 1 else gf
            mf.copy_(s["b2"] * mf + s["omb2"] * src)
            if K > 1:
                af.zero_()
