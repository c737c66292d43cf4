"""The ``triton`` backend of AccumAdamW / AccumLion (semantics and order: ``accum_reference.py``).

One launch per call covers every tensor, through the tensor and program tables of
``triton.py`` (``launch_tables``: per list a typed base pointer plus element offsets; one
program per chunk of BLOCK elements of one tensor). fp32 arithmetic with one rounding per operation:
no fused multiply-add, ``div_rn`` and ``sqrt_rn`` (Triton's ``/`` and ``sqrt`` on the GPU are
approximate).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .accum_reference import ADAMW_SCALARS, LION_SCALARS, adamw_scalars, lion_scalars
from .triton import (
    INTERPRETED,
    LAUNCH_OPTIONS,
    chunk_block,
    in_use,
    launch_tables,
    load_f32,
    on_device,
    round_to,
)


@triton.jit
def _store(ptr, offs, numel, value, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr + offs, value, mask=offs < numel)
    else:
        tl.store(ptr + offs, value)


@triton.jit
def _adamw_chunk(x_ptr, g_ptr, a_ptr, m_ptr, v_ptr, y_ptr, offs, numel,
                 decay, inv_k, b1, omb1, b2, omb2, step_size, bc2_sqrt, eps,
                 K1: tl.constexpr, FLUSH: tl.constexpr, MASKED: tl.constexpr,
                 SOFT_BF16: tl.constexpr):
    # every load first: the chunk's bytes in flight together
    x = load_f32(y_ptr, offs, numel, MASKED, SOFT_BF16)
    g = load_f32(g_ptr, offs, numel, MASKED, SOFT_BF16)
    m = load_f32(m_ptr, offs, numel, MASKED, False)
    v = load_f32(v_ptr, offs, numel, MASKED, False)
    src = g
    if not K1:
        a = load_f32(a_ptr, offs, numel, MASKED, False) + g * inv_k
        src = a
    x = x * decay
    mt = m + omb1 * g
    vt = v + omb2 * (g * g)
    x = x - step_size * tl.div_rn(mt, tl.div_rn(tl.sqrt_rn(vt), bc2_sqrt) + eps)
    _store(x_ptr, offs, numel, round_to(x, x_ptr.dtype.element_ty, SOFT_BF16), MASKED)
    if not K1:
        if FLUSH:
            _store(a_ptr, offs, numel, tl.zeros_like(src), MASKED)
        else:
            _store(a_ptr, offs, numel, src, MASKED)
    if FLUSH:
        _store(m_ptr, offs, numel, b1 * (m + omb1 * src), MASKED)
        _store(v_ptr, offs, numel, b2 * (v + omb2 * (src * src)), MASKED)


@triton.jit
def _adamw_kernel(meta_ptr, prog_ptr, x_base, g_base, a_base, m_base, v_base, y_base,
                  decay, inv_k, b1, omb1, b2, omb2, step_size, bc2_sqrt, eps,
                  K1: tl.constexpr, FLUSH: tl.constexpr, ALIGN: tl.constexpr,
                  BLOCK: tl.constexpr, SOFT_BF16: tl.constexpr):
    """One chunk of one tensor (accum_reference.py), x read from y (x itself or a source):
        x = y*decay ; a += g*inv_k ; mt = m + omb1*g ; vt = v + omb2*(g*g)
        x = x - step_size * (mt / (sqrt(vt)/bc2_sqrt + eps))
        flush: m = b1*(m + omb1*s) ; v = b2*(v + omb2*(s*s)) ; a = 0   (s = a, or g when K1)
    ALIGN: every list's element offset is a multiple of it (4 in the 16-byte aligned launch: one
    4-element vector layout for every list); a whole chunk takes unmasked (vector) accesses.
    """
    pid = tl.program_id(0).to(tl.int64)
    t = tl.load(prog_ptr + pid).to(tl.int64)
    row = meta_ptr + t * 15  # x, g, a, m, v, y: (offset, present) each; numel, block, first
    x_ptr = x_base + tl.multiple_of(tl.load(row), ALIGN)
    g_ptr = g_base + tl.multiple_of(tl.load(row + 2), ALIGN)
    a_ptr = a_base + tl.multiple_of(tl.load(row + 4), ALIGN)
    m_ptr = m_base + tl.multiple_of(tl.load(row + 6), ALIGN)
    v_ptr = v_base + tl.multiple_of(tl.load(row + 8), ALIGN)
    y_ptr = y_base + tl.multiple_of(tl.load(row + 10), ALIGN)
    numel = tl.load(row + 12)
    start = (pid - tl.load(row + 14)) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    if start + BLOCK <= numel:
        _adamw_chunk(x_ptr, g_ptr, a_ptr, m_ptr, v_ptr, y_ptr, offs, numel, decay, inv_k, b1,
                     omb1, b2, omb2, step_size, bc2_sqrt, eps, K1, FLUSH, False, SOFT_BF16)
    else:
        _adamw_chunk(x_ptr, g_ptr, a_ptr, m_ptr, v_ptr, y_ptr, offs, numel, decay, inv_k, b1,
                     omb1, b2, omb2, step_size, bc2_sqrt, eps, K1, FLUSH, True, SOFT_BF16)


@triton.jit
def _lion_chunk(x_ptr, g_ptr, a_ptr, m_ptr, y_ptr, offs, numel, lr, wd, inv_k, b1, omb1, b2,
                omb2, K1: tl.constexpr, FLUSH: tl.constexpr, MASKED: tl.constexpr,
                SOFT_BF16: tl.constexpr):
    # every load first: the chunk's bytes in flight together
    x = load_f32(y_ptr, offs, numel, MASKED, SOFT_BF16)
    g = load_f32(g_ptr, offs, numel, MASKED, SOFT_BF16)
    m = load_f32(m_ptr, offs, numel, MASKED, False)
    src = g
    if not K1:
        a = load_f32(a_ptr, offs, numel, MASKED, False) + g * inv_k
        src = a
    c = b1 * m + omb1 * g
    sign = (c > 0).to(tl.float32) - (c < 0).to(tl.float32)
    x = x - lr * (sign + wd * x)
    _store(x_ptr, offs, numel, round_to(x, x_ptr.dtype.element_ty, SOFT_BF16), MASKED)
    if not K1:
        if FLUSH:
            _store(a_ptr, offs, numel, tl.zeros_like(src), MASKED)
        else:
            _store(a_ptr, offs, numel, src, MASKED)
    if FLUSH:
        _store(m_ptr, offs, numel, b2 * m + omb2 * src, MASKED)


@triton.jit
def _lion_kernel(meta_ptr, prog_ptr, x_base, g_base, a_base, m_base, y_base,
                 lr, wd, inv_k, b1, omb1, b2, omb2,
                 K1: tl.constexpr, FLUSH: tl.constexpr, ALIGN: tl.constexpr,
                 BLOCK: tl.constexpr, SOFT_BF16: tl.constexpr):
    """One chunk of one tensor (accum_reference.py), x read from y (x itself or a source):
        c = b1*m + omb1*g ; x = y - lr*(sign(c) + wd*y) ; a += g*inv_k
        flush: m = b2*m + omb2*s ; a = 0   (s = a, or g when K1)
    ALIGN and whole chunks: as ``_adamw_kernel``.
    """
    pid = tl.program_id(0).to(tl.int64)
    t = tl.load(prog_ptr + pid).to(tl.int64)
    row = meta_ptr + t * 13  # x, g, a, m, y: (offset, present) each; numel, block, first
    x_ptr = x_base + tl.multiple_of(tl.load(row), ALIGN)
    g_ptr = g_base + tl.multiple_of(tl.load(row + 2), ALIGN)
    a_ptr = a_base + tl.multiple_of(tl.load(row + 4), ALIGN)
    m_ptr = m_base + tl.multiple_of(tl.load(row + 6), ALIGN)
    y_ptr = y_base + tl.multiple_of(tl.load(row + 8), ALIGN)
    numel = tl.load(row + 10)
    start = (pid - tl.load(row + 12)) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    if start + BLOCK <= numel:
        _lion_chunk(x_ptr, g_ptr, a_ptr, m_ptr, y_ptr, offs, numel, lr, wd, inv_k, b1, omb1, b2,
                    omb2, K1, FLUSH, False, SOFT_BF16)
    else:
        _lion_chunk(x_ptr, g_ptr, a_ptr, m_ptr, y_ptr, offs, numel, lr, wd, inv_k, b1, omb1, b2,
                    omb2, K1, FLUSH, True, SOFT_BF16)


def _launch(kind, kernel, lists, dtypes, scalars, k1, flush):
    """``lists``: x, g, a, m[, v], y; ``dtypes``: each list's element dtype (for the pointer of
    an absent list)."""
    params = lists[0]
    device = params[0].device
    numels = tuple(x.numel() for x in params)
    block = chunk_block(numels)
    if not INTERPRETED:
        block = 1024
    # one launch per alignment group (triton.py's launch_tables): the 16-byte aligned one is told
    # so (vector accesses), the other not
    for meta, prog, programs, aligned, base_index in launch_tables(
        kind, device, lists, numels, (0,) * len(numels), block
    ):
        bases = [ts[i] if i >= 0 else params[0] for ts, i in zip(lists, base_index)]
        # An absent list (K = 1 accumulators) is never touched: any typed fp32 pointer will do.
        bases = [b if b.dtype == ref_dtype else lists[3][base_index[3]]
                 for b, ref_dtype in zip(bases, dtypes)]
        meta, prog = in_use(meta, prog)
        with on_device(device):
            kernel[(programs,)](
                meta, prog, *bases, *scalars, K1=k1, FLUSH=flush, ALIGN=4 if aligned else 1,
                BLOCK=block,
                SOFT_BF16=INTERPRETED and params[0].dtype == torch.bfloat16, num_warps=4,
                **LAUNCH_OPTIONS,
            )


def adamw(params, grads, accs, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay,
          accum_steps, step, sources=None):
    k1 = accum_steps == 1
    s = adamw_scalars(lr, beta1, beta2, eps, weight_decay, accum_steps, step)
    accs = [None] * len(params) if k1 else accs
    p, f = params[0].dtype, torch.float32
    _launch("accum_adamw", _adamw_kernel,
            (params, grads, accs, exp_avgs, exp_avg_sqs, sources or params), (p, p, f, f, f, p),
            [s[k] for k in ADAMW_SCALARS], k1, step % accum_steps == 0)


def lion(params, grads, accs, exp_avgs, *, lr, beta1, beta2, weight_decay, accum_steps, step,
         sources=None):
    k1 = accum_steps == 1
    s = lion_scalars(lr, beta1, beta2, weight_decay, accum_steps)
    accs = [None] * len(params) if k1 else accs
    p, f = params[0].dtype, torch.float32
    _launch("accum_lion", _lion_kernel, (params, grads, accs, exp_avgs, sources or params),
            (p, p, f, f, p), [s[k] for k in LION_SCALARS], k1, step % accum_steps == 0)
