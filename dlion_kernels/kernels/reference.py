"""The ``torch`` backend: a readable fp32 reference of the three stages, the oracle for the others.

Every backend implements the same three functions with the same arguments (see ``backends.py``):

- ``local_step(grads, exp_avgs, votes, offsets, beta1, ternary)``: votes of c; m is read only
- ``tally(stacked, out, n, mode, ternary, step)``: ``step`` an int, or the step counter as an
  int64 tensor of one element on ``stacked``'s device (read there: a step captured in a CUDA
  graph follows the counter on every replay)
- ``apply(params, grads, exp_avgs, aggregate, offsets, lr, weight_decay, beta2, n, mode, ternary,
  skip=None)``: x and m, unless ``skip`` (int32 [1] on the device) holds a non-zero flag;
  ``exp_avgs=None``: x only, no momentum read or written, and ``grads`` (then None or any list)
  not read (hierarchical D-Lion updates its momentum shard apart)
- ``nonfinite(grads)``: the check that runs before a step modifies anything

The momentum is written by ``apply``, not by ``local_step`` (kernel stages v2): a step that is
dropped after the exchange (a non-finite gradient on some rank, known only from the exchange's
payload) leaves both x and m untouched, and the GPU kernels read that flag on the device.

The packed formats are described in ``layout.py``. Arithmetic is fp32, one IEEE rounding per
operation and no fused multiply-add, in exactly the order written below; the other backends do the
same, which is what makes votes bit-exact across backends.
"""

from __future__ import annotations

import torch

from .layout import BLOCK, aggregate_planes, num_blocks, tie_pattern, vote_planes

_F32 = torch.float32
_SHIFTS = torch.arange(BLOCK, dtype=torch.int64)


def _f32(value: float, device) -> torch.Tensor:
    # Python floats are rounded to fp32 once, as a kernel argument would be.
    return torch.tensor(value, dtype=_F32, device=device)


def pack_bits(planes: list[torch.Tensor], numel: int) -> torch.Tensor:
    """Pack P boolean planes of ``numel`` elements into int32 words, block-interleaved."""
    nb = num_blocks(numel)
    device = planes[0].device
    bits = torch.zeros(len(planes), nb * BLOCK, dtype=torch.int64, device=device)
    for p, plane in enumerate(planes):
        bits[p, :numel] = plane.reshape(-1).to(torch.int64)
    words = (bits.view(len(planes), nb, BLOCK) << _SHIFTS.to(device)).sum(-1)  # [P, nb]
    return words.t().contiguous().view(-1).to(torch.int32)  # wraps bit 31 into the sign


def unpack_bits(words: torch.Tensor, planes: int) -> torch.Tensor:
    """int32 words [..., nb * P] -> bits [..., nb, P, 32] as int64 0/1."""
    w = words.to(torch.int64).view(*words.shape[:-1], -1, planes, 1)
    return (w >> _SHIFTS.to(words.device)) & 1


def local_step(grads, exp_avgs, votes, offsets, beta1, ternary):
    """c = b1*m + (1-b1)*g; votes[...] = packed vote(c). m is read only. ``None`` g = 0."""
    planes = 2 if ternary else 1
    for g, m, off in zip(grads, exp_avgs, offsets):
        device = m.device
        b1, omb1 = _f32(beta1, device), _f32(1.0 - beta1, device)
        mf = m.reshape(-1)
        gf = torch.zeros_like(mf) if g is None else g.reshape(-1).to(_F32)
        c = b1 * mf + omb1 * gf
        vote = [c > 0, c < 0] if ternary else [c > 0]
        nb = num_blocks(mf.numel())
        votes[off * planes : (off + nb) * planes] = pack_bits(vote, mf.numel())


def check_step(step, device) -> None:
    """``step`` for a tally: an int >= 0, or an int64 tensor of one element on ``device``."""
    if isinstance(step, torch.Tensor):
        if step.dtype != torch.int64 or step.numel() != 1 or step.device != device:
            raise TypeError(f"a step counter tensor must be int64 of one element on {device}, "
                            f"got {step.dtype} of {step.numel()} on {step.device}")
    elif isinstance(step, bool) or not hasattr(step, "__index__"):
        raise TypeError(f"step must be an int or an int64 tensor, got {type(step).__name__}")


def tie_bits(step, device) -> torch.Tensor:
    """int64 [32]: bit j of the tie pattern at ``step`` (layout.py: 1 where j + step is even);
    ``step`` an int, or the counter tensor (computed on its device, never read back)."""
    shifts = _SHIFTS.to(device)
    if isinstance(step, torch.Tensor):
        return ((shifts + step.reshape(()).to(device)) % 2 == 0).to(torch.int64)
    return (tie_pattern(step) >> shifts) & 1


def tally(stacked, out, n, mode, ternary, step):
    """Aggregate n stacked packed vote vectors [n, P_in * blocks] into ``out`` [P_out * blocks]."""
    check_step(step, stacked.device)
    bits = unpack_bits(stacked.reshape(n, -1), vote_planes("ternary" if ternary else "binary"))
    device = stacked.device
    if ternary:
        q = bits[:, :, 0].sum(0) - bits[:, :, 1].sum(0)  # [blocks, 32], sum of votes in -n..n
        if mode == "vote":
            result = [q > 0, q < 0]
        else:
            result = [((q + n) >> p) & 1 for p in range(aggregate_planes(mode, "ternary", n))]
    else:
        k = bits[:, :, 0].sum(0)  # number of +1 votes, 0..n
        if mode == "vote":
            pattern = tie_bits(step, device)
            result = [(2 * k > n) | ((2 * k == n) & (pattern == 1))]
        else:
            result = [(k >> p) & 1 for p in range(aggregate_planes(mode, "binary", n))]
    out.copy_(pack_bits([r.reshape(-1) for r in result], result[0].numel()))


def decode(aggregate, numel, n, mode, ternary) -> torch.Tensor:
    """The update direction D (fp32) of ``numel`` elements from packed aggregate words."""
    votes = "ternary" if ternary else "binary"
    planes = aggregate_planes(mode, votes, n)
    bits = unpack_bits(aggregate, planes)  # [nb, P, 32]
    if mode == "vote":
        d = bits[:, 0] - bits[:, 1] if ternary else 2 * bits[:, 0] - 1
        d = d.to(_F32)
    else:
        q = sum(bits[:, p] << p for p in range(planes))
        num = (q - n) if ternary else (2 * q - n)
        d = num.to(_F32) / _f32(float(n), aggregate.device)
    return d.reshape(-1)[:numel]


def apply(params, grads, exp_avgs, aggregate, offsets, lr, weight_decay, beta2, n, mode, ternary,
          skip=None):
    """x = x - lr * (D + weight_decay * x) in fp32, stored back in the parameter's dtype, and
    m = b2*m + (1-b2)*g (fp32; ``None`` g = 0; g may have another dtype than x). Nothing at all
    when ``skip`` (int32 [1]) is given and non-zero. ``exp_avgs=None``: x only, no momentum;
    ``grads`` (None or a list) is not read."""
    if skip is not None and int(skip[0]) != 0:
        return
    planes = aggregate_planes(mode, "ternary" if ternary else "binary", n)
    if exp_avgs is None:
        grads = exp_avgs = [None] * len(params)
    for x, g, m, off in zip(params, grads, exp_avgs, offsets):
        nb = num_blocks(x.numel())
        words = aggregate[off * planes : (off + nb) * planes]
        d = decode(words, x.numel(), n, mode, ternary)
        lr32, wd32 = _f32(lr, x.device), _f32(weight_decay, x.device)
        xf = x.reshape(-1).to(_F32)
        xf = xf - lr32 * (d + wd32 * xf)
        x.copy_(xf.view_as(x).to(x.dtype))
        if m is None:
            continue
        b2, omb2 = _f32(beta2, m.device), _f32(1.0 - beta2, m.device)
        mf = m.reshape(-1)
        gf = torch.zeros_like(mf) if g is None else g.reshape(-1).to(_F32)
        mf.copy_(b2 * mf + omb2 * gf)


def nonfinite(grads) -> torch.Tensor:
    """int32 [1] on the gradients' device: 1 if any of ``grads`` (non-empty, one device, any
    float dtypes) holds inf or NaN, else 0. One fused multi-tensor read of the gradients."""
    norms = torch._foreach_norm(grads, float("inf"))  # NaN and inf propagate into the max
    return (~torch.stack(norms).isfinite()).any().to(torch.int32).view(1)
