"""Property-based fuzzing (hypothesis) of the public entry points: the inputs and comparisons
shared by their tests (``exchange/test_step.py``: ``fused_dlion_step``; ``optim/test_dlion.py``:
``DistributedLion``, constructor and ``step``; ``test_checkpoint.py``: ``load_state``).

Every case either works as the pure-PyTorch reference does (``backend="torch"``, itself checked
against the Lion formula on unaliased inputs) or raises TypeError / ValueError (or the documented
NonFiniteGradientError) with every input unchanged. A fixed, derandomized number of examples runs
in CI.
"""

import math
import os

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

import dlion_kernels as dk

# Fixed and bounded in CI; DLION_FUZZ_EXAMPLES=1000 for a longer hunt.
FUZZ = settings(max_examples=int(os.environ.get("DLION_FUZZ_EXAMPLES", "80")), derandomize=True,
                deadline=None, database=None, suppress_health_check=list(HealthCheck))
EXPECTED = (TypeError, ValueError, dk.NonFiniteGradientError)
FLOATS = [torch.float32, torch.bfloat16, torch.float16]
DTYPES = FLOATS * 4 + [torch.float64, torch.int32, torch.int64, torch.bool, torch.complex64]
SPECIAL = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "huge": 6e4, "tiny": 1e-30,
           "zero": 0.0, "-zero": -0.0}


# ----------------------------------------------------------------------------- building inputs


def random_tensor(data, shape, dtype, valid=False):
    """A tensor of ``shape`` with a random memory layout, device and dtype (``valid``: a layout
    and device every entry point accepts)."""
    layouts = ["contiguous"] * 4 + ["transposed", "sliced"] + ([] if valid else ["expanded"])
    layout = data.draw(st.sampled_from(layouts))
    device = "cpu" if valid else data.draw(st.sampled_from(["cpu"] * 15 + ["meta"]))
    seed = data.draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)

    def fresh(s):
        if device == "meta":
            return torch.empty(s, dtype=dtype, device="meta")
        if dtype == torch.bool:
            return torch.rand(s, generator=gen) > 0.5
        if not (dtype.is_floating_point or dtype.is_complex):
            return torch.randint(-5, 5, s, generator=gen, dtype=dtype)
        return torch.randn(s, generator=gen, dtype=torch.float64).to(dtype)

    if layout == "transposed" and len(shape) >= 2:
        t = fresh(tuple(reversed(shape))).permute(*reversed(range(len(shape))))
    elif layout == "sliced" and len(shape) >= 1:
        t = fresh((*shape[:-1], 2 * shape[-1]))[..., ::2]
    elif layout == "expanded" and len(shape) >= 1 and shape[0] > 1:
        t = fresh((1, *shape[1:])).expand(shape)
    else:
        t = fresh(shape)
    special = data.draw(st.sampled_from([None] * 6 + list(SPECIAL)))
    if special and device != "meta" and t.numel() > 0 and dtype.is_floating_point:
        t[(0,) * t.dim()] = SPECIAL[special]
    return t


def random_shapes(data):
    k = data.draw(st.integers(0, 4))
    dims = st.integers(0, 6)
    return [tuple(data.draw(st.lists(dims, min_size=0, max_size=3))) for _ in range(k)]


def tensor_lists(data, valid):
    """params, grads, exp_avgs with random shapes, dtypes, layouts, devices, values, aliasing
    (``valid``: only what the contract accepts, so that half the examples run a step)."""
    shapes = random_shapes(data)
    params, grads, exp_avgs = [], [], []
    dtypes = FLOATS if valid else DTYPES
    for s in shapes:
        dtype = data.draw(st.sampled_from(dtypes))
        params.append(random_tensor(data, s, dtype, valid))
        grads.append(None if data.draw(st.integers(0, 5)) == 0 else
                     random_tensor(data, s, data.draw(st.sampled_from(dtypes)), valid))
        m_dtype = torch.float32 if valid else data.draw(
            st.sampled_from([torch.float32] * 6 + [torch.float16, torch.int32]))
        exp_avgs.append(random_tensor(data, s, m_dtype, valid))
    if valid:
        return params, grads, exp_avgs
    if params and data.draw(st.integers(0, 3)) == 0:  # aliasing between (or within) the lists
        i, j = data.draw(st.integers(0, len(params) - 1)), data.draw(st.integers(0,
                                                                                 len(params) - 1))
        kind = data.draw(st.sampled_from(["p=p", "g=p", "m=p", "m=m", "g=m", "p=view"]))
        if kind == "p=p":
            params[j] = params[i]
        elif kind == "g=p":
            grads[j] = params[i]
        elif kind == "m=p":
            exp_avgs[j] = params[i]
        elif kind == "m=m":
            exp_avgs[j] = exp_avgs[i]
        elif kind == "g=m":
            grads[j] = exp_avgs[i]
        elif params[i].dim() >= 1 and params[i].shape[0] > 1:  # a view of another parameter
            params[j] = params[i][1:]
            grads[j] = None if grads[j] is None else torch.zeros(params[j].shape)
            exp_avgs[j] = torch.zeros(params[j].shape)
    wrong = data.draw(st.sampled_from([None] * 10 + ["tensor-list", "float-in", "none-m",
                                                     "short"]))
    if wrong == "tensor-list" and params:
        params = params[0]
    elif wrong == "float-in" and params:
        params = [1.0] + params[1:]
    elif wrong == "none-m" and exp_avgs:
        exp_avgs = [None] + exp_avgs[1:]
    elif wrong == "short" and grads:
        grads = grads[:-1]
    return params, grads, exp_avgs


LRS = [0.0, 1e-300, 1e-8, 1e-2, 1.0, 1e30, 1e300, -1e-3, math.nan, math.inf, "0.1", None, True,
       torch.tensor(0.1)]
BETAS = [(0.9, 0.99), (0.0, 0.0), (0.999999, 0.5), (1.0, 0.9), (-0.1, 0.9), (0.9,), (math.nan, 0.9),
         [0.9, 0.99], "ab"]
WDS = [0.0, 0.1, 1e10, -1.0, math.inf]


def hyperparameters(data, valid):
    def pick(good, bad):
        return data.draw(st.sampled_from(good if valid else good * 3 + bad))

    return dict(lr=pick(LRS[:7], LRS[7:]), betas=pick(BETAS[:3], BETAS[3:]),
                weight_decay=pick(WDS[:3], WDS[3:]), mode=pick(["vote", "average"], ["sum"]),
                votes=pick(["binary", "ternary"], [1]))


# ----------------------------------------------------------------------------- comparing


def flat_tensors(obj):
    """Every distinct tensor object reachable in nested lists (deepcopy keeps the structure)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in flat_tensors(o)]
    return []


def snapshot(obj):
    return [t.detach().clone() if t.device.type != "meta" else None for t in flat_tensors(obj)]


def same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def assert_unchanged(obj, snap):
    for t, s in zip(flat_tensors(obj), snap):
        if s is not None:
            same(t, s)


def outcome(fn):
    try:
        return fn(), None
    except EXPECTED as e:
        return None, e


def lion_formula(params, grads, exp_avgs, lr, betas, weight_decay, votes):
    """Plain Lion, one rank (binary: c > 0 votes +1 else -1), in fp32 as the contract says."""
    b1, b2 = betas
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    out_p, out_m = [], []
    for p, g, m in zip(params, grads, exp_avgs):
        gf = torch.zeros(p.shape) if g is None else g.float()
        c = f32(b1) * m + f32(1.0 - b1) * gf
        d = torch.sign(c) if votes == "ternary" else torch.where(c > 0, 1.0, -1.0)
        x = p.float()
        out_p.append((x - f32(lr) * (d + f32(weight_decay) * x)).to(p.dtype))
        out_m.append(f32(b2) * m + f32(1.0 - b2) * gf)
    return out_p, out_m


def aliased(params, grads, exp_avgs):
    ts = [t for t in [*params, *grads, *exp_avgs] if isinstance(t, torch.Tensor)]
    ptrs = [t.untyped_storage().data_ptr() for t in ts if t.numel() > 0 and t.device.type != "meta"]
    return len(ptrs) != len(set(ptrs)) or any(
        0 in t.stride() and t.numel() > 1 for t in ts)


def split_snapshot(snap, inputs):
    """The snapshot as (params, grads, exp_avgs) lists, None grads kept."""
    it = iter(snap)
    out = []
    for seq in inputs:
        out.append([None if t is None else next(it) for t in seq])
    return out
