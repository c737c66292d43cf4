"""The ``triton`` backend: the three stages of ``reference.py`` as Triton kernels.

Same functions, same arguments, same results as the reference (votes and aggregates bit-exact,
fp32 arithmetic in the reference's order with no fused multiply-add):

- ``local_step(grads, exp_avgs, votes, offsets, beta1, ternary)`` (m is read only)
- ``tally(stacked, out, n, mode, ternary, step)`` (``step``: an int or the device counter)
- ``apply(params, grads, exp_avgs, aggregate, offsets, lr, weight_decay, beta2, n, mode, ternary,
  skip=None)`` (writes x and m; ``skip`` is read by the kernel, no host sync; ``exp_avgs`` None
  or None entries: x only for those tensors, no momentum and no gradient read)
- ``nonfinite(grads)``: the reference's, which is one fused multi-tensor torch kernel on the GPU

Multi-tensor apply. ``local_step`` and ``apply`` cover a whole list of tensors with ONE launch:

- a *tensor table*, int64 ``[T, F]`` on the tensors' device, one row per tensor. Each tensor
  list is passed to the kernel as a typed *base pointer* (its first tensor with storage) and
  the table holds, per list, ``(element offset of the tensor from the base, present)``;
  ``present`` is 0 for a ``None`` gradient, which then counts as zeros. Then ``numel, block
  offset, first program``.
  ``local_step``: ``[g_off, g_present, m_off, m_present, numel, block_off, first]``;
  ``apply``: ``[x_off, x_present, g_off, g_present, m_off, m_present, numel, block_off, first]``.
  (Base pointer + offset rather than a raw address cast to a pointer: Triton keeps the base's
  16-byte alignment through the addition, and so vectorises the loads; through ``int_to_ptr`` it
  does not.)
- a *program table*, int32 ``[programs]``: the tensor each program works on. Program ``pid`` of
  tensor ``t`` covers elements ``(pid - first[t]) * BLOCK ..`` of that tensor.

Both tables are cached, keyed on everything they hold (addresses, sizes, block offsets, block
size), so a steady-state step reuses them and launches straight away. All indexing is int64.

Each program sees its ``BLOCK`` elements as a ``[BLOCK // 32, 32]`` tile: row r is one packed
block (one int32 word per bit plane), column j is bit j of that word. Whole chunks take an
unmasked path (vectorised loads); only a tensor's last chunk is masked. BLOCK is 4096 elements
(8 warps) on the GPU; under the interpreter, which pays per program, up to 65536.

``tally`` is bit-sliced: the counts of +1 votes live in up to 16 counter planes, each an int32
word per block, and every rank's vote word is added with a ripple carry over the planes.

The layouts of votes and aggregates are those of ``layout.py``.
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

from .layout import MAX_VOTERS, aggregate_planes, num_blocks, tie_pattern, vote_planes
from .reference import check_step, nonfinite
from .tables import keep_if_captured, to_device

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# No fused multiply-add on the GPU: c = b1*m + omb1*g must round after each operation, as in the
# reference. The interpreter computes with numpy, one rounding per operation already.
LAUNCH_OPTIONS = {} if INTERPRETED else {"enable_fp_fusion": False}

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_MAX_COUNTER_PLANES = 16  # tally counters; n <= layout.MAX_VOTERS (32767) for every backend
_ALIGN = 16  # bytes; when all addresses are multiples of this, the kernels are told so (vectors)


# ------------------------------------------------------------------------------------------------
# local step
# ------------------------------------------------------------------------------------------------


@triton.jit
def load_f32(ptr, offs, numel, MASKED: tl.constexpr, SOFT_BF16: tl.constexpr):
    """Elements of any float dtype as fp32 (0 past ``numel`` when MASKED). SOFT_BF16 (interpreter
    only, whose bf16 -> fp32 cast garbles subnormals): the exact conversion done on the bits."""
    if SOFT_BF16:
        raw = ptr.to(tl.pointer_type(tl.int16), bitcast=True)
        if MASKED:
            bits = tl.load(raw + offs, mask=offs < numel, other=0)
        else:
            bits = tl.load(raw + offs)
        return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        if MASKED:
            return tl.load(ptr + offs, mask=offs < numel, other=0.0).to(tl.float32)
        else:
            return tl.load(ptr + offs).to(tl.float32)


@triton.jit
def _combine(g_ptr, m_ptr, offs, numel, has_g, b1, omb1, MASKED: tl.constexpr,
             SOFT_BF16: tl.constexpr):
    """Returns b1*m + omb1*g (g = 0 where ``has_g`` is 0). Used for c (local step, m read only)
    and for the new momentum (apply)."""
    m = load_f32(m_ptr, offs, numel, MASKED, False)
    g = tl.zeros_like(m)
    if has_g:
        g = load_f32(g_ptr, offs, numel, MASKED, SOFT_BF16)
    return b1 * m + omb1 * g


@triton.jit
def _pack(bits, cols):
    """[R, 32] 0/1 int32 -> [R] words, bit j of word r = bits[r, j] (distinct bits: sum == or)."""
    return tl.sum(bits << cols[None, :], axis=1)


@triton.jit
def _local_step_kernel(
    meta_ptr,  # int64 [T, 7]: g_off, g_present, m_off, m_present, numel, block_off, first
    prog_ptr,  # int32 [programs]: tensor index of each program
    g_base,  # the gradients' base pointer (fp32/bf16/fp16)
    m_base,  # the momenta's base pointer (fp32)
    votes_ptr,  # int32 packed votes
    b1,
    omb1,
    TERNARY: tl.constexpr,
    G_ALIGN: tl.constexpr,  # elements: every g_off is a multiple of this
    M_ALIGN: tl.constexpr,
    BLOCK: tl.constexpr,
    SOFT_BF16: tl.constexpr,  # interpreter with bf16 gradients: exact conversions (load_f32)
):
    """One chunk of BLOCK elements of one tensor, in fp32 (g: stored dtype -> fp32):

        c  = b1 * m + omb1 * g                   (m is read only: apply writes it)
        binary:  votes[blk]       bit j = (c > 0)
        ternary: votes[2*blk]     bit j = (c > 0),  votes[2*blk + 1] bit j = (c < 0)

    with element = 32 * blk + j inside the tensor and blk counted from the tensor's block offset.
    Bits past the end of the tensor are 0.
    """
    pid = tl.program_id(0).to(tl.int64)
    t = tl.load(prog_ptr + pid).to(tl.int64)
    row = meta_ptr + t * 7
    g_ptr = g_base + tl.multiple_of(tl.load(row), G_ALIGN)
    has_g = tl.load(row + 1) != 0
    m_ptr = m_base + tl.multiple_of(tl.load(row + 2), M_ALIGN)
    numel = tl.load(row + 4)
    block0 = tl.load(row + 5)
    start = (pid - tl.load(row + 6)) * BLOCK

    ROWS: tl.constexpr = BLOCK // 32
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, 32)
    offs = start + rows[:, None] * 32 + cols[None, :]  # int64 [ROWS, 32]
    if start + BLOCK <= numel:
        c = _combine(g_ptr, m_ptr, offs, numel, has_g, b1, omb1, MASKED=False,
                     SOFT_BF16=SOFT_BF16)
    else:
        c = _combine(g_ptr, m_ptr, offs, numel, has_g, b1, omb1, MASKED=True,
                     SOFT_BF16=SOFT_BF16)

    blk = start // 32 + rows  # block index inside the tensor
    wmask = blk < (numel + 31) // 32
    word = block0 + blk
    if TERNARY:
        tl.store(votes_ptr + 2 * word, _pack((c > 0).to(tl.int32), cols), mask=wmask)
        tl.store(votes_ptr + 2 * word + 1, _pack((c < 0).to(tl.int32), cols), mask=wmask)
    else:
        tl.store(votes_ptr + word, _pack((c > 0).to(tl.int32), cols), mask=wmask)


# ------------------------------------------------------------------------------------------------
# tally
# ------------------------------------------------------------------------------------------------


@triton.jit
def _ripple(c, carry):
    """One bit plane of a ripple-carry add: (sum plane, carry out)."""
    return c ^ carry, c & carry


@triton.jit
def _count(
    c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, v, NP: tl.constexpr
):
    """Counter planes c0 (LSB) .. c{NP-1} += the 0/1 bits of v, bit-sliced (32 lanes a word)."""
    c0, k = _ripple(c0, v)
    if NP > 1:
        c1, k = _ripple(c1, k)
    if NP > 2:
        c2, k = _ripple(c2, k)
    if NP > 3:
        c3, k = _ripple(c3, k)
    if NP > 4:
        c4, k = _ripple(c4, k)
    if NP > 5:
        c5, k = _ripple(c5, k)
    if NP > 6:
        c6, k = _ripple(c6, k)
    if NP > 7:
        c7, k = _ripple(c7, k)
    if NP > 8:
        c8, k = _ripple(c8, k)
    if NP > 9:
        c9, k = _ripple(c9, k)
    if NP > 10:
        c10, k = _ripple(c10, k)
    if NP > 11:
        c11, k = _ripple(c11, k)
    if NP > 12:
        c12, k = _ripple(c12, k)
    if NP > 13:
        c13, k = _ripple(c13, k)
    if NP > 14:
        c14, k = _ripple(c14, k)
    if NP > 15:
        c15, k = _ripple(c15, k)
    return c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15


@triton.jit
def _compare(c, p: tl.constexpr, h, gt, eq):
    """One plane (from the MSB down) of the bit-sliced comparison counter <=> h (a scalar)."""
    hb = -((h >> p) & 1)  # 0 or all ones
    gt = gt | (eq & c & ~hb)
    eq = eq & ~(c ^ hb)
    return gt, eq


@triton.jit
def _put_plane(tile, planes, c, p: tl.constexpr, NP: tl.constexpr):
    """Column p of the [BW, NPP] output tile = counter plane c (a no-op past NP planes)."""
    if NP > p:
        tile = tl.where(planes[None, :] == p, c[:, None], tile)
    return tile


@triton.jit
def _tally_kernel(
    stacked_ptr,  # int32 [n, row_stride]: n packed vote vectors
    out_ptr,  # int32 [blocks * P_out]: packed aggregate
    n,
    row_stride,
    blocks,
    h,  # the count to compare with: n // 2 (binary), n (ternary, biased count)
    tie,  # binary vote, even n: tie_pattern(step); else 0
    step_ptr,  # int64 [1]: the step counter (read only if STEP_ON_DEVICE)
    MODE_AVG: tl.constexpr,
    TERNARY: tl.constexpr,
    STEP_ON_DEVICE: tl.constexpr,  # the tie pattern from the counter at step_ptr, not ``tie``
    NP: tl.constexpr,  # counter planes = output planes of the average modes
    NPP: tl.constexpr,  # NP rounded up to a power of two (the output tile's columns)
    BW: tl.constexpr,  # blocks per program
):
    """Per bit lane of BW blocks, over the n ranks i, with bit-sliced counters:

    binary:  k = sum_i v_i                          (v_i = 1 for a +1 vote)
             vote: D bit = (k > n//2) | ((k == n/2) & tie)     average: planes of k
    ternary: q = sum_i (plus_i + !minus_i) = #plus - #minus + n
             vote: plus = (q > n), minus = (q < n)             average: planes of q
    """
    pid = tl.program_id(0).to(tl.int64)
    b = pid * BW + tl.arange(0, BW)
    mask = b < blocks
    zero = tl.zeros([BW], dtype=tl.int32)
    c0, c1, c2, c3, c4, c5, c6, c7 = zero, zero, zero, zero, zero, zero, zero, zero
    c8, c9, c10, c11, c12, c13, c14, c15 = zero, zero, zero, zero, zero, zero, zero, zero
    base = stacked_ptr  # row i of stacked
    for _ in range(n):
        if TERNARY:
            plus = tl.load(base + 2 * b, mask=mask, other=0)
            minus = tl.load(base + 2 * b + 1, mask=mask, other=0)
            c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15 = _count(
                c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, plus, NP
            )
            c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15 = _count(
                c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, ~minus, NP
            )
        else:
            v = tl.load(base + b, mask=mask, other=0)
            c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15 = _count(
                c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, v, NP
            )
        base += row_stride

    if MODE_AVG:
        # The NP words of a block are contiguous (b * NP + p): one [BW, NPP] tile stored at once
        # covers a contiguous span, coalesced; a store per plane wrote every NP-th word.
        planes = tl.arange(0, NPP)
        tile = tl.zeros([BW, NPP], dtype=tl.int32)
        tile = _put_plane(tile, planes, c0, 0, NP)
        tile = _put_plane(tile, planes, c1, 1, NP)
        tile = _put_plane(tile, planes, c2, 2, NP)
        tile = _put_plane(tile, planes, c3, 3, NP)
        tile = _put_plane(tile, planes, c4, 4, NP)
        tile = _put_plane(tile, planes, c5, 5, NP)
        tile = _put_plane(tile, planes, c6, 6, NP)
        tile = _put_plane(tile, planes, c7, 7, NP)
        tile = _put_plane(tile, planes, c8, 8, NP)
        tile = _put_plane(tile, planes, c9, 9, NP)
        tile = _put_plane(tile, planes, c10, 10, NP)
        tile = _put_plane(tile, planes, c11, 11, NP)
        tile = _put_plane(tile, planes, c12, 12, NP)
        tile = _put_plane(tile, planes, c13, 13, NP)
        tile = _put_plane(tile, planes, c14, 14, NP)
        tile = _put_plane(tile, planes, c15, 15, NP)
        tl.store(out_ptr + b[:, None] * NP + planes[None, :], tile,
                 mask=mask[:, None] & (planes[None, :] < NP))
    else:
        # counter <=> h, from the most significant plane down
        gt = zero
        eq = ~zero
        if NP > 15:
            gt, eq = _compare(c15, 15, h, gt, eq)
        if NP > 14:
            gt, eq = _compare(c14, 14, h, gt, eq)
        if NP > 13:
            gt, eq = _compare(c13, 13, h, gt, eq)
        if NP > 12:
            gt, eq = _compare(c12, 12, h, gt, eq)
        if NP > 11:
            gt, eq = _compare(c11, 11, h, gt, eq)
        if NP > 10:
            gt, eq = _compare(c10, 10, h, gt, eq)
        if NP > 9:
            gt, eq = _compare(c9, 9, h, gt, eq)
        if NP > 8:
            gt, eq = _compare(c8, 8, h, gt, eq)
        if NP > 7:
            gt, eq = _compare(c7, 7, h, gt, eq)
        if NP > 6:
            gt, eq = _compare(c6, 6, h, gt, eq)
        if NP > 5:
            gt, eq = _compare(c5, 5, h, gt, eq)
        if NP > 4:
            gt, eq = _compare(c4, 4, h, gt, eq)
        if NP > 3:
            gt, eq = _compare(c3, 3, h, gt, eq)
        if NP > 2:
            gt, eq = _compare(c2, 2, h, gt, eq)
        if NP > 1:
            gt, eq = _compare(c1, 1, h, gt, eq)
        gt, eq = _compare(c0, 0, h, gt, eq)
        if TERNARY:
            tl.store(out_ptr + 2 * b, gt, mask=mask)
            tl.store(out_ptr + 2 * b + 1, ~(gt | eq), mask=mask)
        else:
            if STEP_ON_DEVICE:  # tie_pattern: 0x55555555 at an even step, 0xAAAAAAAA at an odd
                parity = (tl.load(step_ptr) & 1).to(tl.int32)
                tie = (0x55555555 << parity) * (1 - n % 2)
            tl.store(out_ptr + b, gt | (eq & tie), mask=mask)


# ------------------------------------------------------------------------------------------------
# apply
# ------------------------------------------------------------------------------------------------


@triton.jit
def round_to(xf, DTYPE: tl.constexpr, SOFT_BF16: tl.constexpr):
    """fp32 -> DTYPE, round to nearest even. SOFT_BF16 (interpreter only, whose fp32 -> bf16 cast
    rounds ties away and can drop a carry): the same rounding done on the bits, NaN -> 0x7FC0.
    The loads of bf16 go through ``load_f32`` for the same reason."""
    if SOFT_BF16:
        bits = xf.to(tl.int32, bitcast=True)
        nan = (bits & 0x7FFFFFFF) > 0x7F800000
        bits = tl.where(nan, 0x7FC00000, bits + 0x7FFF + ((bits >> 16) & 1))
        return (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return xf.to(DTYPE)


@triton.jit
def _decode(words, wmask, cols, lut_ptr, n, n_f, MODE_AVG: tl.constexpr, TERNARY: tl.constexpr,
            P: tl.constexpr, LUT_PLANES: tl.constexpr):
    """D of every element [ROWS, 32] from the aggregate words of its block (``_apply_kernel``)."""
    if MODE_AVG:
        q = tl.zeros([words.shape[0], 32], dtype=tl.int32)
        for p in tl.static_range(P):
            w = tl.load(words + p, mask=wmask, other=0)
            q += ((w[:, None] >> cols[None, :]) & 1) << p
        if P <= LUT_PLANES:
            d = tl.load(lut_ptr + q)
        else:
            if TERNARY:
                num = q - n
            else:
                num = 2 * q - n
            d = tl.div_rn(num.to(tl.float32), n_f)
    else:
        w = tl.load(words, mask=wmask, other=0)
        bit = (w[:, None] >> cols[None, :]) & 1
        if TERNARY:
            minus = tl.load(words + 1, mask=wmask, other=0)
            d = (bit - ((minus[:, None] >> cols[None, :]) & 1)).to(tl.float32)
        else:
            d = (2 * bit - 1).to(tl.float32)
    return d


@triton.jit
def _apply_chunk(x_ptr, g_ptr, m_ptr, offs, numel, words, wmask, cols, lut_ptr, n, n_f, has_g,
                 has_m, lr, wd, b2, omb2, go, MODE_AVG: tl.constexpr, TERNARY: tl.constexpr,
                 P: tl.constexpr, LUT_PLANES: tl.constexpr, MASKED: tl.constexpr,
                 SOFT_BF16_X: tl.constexpr, SOFT_BF16_G: tl.constexpr):
    """x <- x - lr * (d + wd * x) in fp32, stored back in x's dtype (round to nearest even), and
    m <- b2 * m + omb2 * g where ``has_m``; nothing is stored unless ``go``. Every load is issued
    before any store and before the decode waits for its words (x, m, g and the words in flight
    together: the stage is bound by the bytes in flight, not by arithmetic)."""
    xf = load_f32(x_ptr, offs, numel, MASKED, SOFT_BF16_X)
    m = tl.zeros_like(xf)
    g = tl.zeros_like(xf)
    if has_m:
        m = load_f32(m_ptr, offs, numel, MASKED, False)
        if has_g:
            g = load_f32(g_ptr, offs, numel, MASKED, SOFT_BF16_G)
    d = _decode(words, wmask, cols, lut_ptr, n, n_f, MODE_AVG, TERNARY, P, LUT_PLANES)
    xf = xf - lr * (d + wd * xf)
    x_new = round_to(xf, x_ptr.dtype.element_ty, SOFT_BF16_X)
    if go:
        if MASKED:
            tl.store(x_ptr + offs, x_new, mask=offs < numel)
        else:
            tl.store(x_ptr + offs, x_new)
        if has_m:
            m_new = b2 * m + omb2 * g
            if MASKED:
                tl.store(m_ptr + offs, m_new, mask=offs < numel)
            else:
                tl.store(m_ptr + offs, m_new)


@triton.jit
def _apply_kernel(
    meta_ptr,  # int64 [T, 9]: x_off, x_present, g_off, g_present, m_off, m_present, numel,
    #            block_off, first
    prog_ptr,  # int32 [programs]: tensor index of each program
    x_base,  # the parameters' base pointer (fp32/bf16/fp16)
    g_base,  # the gradients' base pointer (the parameters' dtype or fp32)
    m_base,  # the momenta's base pointer (fp32)
    agg_ptr,  # int32 packed aggregate, P planes a block
    lut_ptr,  # fp32 [2**P]: D of each count q (average with P <= LUT_PLANES; else unused)
    skip_ptr,  # int32 [1]: the step is dropped when non-zero (read only if HAS_SKIP)
    lr,
    wd,
    b2,
    omb2,
    n,
    n_f,  # float(n), rounded to fp32
    MODE_AVG: tl.constexpr,
    TERNARY: tl.constexpr,
    P: tl.constexpr,
    X_ALIGN: tl.constexpr,  # elements: every x_off is a multiple of this
    G_ALIGN: tl.constexpr,
    M_ALIGN: tl.constexpr,
    HAS_SKIP: tl.constexpr,
    LUT_PLANES: tl.constexpr,
    BLOCK: tl.constexpr,
    SOFT_BF16_X: tl.constexpr,
    SOFT_BF16_G: tl.constexpr,
):
    """One chunk of BLOCK elements of one tensor. Bit j of plane p of block blk (element
    32 * blk + j) decodes to D:

        vote, binary:  D = 2*bit - 1          vote, ternary: D = plus - minus
        average:       q = sum_p bit_p << p,  D = div_rn(float(q - n), n) (ternary)
                                                  div_rn(float(2q - n), n) (binary)
                       (up to LUT_PLANES planes: D = lut[q], the same values made once by
                       the launcher, instead of a division per element)
        x <- x - lr * (D + wd * x)            (fp32, each operation rounded)
        m <- b2 * m + omb2 * g                (fp32; g = 0 for a None gradient; only where
                                               m_present, else neither m nor g is touched)

    Nothing is written when HAS_SKIP and skip_ptr[0] != 0 (a step dropped after the exchange).
    """
    # The flag of a step dropped after the exchange: read with the chunk's loads and tested only
    # before the stores, so that its latency is not paid before the loads are issued.
    go = True
    if HAS_SKIP:
        go = tl.load(skip_ptr) == 0
    pid = tl.program_id(0).to(tl.int64)
    t = tl.load(prog_ptr + pid).to(tl.int64)
    row = meta_ptr + t * 9
    x_ptr = x_base + tl.multiple_of(tl.load(row), X_ALIGN)
    g_ptr = g_base + tl.multiple_of(tl.load(row + 2), G_ALIGN)
    has_g = tl.load(row + 3) != 0
    m_ptr = m_base + tl.multiple_of(tl.load(row + 4), M_ALIGN)
    has_m = tl.load(row + 5) != 0
    numel = tl.load(row + 6)
    block0 = tl.load(row + 7)
    start = (pid - tl.load(row + 8)) * BLOCK

    ROWS: tl.constexpr = BLOCK // 32
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, 32)
    # offsets inside the chunk (int32: the chunk's start is folded into the pointers)
    offs = rows[:, None] * 32 + cols[None, :]
    x_ptr += start
    g_ptr += start
    m_ptr += start
    left = numel - start  # elements of the tensor from the chunk's start
    blk = start // 32 + rows
    wmask = blk < (numel + 31) // 32
    words = agg_ptr + (block0 + blk) * P

    if BLOCK <= left:
        _apply_chunk(x_ptr, g_ptr, m_ptr, offs, left, words, wmask, cols, lut_ptr, n, n_f,
                     has_g, has_m, lr, wd, b2, omb2, go, MODE_AVG, TERNARY, P, LUT_PLANES,
                     MASKED=False, SOFT_BF16_X=SOFT_BF16_X, SOFT_BF16_G=SOFT_BF16_G)
    else:
        _apply_chunk(x_ptr, g_ptr, m_ptr, offs, left, words, wmask, cols, lut_ptr, n, n_f,
                     has_g, has_m, lr, wd, b2, omb2, go, MODE_AVG, TERNARY, P, LUT_PLANES,
                     MASKED=True, SOFT_BF16_X=SOFT_BF16_X, SOFT_BF16_G=SOFT_BF16_G)


# ------------------------------------------------------------------------------------------------
# launchers
# ------------------------------------------------------------------------------------------------

_TABLES: dict = {}
_MAX_CACHED_TABLES = 64
# The average apply reads D from a table of 2**P entries up to this many planes (1 KiB: it stays
# in L1); above it, one division per element.
LUT_PLANES = 8
_LUTS: dict = {}


def average_lut(device, n: int, ternary: bool, planes: int) -> torch.Tensor:
    """fp32 [2**planes]: D(q) = (q - n) / n (ternary) or (2q - n) / n (binary) for every count q,
    each rounded once, as the reference divides (an element-wise fp32 division on the CPU, not a
    multiplication by a reciprocal), on ``device``. Cached per (device, n, ternary, planes)."""
    key = (device, n, ternary, planes)
    lut = _LUTS.get(key)
    if lut is None:
        q = torch.arange(1 << planes, dtype=torch.int64)
        num = (q - n if ternary else 2 * q - n).to(torch.float32)
        lut = to_device(num / torch.full_like(num, float(n)), device)
        if len(_LUTS) >= _MAX_CACHED_TABLES:
            _LUTS.pop(next(iter(_LUTS)))
        _LUTS[key] = lut
    return lut


def chunk_block(numels) -> int:
    """Elements per program: fixed on the GPU; under the interpreter, which pays per program
    instance, as large as the biggest tensor needs (up to 2**16)."""
    if not INTERPRETED:
        return 4096
    biggest = max(numels, default=1)
    return min(1 << 16, max(1024, triton.next_power_of_2(biggest)))


def launch_tables(kind, device, lists, numels, offsets, block):
    """The launches of one stage call: a list of (tensor table, program table, programs, aligned,
    bases), one per *alignment group*. Tensors whose addresses (every list) are all multiples of
    16 bytes go into the aligned launch (vector loads); the others into an unaligned one, so a
    single odd tensor (a view into a flat buffer, a DDP bucket view) does not take every tensor
    off the vector path. Empty groups and empty tensors launch nothing.

    ``lists``: the tensor lists (``None`` allowed) of tensors with ``numels`` elements. The base
    of a list in a group (``bases``: its index, -1 if none) is the group's first tensor with an
    address. Cached on the addresses, sizes, element sizes, block offsets and block size."""
    addresses = tuple(tuple(0 if t is None else t.data_ptr() for t in ts) for ts in lists)
    elsizes = tuple(next((t.element_size() for t in ts if t is not None), 4) for ts in lists)
    key = (kind, device, block, addresses, elsizes, numels, offsets)
    hit = _TABLES.get(key)
    if hit is not None:
        return hit
    groups = {True: [], False: []}
    for i in range(len(numels)):
        if numels[i] > 0:
            groups[all(col[i] % _ALIGN == 0 for col in addresses)].append(i)
    launches = []
    for aligned, members in groups.items():
        if not members:
            continue
        base_index = tuple(next((i for i in members if col[i]), -1) for col in addresses)
        bases = [col[i] if i >= 0 else 0 for col, i in zip(addresses, base_index)]
        rows, counts, first = [], [], 0
        for i in members:
            row = []
            for col, base, size in zip(addresses, bases, elsizes):
                if col[i] == 0:
                    row += [0, 0]
                    continue
                if (col[i] - base) % size:
                    raise ValueError(f"{kind}: tensor {i} is not aligned to its element size")
                row += [(col[i] - base) // size, 1]
            chunks = triton.cdiv(numels[i], block)
            rows.append(row + [numels[i], offsets[i], first])
            counts.append(chunks)
            first += chunks
        meta = torch.tensor(rows, dtype=torch.int64).view(len(rows), -1)
        prog = torch.repeat_interleave(
            torch.arange(len(counts), dtype=torch.int32), torch.tensor(counts, dtype=torch.int64)
        )
        launches.append((to_device(meta, device), to_device(prog, device), first, aligned,
                         base_index))
    if len(_TABLES) >= _MAX_CACHED_TABLES:
        _TABLES.pop(next(iter(_TABLES)))
    _TABLES[key] = launches
    return launches


def in_use(*tables):
    """The cached tables of a launch on the current stream: a cached table may be evicted while
    a launch on another stream still reads it, so the caching allocator is told (record_stream)
    to keep its memory until the work queued so far on this stream has completed."""
    for t in tables:
        if t.is_cuda:
            t.record_stream(torch.cuda.current_stream(t.device))
    keep_if_captured(*tables)
    return tables


def on_device(device):
    """Triton launches on the current CUDA device: make it the tensors' device."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _check_float_list(name, tensors, allowed, device):
    dtype = None
    for i, t in enumerate(tensors):
        if t is None:
            continue
        if t.dtype not in allowed:
            raise TypeError(f"{name}[{i}] must be one of {allowed}, got {t.dtype}")
        if dtype is None:
            dtype = t.dtype
        elif t.dtype != dtype:
            raise TypeError(f"{name} must share one dtype, got {dtype} and {t.dtype} ({name}[{i}])")
        if t.device != device:
            raise ValueError(f"{name}[{i}] is on {t.device}, expected {device}")
        if not t.is_contiguous():
            raise ValueError(f"{name}[{i}] must be contiguous")
    return dtype


def _check_words(name, words, device, needed):
    if words.dtype != torch.int32 or not words.is_contiguous():
        raise TypeError(f"{name} must be a contiguous int32 tensor, got {words.dtype}")
    if words.device != device:
        raise ValueError(f"{name} is on {words.device}, expected {device}")
    if words.numel() < needed:
        raise ValueError(f"{name} holds {words.numel()} words, the tensors need {needed}")


def _check_offsets(offsets, count):
    if len(offsets) != count:
        raise ValueError(f"offsets has {len(offsets)} entries for {count} tensors")


def local_step(grads, exp_avgs, votes, offsets, beta1, ternary):
    """c = b1*m + (1-b1)*g; votes[...] = packed vote(c). m is read only. ``None`` g = 0."""
    if len(grads) != len(exp_avgs):
        raise ValueError(f"grads ({len(grads)}) and exp_avgs ({len(exp_avgs)}) differ in length")
    _check_offsets(offsets, len(exp_avgs))
    if not exp_avgs:
        return
    device = exp_avgs[0].device
    _check_float_list("exp_avgs", exp_avgs, (torch.float32,), device)
    _check_float_list("grads", grads, tuple(_TL_DTYPES), device)
    for i, (g, m) in enumerate(zip(grads, exp_avgs)):
        if g is not None and g.numel() != m.numel():
            raise ValueError(f"grads[{i}] has {g.numel()} elements, exp_avgs[{i}] {m.numel()}")
    planes = vote_planes("ternary" if ternary else "binary")
    numels = tuple(m.numel() for m in exp_avgs)
    offsets = tuple(int(o) for o in offsets)
    needed = max((o + num_blocks(k)) * planes for o, k in zip(offsets, numels))
    _check_words("votes", votes, device, needed)

    block = chunk_block(numels)
    for meta, prog, programs, aligned, (g_i, m_i) in launch_tables(
        "local_step", device, (grads, exp_avgs), numels, offsets, block
    ):
        g_base = grads[g_i] if g_i >= 0 else exp_avgs[m_i]  # all None: any typed pointer will do
        meta, prog = in_use(meta, prog)
        with on_device(device):
            _local_step_kernel[(programs,)](
                meta,
                prog,
                g_base,
                exp_avgs[m_i],
                votes,
                float(beta1),
                float(1.0 - beta1),
                TERNARY=bool(ternary),
                # 4 elements a vector for both, so g (even bf16/fp16) and m share one layout
                G_ALIGN=4 if aligned else 1,
                M_ALIGN=4 if aligned else 1,
                BLOCK=block,
                SOFT_BF16=INTERPRETED and g_base.dtype == torch.bfloat16,
                num_warps=8,
                **LAUNCH_OPTIONS,
            )


def tally(stacked, out, n, mode, ternary, step):
    """Aggregate n stacked packed vote vectors [n, P_in * blocks] into ``out`` [P_out * blocks]."""
    if mode not in ("vote", "average"):
        raise ValueError(f"mode must be 'vote' or 'average', got {mode!r}")
    votes = "ternary" if ternary else "binary"
    n = int(n)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    p_in, p_out = vote_planes(votes), aggregate_planes(mode, votes, n)
    if n > MAX_VOTERS:
        raise ValueError(f"n must be at most {MAX_VOTERS} (the vote vectors one tally counts), "
                         f"got {n}")
    counter_planes = (2 * n).bit_length() if ternary else n.bit_length()
    if stacked.dtype != torch.int32 or not stacked.is_contiguous():
        raise TypeError(f"stacked must be a contiguous int32 tensor, got {stacked.dtype}")
    stacked = stacked.reshape(n, -1)
    blocks = stacked.shape[1] // p_in
    if stacked.shape[1] != blocks * p_in:
        raise ValueError(f"stacked rows hold {stacked.shape[1]} words, not a multiple of {p_in}")
    _check_words("out", out, stacked.device, blocks * p_out)
    if blocks == 0:
        return
    check_step(step, stacked.device)
    counter = isinstance(step, torch.Tensor)  # the step counter: read by the kernel
    if ternary or counter:
        h, tie = (n if ternary else n // 2), 0
    else:
        h, tie = n // 2, (tie_pattern(step) if n % 2 == 0 else 0)
    bw = min(1 << 16, triton.next_power_of_2(blocks)) if INTERPRETED else 512
    with on_device(stacked.device):
        _tally_kernel[(triton.cdiv(blocks, bw),)](
            stacked,
            out,
            n,
            stacked.shape[1],
            blocks,
            h,
            tie,
            step if counter else out,
            MODE_AVG=mode == "average",
            TERNARY=bool(ternary),
            STEP_ON_DEVICE=counter,
            NP=counter_planes,
            NPP=triton.next_power_of_2(counter_planes),
            BW=bw,
            num_warps=4,
            **LAUNCH_OPTIONS,
        )


def apply(params, grads, exp_avgs, aggregate, offsets, lr, weight_decay, beta2, n, mode, ternary,
          skip=None):
    """x = x - lr * (D + weight_decay * x) in fp32, stored back in the parameter's dtype;
    m = b2*m + (1-b2)*g (fp32). Nothing when ``skip`` (int32 [1] on the device) is non-zero,
    read by the kernel. ``exp_avgs=None`` (or a None entry): x only, no momentum (the gradient
    is then not read)."""
    if mode not in ("vote", "average"):
        raise ValueError(f"mode must be 'vote' or 'average', got {mode!r}")
    if exp_avgs is None:
        grads = exp_avgs = [None] * len(params)
    if not len(params) == len(grads) == len(exp_avgs):
        raise ValueError(
            f"params ({len(params)}), grads ({len(grads)}) and exp_avgs ({len(exp_avgs)}) differ "
            "in length"
        )
    _check_offsets(offsets, len(params))
    if not params:
        return
    n = int(n)
    device = params[0].device
    x_dtype = _check_float_list("params", params, tuple(_TL_DTYPES), device)
    g_dtype = _check_float_list("grads", grads, tuple(_TL_DTYPES), device) or x_dtype
    if g_dtype not in (x_dtype, torch.float32):
        raise TypeError(f"grads must have the parameters' dtype ({x_dtype}) or float32, got "
                        f"{g_dtype}")
    _check_float_list("exp_avgs", exp_avgs, (torch.float32,), device)
    for i, (x, g, m) in enumerate(zip(params, grads, exp_avgs)):
        for what, t in (("grads", g), ("exp_avgs", m)):
            if t is not None and t.numel() != x.numel():
                raise ValueError(f"{what}[{i}] has {t.numel()} elements, params[{i}] {x.numel()}")
    if skip is not None and (skip.dtype != torch.int32 or skip.numel() < 1
                             or skip.device != device):
        raise TypeError(f"skip must be an int32 tensor of 1 element on {device}, got "
                        f"{skip.dtype} of {skip.numel()} on {skip.device}")
    planes = aggregate_planes(mode, "ternary" if ternary else "binary", n)
    numels = tuple(x.numel() for x in params)
    offsets = tuple(int(o) for o in offsets)
    needed = max((o + num_blocks(k)) * planes for o, k in zip(offsets, numels))
    _check_words("aggregate", aggregate, device, needed)

    block = chunk_block(numels)
    lut = aggregate  # any int32/fp32 pointer will do where the kernel reads no table
    if mode == "average" and planes <= LUT_PLANES:
        lut = average_lut(device, n, bool(ternary), planes)
        keep_if_captured(lut)
    for meta, prog, programs, aligned, (x_i, g_i, m_i) in launch_tables(
        "apply", device, (params, grads, exp_avgs), numels, offsets, block
    ):
        x_base = params[x_i]
        # no momentum at all: any fp32 pointer will do (never read: m_present is 0 everywhere)
        m_base = exp_avgs[m_i] if m_i >= 0 else aggregate.view(torch.float32)
        g_base = grads[g_i] if g_i >= 0 else m_base  # all None: any typed pointer will do
        meta, prog = in_use(meta, prog)
        with on_device(device):
            _apply_kernel[(programs,)](
                meta,
                prog,
                x_base,
                g_base,
                m_base,
                aggregate,
                lut,
                skip if skip is not None else aggregate,
                float(lr),
                float(weight_decay),
                float(beta2),
                float(1.0 - beta2),
                n,
                float(n),
                MODE_AVG=mode == "average",
                TERNARY=bool(ternary),
                P=planes,
                # 4 elements a vector for every list, so x, g (even bf16/fp16) and m share one
                # register layout: with 8 for 2-byte x and g, m's store went through a layout
                # conversion in shared memory
                X_ALIGN=4 if aligned else 1,
                G_ALIGN=4 if aligned else 1,
                M_ALIGN=4 if aligned else 1,
                HAS_SKIP=skip is not None,
                LUT_PLANES=LUT_PLANES,
                BLOCK=block,
                SOFT_BF16_X=INTERPRETED and x_dtype == torch.bfloat16,
                SOFT_BF16_G=INTERPRETED and g_base.dtype == torch.bfloat16,
                num_warps=8,
                **LAUNCH_OPTIONS,
            )


__all__ = ["apply", "local_step", "nonfinite", "tally"]
