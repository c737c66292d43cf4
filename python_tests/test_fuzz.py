"""Property-based fuzzing (hypothesis) of the public entry points: ``fused_dlion_step``,
``DistributedLion`` (constructor and ``step``) and ``load_state``.

Every case either works as the pure-PyTorch reference does (``backend="torch"``, itself checked
against the Lion formula on unaliased inputs) or raises TypeError / ValueError (or the documented
NonFiniteGradientError) with every input unchanged. A fixed, derandomized number of examples runs
in CI. ``plan``'s inputs are not fuzzed here: the runtime model is not in this tree yet.
"""

import copy
import functools
import json
import math
import os
import tempfile

import pytest
import torch
from conftest import assert_close_storage

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import dlion_kernels as dk  # noqa: E402

# Fixed and bounded in CI; DLION_FUZZ_EXAMPLES=1000 for a longer hunt.
FUZZ = settings(max_examples=int(os.environ.get("DLION_FUZZ_EXAMPLES", "80")), derandomize=True,
                deadline=None, database=None, suppress_health_check=list(HealthCheck))
EXPECTED = (TypeError, ValueError, dk.NonFiniteGradientError)
FLOATS = [torch.float32, torch.bfloat16, torch.float16]
DTYPES = FLOATS * 4 + [torch.float64, torch.int32, torch.int64, torch.bool, torch.complex64]
SPECIAL = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "huge": 6e4, "tiny": 1e-30,
           "zero": 0.0, "-zero": -0.0}


# ----------------------------------------------------------------------------- building inputs


def _tensor(data, shape, dtype, valid=False):
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


def _shapes(data):
    k = data.draw(st.integers(0, 4))
    dims = st.integers(0, 6)
    return [tuple(data.draw(st.lists(dims, min_size=0, max_size=3))) for _ in range(k)]


def _lists(data, valid):
    """params, grads, exp_avgs with random shapes, dtypes, layouts, devices, values, aliasing
    (``valid``: only what the contract accepts, so that half the examples run a step)."""
    shapes = _shapes(data)
    params, grads, exp_avgs = [], [], []
    dtypes = FLOATS if valid else DTYPES
    for s in shapes:
        dtype = data.draw(st.sampled_from(dtypes))
        params.append(_tensor(data, s, dtype, valid))
        grads.append(None if data.draw(st.integers(0, 5)) == 0 else
                     _tensor(data, s, data.draw(st.sampled_from(dtypes)), valid))
        m_dtype = torch.float32 if valid else data.draw(
            st.sampled_from([torch.float32] * 6 + [torch.float16, torch.int32]))
        exp_avgs.append(_tensor(data, s, m_dtype, valid))
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


def _hyper(data, valid):
    def pick(good, bad):
        return data.draw(st.sampled_from(good if valid else good * 3 + bad))

    return dict(lr=pick(LRS[:7], LRS[7:]), betas=pick(BETAS[:3], BETAS[3:]),
                weight_decay=pick(WDS[:3], WDS[3:]), mode=pick(["vote", "average"], ["sum"]),
                votes=pick(["binary", "ternary"], [1]))


# ----------------------------------------------------------------------------- comparing


def _flat_tensors(obj):
    """Every distinct tensor object reachable in nested lists (deepcopy keeps the structure)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _flat_tensors(o)]
    return []


def _snapshot(obj):
    return [t.detach().clone() if t.device.type != "meta" else None for t in _flat_tensors(obj)]


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def _assert_unchanged(obj, snap):
    for t, s in zip(_flat_tensors(obj), snap):
        if s is not None:
            _same(t, s)


def _outcome(fn):
    try:
        return fn(), None
    except EXPECTED as e:
        return None, e


def _lion_formula(params, grads, exp_avgs, lr, betas, weight_decay, votes):
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


def _aliased(params, grads, exp_avgs):
    ts = [t for t in [*params, *grads, *exp_avgs] if isinstance(t, torch.Tensor)]
    ptrs = [t.untyped_storage().data_ptr() for t in ts if t.numel() > 0 and t.device.type != "meta"]
    return len(ptrs) != len(set(ptrs)) or any(
        0 in t.stride() and t.numel() > 1 for t in ts)


# ----------------------------------------------------------------------------- fused_dlion_step


@FUZZ
@given(st.data())
def test_fuzz_fused_dlion_step(data):
    valid = data.draw(st.booleans())
    inputs = _lists(data, valid)
    hyper = _hyper(data, valid)
    step = data.draw(st.sampled_from([None, 0, 5] + ([] if valid else [-1, 1.5, True])))
    ref_in = copy.deepcopy(inputs)  # keeps the aliasing structure (storages are memoized)
    snap = _snapshot(inputs)

    got, err = _outcome(lambda: dk.fused_dlion_step(*inputs, **hyper, step=step))
    ref, ref_err = _outcome(lambda: dk.fused_dlion_step(*ref_in, **hyper, step=step,
                                                        backend="torch"))
    assert type(err) is type(ref_err), (err, ref_err)
    hypothesis.event(f"outcome: {type(err).__name__ if err else 'ran'}")
    if err is not None:
        _assert_unchanged(inputs, snap)
        _assert_unchanged(ref_in, snap)
        return
    for a, b in zip(_flat_tensors(inputs), _flat_tensors(ref_in)):
        if a.device.type != "meta":
            if a.dtype == torch.float32:
                _same(a, b)
            else:
                assert_close_storage(a, b)
    params, grads, exp_avgs = ref_in
    if not _aliased(*ref_in) and all(t.device.type == "cpu" for t in params):
        p0, g0, m0 = copy.deepcopy(inputs), None, None  # noqa: F841
        sp, sg, sm = _split(snap, inputs)
        want_p, want_m = _lion_formula(sp, sg, sm, hyper["lr"], hyper["betas"],
                                       hyper["weight_decay"], hyper["votes"])
        for p, w in zip(params, want_p):
            assert_close_storage(p, w)
        for m, w in zip(exp_avgs, want_m):
            assert_close_storage(m, w)


def _split(snap, inputs):
    """The snapshot as (params, grads, exp_avgs) lists, None grads kept."""
    it = iter(snap)
    out = []
    for seq in inputs:
        out.append([None if t is None else next(it) for t in seq])
    return out


# ----------------------------------------------------------------------------- DistributedLion


@FUZZ
@given(st.data())
def test_fuzz_distributed_lion(data):
    """Constructor (lists, param groups with their own bad values, generators; wrong types and
    values) and one step; the same optimizer with backend="torch" on copies is the reference."""
    valid = data.draw(st.booleans())
    params, grads, _ = _lists(data, valid)
    if isinstance(params, torch.Tensor):
        params = [params]
    for p, g in zip(params, grads):
        if isinstance(p, torch.Tensor) and p.is_floating_point() and p.is_leaf:
            p.requires_grad_(True)
            if isinstance(g, torch.Tensor) and g.shape == p.shape and g.dtype == p.dtype and \
                    g.device == p.device:
                p.grad = g.detach().clone()
    hyper = _hyper(data, valid)
    mode, votes = hyper.pop("mode"), hyper.pop("votes")
    nonfinite = data.draw(st.sampled_from(["raise", "skip"] + ([] if valid else ["ignore"])))
    form = data.draw(st.sampled_from(["list", "groups", "generator"]))
    group_lr = data.draw(st.sampled_from([1e-3] + ([] if valid else [-1.0, math.nan, "x"])))
    ref_params = copy.deepcopy(params)

    def spec(ps):
        if form == "groups":
            return [{"params": ps[:1]}, {"params": ps[1:], "lr": group_lr}]
        return (p for p in ps) if form == "generator" else list(ps)

    def make(ps, **kw):
        return dk.DistributedLion(spec(ps), **hyper, mode=mode, votes=votes, nonfinite=nonfinite,
                                  **kw)

    snap = _snapshot(params)
    opt, err = _outcome(lambda: make(params))
    ref, ref_err = _outcome(lambda: make(ref_params, backend="torch"))
    assert type(err) is type(ref_err), (err, ref_err)
    if err is not None:
        _assert_unchanged(params, snap)
        return
    _, err = _outcome(opt.step)
    _, ref_err = _outcome(ref.step)
    assert type(err) is type(ref_err), (err, ref_err)
    hypothesis.event(f"outcome: {type(err).__name__ if err else 'ran'}")
    if err is not None:
        _assert_unchanged(params, snap)
        return
    for p, q in zip(params, ref_params):
        if isinstance(p, torch.Tensor) and p.device.type != "meta":
            assert_close_storage(p.detach(), q.detach())
            if opt.state.get(p):
                assert_close_storage(opt.state[p]["exp_avg"], ref.state[q]["exp_avg"])
                assert opt.state[p]["step"] == ref.state[q]["step"]  # 0 when skipped


# ----------------------------------------------------------------------------- load_state


def _small_opt():
    torch.manual_seed(0)
    params = [torch.randn(4, 3, requires_grad=True), torch.randn(9, requires_grad=True)]
    opt = dk.DistributedLion(params, lr=1e-2)
    for k in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(k))
        opt.step()
    return params, opt


@functools.lru_cache(maxsize=None)
def _saved():
    """One saved checkpoint (its files' bytes), made once for every example."""
    params, opt = _small_opt()
    with tempfile.TemporaryDirectory() as tmp:
        dk.save_state(opt, tmp)
        files = {name: open(os.path.join(tmp, name), "rb").read() for name in os.listdir(tmp)}
    return params, opt, files


@FUZZ
@given(st.data())
def test_fuzz_load_state(data):
    """Damaged checkpoints: random byte flips, truncation, appended bytes, manifest fields set to
    random JSON values. load_state loads exactly what was saved or raises CheckpointError
    (a ValueError) with the optimizer unchanged."""
    params, opt, files = _saved()
    with tempfile.TemporaryDirectory() as tmp:
        for name, raw in files.items():
            open(os.path.join(tmp, name), "wb").write(raw)
        manifest_path = os.path.join(tmp, "manifest.json")
        manifest = json.load(open(manifest_path))
        target = data.draw(st.sampled_from(["rank-file", "manifest-bytes", "manifest-field"]))
        path = manifest_path if target != "rank-file" else os.path.join(
            tmp, manifest["files"][0]["file"])
        if target == "manifest-field":
            key = data.draw(st.sampled_from(sorted(manifest)))
            value = data.draw(st.recursive(
                st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=5),
                lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3),
                                                                            inner, max_size=3),
                max_leaves=5))
            manifest[key] = value
            open(path, "w").write(json.dumps(manifest))
        else:
            raw = bytearray(open(path, "rb").read())
            how = data.draw(st.sampled_from(["flip", "truncate", "append"]))
            pos = data.draw(st.integers(0, len(raw) - 1))
            if how == "flip":
                raw[pos] ^= 1 << data.draw(st.integers(0, 7))
            elif how == "truncate":
                raw = raw[:pos]
            else:
                raw += b"\x00"
            open(path, "wb").write(bytes(raw))

        fresh_params = [p.detach().clone().requires_grad_(True) for p in params]
        fresh = dk.DistributedLion(fresh_params, lr=0.5)
        before = copy.deepcopy(fresh.state_dict())
        try:
            dk.load_state(fresh, tmp)
        except ValueError as e:
            assert isinstance(e, dk.CheckpointError)
            after = fresh.state_dict()
            assert after["param_groups"] == before["param_groups"] and not after["state"]
            return
    # Loaded: exactly what was saved.
    for p, q in zip(params, fresh_params):
        _same(fresh.state[q]["exp_avg"], opt.state[p]["exp_avg"])
        assert fresh.state[q]["step"] == opt.state[p]["step"]
    assert fresh.param_groups[0]["lr"] == 1e-2
