"""exchange/checks.py: argument validation at the Python boundary. Every bad value raises
ValueError / TypeError naming the argument and what is allowed; good values pass; the aliasing
check refuses every parameter or momentum that shares memory, and nothing else."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlion_kernels.exchange.checks import (
    DTYPES,
    MODES,
    NONFINITE,
    VOTES,
    check_hyperparameters,
    check_no_overlap,
    check_options,
    check_params,
    check_tensors,
)
from dlion_kernels.kernels.backends import BACKENDS

# ----------------------------------------------------------------------------- hyperparameters


def test_hyperparameters_good():
    assert check_hyperparameters(1e-3, (0.9, 0.99), 0.1) == (0.9, 0.99)
    assert check_hyperparameters(0, [0, 0.5], 0) == (0.0, 0.5)
    b1, b2 = check_hyperparameters(1, (0, 0), 0)
    assert type(b1) is float and type(b2) is float


@pytest.mark.parametrize("lr", [-1e-3, math.nan, math.inf, -math.inf, True, "0.1", None,
                                torch.tensor(0.1)])
def test_bad_lr(lr):
    with pytest.raises(ValueError, match=r"^lr must be a finite number >= 0, got "):
        check_hyperparameters(lr, (0.9, 0.99), 0.0)


@pytest.mark.parametrize("betas", [(0.9,), (0.9, 0.99, 0.5), (1.0, 0.9), (0.9, 1.0), (-0.1, 0.9),
                                   (math.nan, 0.9), (0.9, math.inf), "ab", 0.9, None,
                                   (True, 0.9), {0.9, 0.99}])
def test_bad_betas(betas):
    with pytest.raises(ValueError, match=r"^betas must be a pair of numbers in \[0, 1\), got "):
        check_hyperparameters(1e-3, betas, 0.0)


@pytest.mark.parametrize("wd", [-0.1, math.nan, math.inf, False, "0"])
def test_bad_weight_decay(wd):
    with pytest.raises(ValueError, match=r"^weight_decay must be a finite number >= 0, got "):
        check_hyperparameters(1e-3, (0.9, 0.99), wd)


# ----------------------------------------------------------------------------- options


def test_options_good():
    for mode in MODES:
        for votes in VOTES:
            for backend in (None, *BACKENDS):
                for nonfinite in NONFINITE:
                    check_options(mode, votes, backend, nonfinite)


@pytest.mark.parametrize("args, message", [
    (("sum", "binary", None, "raise"), r"mode must be one of \('vote', 'average'\), got 'sum'"),
    (("vote", 1, None, "raise"), r"votes must be one of \('binary', 'ternary'\), got 1"),
    (("vote", "binary", "gpu", "raise"),
     r"backend must be one of \('cuda', 'triton', 'cpu', 'torch'\) or None, got 'gpu'"),
    (("vote", "binary", None, "ignore"),
     r"nonfinite must be one of \('raise', 'skip'\), got 'ignore'"),
])
def test_bad_options(args, message):
    with pytest.raises(ValueError, match=message):
        check_options(*args)


# ----------------------------------------------------------------------------- tensors


def test_params_good():
    assert check_params([]) is None
    assert check_params([torch.zeros(3, dtype=d) for d in DTYPES]) == torch.device("cpu")
    assert check_params((torch.zeros(4, 5).t(), torch.zeros(0))) == torch.device("cpu")


@pytest.mark.parametrize("params, error, message", [
    ([torch.zeros(3), 1.0], TypeError, r"params\[1\] must be a torch.Tensor, got float"),
    ([torch.zeros(3).to_sparse()], TypeError,
     r"params\[0\] must be a dense \(strided\) tensor, got layout torch.sparse_coo"),
    ([torch.zeros(3, dtype=torch.float64)], TypeError,
     r"params\[0\] must have dtype float32, bfloat16, float16; got torch.float64"),
    ([torch.zeros(3, dtype=torch.int32)], TypeError, r"params\[0\] must have dtype"),
    ([torch.zeros(3), torch.empty(3, device="meta")], ValueError,
     r"params\[1\] is on device meta; allowed: cpu, cuda"),
])
def test_bad_params(params, error, message):
    with pytest.raises(error, match=message):
        check_params(params)


def _lists(n=2, dtype=torch.float32):
    return ([torch.randn(5, 3).to(dtype) for _ in range(n)],
            [torch.randn(5, 3).to(dtype) for _ in range(n)],
            [torch.zeros(5, 3) for _ in range(n)])


def test_tensors_good():
    assert check_tensors([], [], []) is None
    params, grads, moms = _lists()
    assert check_tensors(params, grads, moms) == torch.device("cpu")
    grads[0] = None  # a parameter without a gradient
    check_tensors(tuple(params), tuple(grads), tuple(moms))
    params, grads, moms = _lists(dtype=torch.bfloat16)
    grads[1] = grads[1].float()  # an fp32 gradient of a bf16 parameter: allowed
    check_tensors(params, grads, moms)


@pytest.mark.parametrize("case, error, message", [
    ("params-tensor", TypeError, r"params must be a list or tuple of tensors, got Tensor"),
    ("grads-generator", TypeError, r"grads must be a list or tuple of tensors, got generator"),
    ("short", ValueError,
     r"params, grads and exp_avgs must have equal lengths, got 2, 2, 1"),
    ("grad-shape", ValueError, r"grads\[1\] has shape \(3, 5\), params\[1\] has \(5, 3\)"),
    ("grad-dtype", TypeError,
     r"grads\[0\] has dtype torch.float16; allowed: the parameter's dtype \(torch.bfloat16\) or "
     r"float32"),
    ("grad-int", TypeError, r"grads\[0\] must have dtype float32, bfloat16, float16; got "),
    ("mom-dtype", TypeError, r"exp_avgs\[1\] must have dtype float32; got torch.bfloat16"),
    ("mom-none", TypeError, r"exp_avgs\[0\] must be a torch.Tensor, got NoneType"),
    ("mom-shape", ValueError, r"exp_avgs\[0\] has shape \(15,\), params\[0\] has \(5, 3\)"),
])
def test_bad_tensors(case, error, message):
    params, grads, moms = _lists(dtype=torch.bfloat16 if case == "grad-dtype" else torch.float32)
    if case == "params-tensor":
        params = params[0]
    elif case == "grads-generator":
        grads = (g for g in grads)
    elif case == "short":
        moms = moms[:1]
    elif case == "grad-shape":
        grads[1] = torch.randn(3, 5)
    elif case == "grad-dtype":
        grads[0] = grads[0].half()
    elif case == "grad-int":
        grads[0] = torch.zeros(5, 3, dtype=torch.int64)
    elif case == "mom-dtype":
        moms[1] = moms[1].bfloat16()
    elif case == "mom-none":
        moms[0] = None
    else:
        moms[0] = torch.zeros(15)
    snapshot = [t.clone() for t in (params if isinstance(params, list) else [params])]
    with pytest.raises(error, match=message):
        check_tensors(params, grads, moms)
    for a, b in zip(params if isinstance(params, list) else [params], snapshot):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- aliasing


def test_documented_aliasing_cases():
    p, g, m = torch.randn(8), torch.randn(8), torch.zeros(8)
    refused = {
        ("params[1]", "params[0]"): ([p, p], [g, g.clone()], [m, m.clone()]),
        ("grads[0]", "params[0]"): ([p], [p], [m]),
        ("exp_avgs[0]", "params[0]"): ([p], [g], [p]),
        ("exp_avgs[0] has elements",): ([p], [g], [torch.zeros(1).expand(8)]),
        ("params[0] has elements",): ([torch.zeros(4, 1).expand(4, 2)], [torch.zeros(4, 2)],
                                      [torch.zeros(4, 2)]),
    }
    for names, lists in refused.items():
        with pytest.raises(ValueError, match="share memory") as info:
            check_no_overlap(*lists)
        assert all(name in str(info.value) for name in names), (names, str(info.value))


def test_overlapping_windows_are_refused():
    """unfold's windows overlap inside one tensor whose byte range is wide (the old check, span
    shorter than numel, let this through: shape (2, 2, 6), strides (100, 5, 1))."""
    windows = torch.zeros(2, 100)[:, :11].unfold(1, 6, 5)
    assert windows.stride() == (100, 5, 1)
    with pytest.raises(ValueError, match=r"params\[0\] has elements that share memory"):
        check_no_overlap([windows], [torch.zeros(2, 2, 6)], [torch.zeros(2, 2, 6)])


def test_allowed_sharing():
    a = torch.randn(16)
    # gradients are only read: they may alias each other, and be expanded
    check_no_overlap([torch.zeros(8), torch.zeros(8)], [a[:8], a[:8]],
                     [torch.zeros(8), torch.zeros(8)])
    check_no_overlap([torch.zeros(4, 2)], [torch.ones(1).expand(4, 2)], [torch.zeros(4, 2)])
    # disjoint views of one buffer, empty tensors, None gradients
    flat = torch.zeros(30)
    check_no_overlap([flat[0:10], flat[10:20].view(2, 5).t()], [None, torch.zeros(5, 2)],
                     [flat[20:30], torch.zeros(5, 2)])
    check_no_overlap([flat[3:3], torch.zeros(2)], [flat[0:10][:0], None], [flat[3:3],
                                                                          torch.zeros(2)])


def test_interleaved_views_are_refused_conservatively():
    a = torch.zeros(10)
    with pytest.raises(ValueError, match="share memory"):
        check_no_overlap([a[::2], a[1::2]], [None, None], [torch.zeros(5), torch.zeros(5)])


POOL = 64  # elements of each base buffer


@st.composite
def _view(draw, written):
    """A view of one of two fp32 base buffers: (pool, tensor maker, first and last element it
    touches, expanded). Written tensors are 1-D strided, 2-D (maybe transposed) or expanded;
    read-only ones take any strides."""
    pool = draw(st.integers(0, 1))
    offset = draw(st.integers(0, POOL - 1))
    kind = draw(st.sampled_from(["1d", "2d", "expanded"] if written else
                                ["1d", "2d", "expanded", "strided"]))
    if kind == "1d":
        step = draw(st.integers(1, 3))
        n = draw(st.integers(0, (POOL - 1 - offset) // step + 1))
        shape, strides = (n,), (step,)
    elif kind == "2d":
        rows, cols = draw(st.integers(1, 4)), draw(st.integers(1, 4))
        if offset + rows * cols > POOL:
            offset = POOL - rows * cols
        transposed = draw(st.booleans())
        shape, strides = ((cols, rows), (1, cols)) if transposed else ((rows, cols), (cols, 1))
    elif kind == "expanded":
        shape, strides = (draw(st.integers(2, 4)), draw(st.integers(1, 3))), (0, 1)
        offset = min(offset, POOL - shape[1])
    else:
        shape = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
        strides = (draw(st.integers(0, 5)), draw(st.integers(0, 5)))
        offset = min(offset, POOL - 1 - sum((n - 1) * s for n, s in zip(shape, strides)))
        if offset < 0:
            shape, strides, offset = (1, 1), (1, 1), 0
    last = offset + sum((n - 1) * s for n, s in zip(shape, strides))
    empty = math.prod(shape) == 0
    return pool, shape, strides, offset, last, kind == "expanded" and not empty, empty


@settings(max_examples=300, derandomize=True, deadline=None, database=None)
@given(st.data())
def test_aliasing_against_brute_force(data):
    """Raises exactly when a written tensor (param, momentum) holds an element twice or its
    element range meets another tensor's in the same buffer (the documented conservative rule),
    whatever the order of the lists and the addresses."""
    k = data.draw(st.integers(1, 3))
    specs = {name: [data.draw(_view(name != "grads")) for _ in range(k)]
             for name in ("params", "grads", "exp_avgs")}
    nones = [data.draw(st.booleans()) for _ in range(k)]
    pools = [torch.zeros(POOL), torch.zeros(POOL)]

    def make(spec):
        pool, shape, strides, offset = spec[:4]
        return pools[pool].as_strided(shape, strides, offset)

    lists = {name: [make(s) for s in ss] for name, ss in specs.items()}
    lists["grads"] = [None if none else g for none, g in zip(nones, lists["grads"])]
    live = [(name, s) for name, ss in specs.items() for i, s in enumerate(ss)
            if not s[6] and not (name == "grads" and nones[i])]
    expect = any(s[5] for name, s in live if name != "grads")
    for i, (name_a, a) in enumerate(live):
        for name_b, b in live[i + 1:]:
            written = name_a != "grads" or name_b != "grads"
            if written and a[0] == b[0] and a[3] <= b[4] and b[3] <= a[4]:
                expect = True
    if expect:
        with pytest.raises(ValueError, match="share memory"):
            check_no_overlap(lists["params"], lists["grads"], lists["exp_avgs"])
    else:
        check_no_overlap(lists["params"], lists["grads"], lists["exp_avgs"])
