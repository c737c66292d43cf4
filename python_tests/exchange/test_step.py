"""fused_dlion_step in one process: equivalence with Lion, every backend end to end, bad input."""

import copy

import fuzzing as fz
import hypothesis
import pytest
import torch
from conftest import DTYPES, RTOL, assert_close_storage, backend_device, fast_backends
from hypothesis import given
from hypothesis import strategies as st

import dlion_kernels as dk
from dlion_kernels.kernels.backends import BackendUnavailable

MODES = [(m, v) for m in ("vote", "average") for v in ("binary", "ternary")]


def _state(sizes, dtype, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen).to(dtype).to(device) for s in sizes]
    moms = [torch.zeros(s, device=device) for s in sizes]
    return params, moms


def _grads(sizes, dtype, gen, device="cpu"):
    return [torch.randn(s, generator=gen).to(dtype).to(device) for s in sizes]


@pytest.mark.parametrize("dtype", [torch.float32], ids=str)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_one_rank_ternary_vote_is_lion_trajectory(dtype, weight_decay):
    """n = 1, vote/ternary is plain Lion: same trajectory as lion_pytorch.Lion over 50 steps."""
    lion_pytorch = pytest.importorskip("lion_pytorch")
    sizes = [(31,), (33, 7), (4097,)]
    params, moms = _state(sizes, dtype, 0)
    theirs = [torch.nn.Parameter(p.clone()) for p in params]
    opt = lion_pytorch.Lion(theirs, lr=1e-3, betas=(0.9, 0.99), weight_decay=weight_decay)
    gen = torch.Generator().manual_seed(1)
    for _ in range(50):
        grads = _grads(sizes, dtype, gen)
        for p, g in zip(theirs, grads):
            p.grad = g.clone()
        opt.step()
        dk.fused_dlion_step(params, grads, moms, lr=1e-3, weight_decay=weight_decay,
                            votes="ternary", mode="vote", backend="torch")
    for ours, p in zip(params, theirs):
        # Same votes every step; only the order of the weight-decay rounding differs, by at
        # most one fp32 rounding per step.
        torch.testing.assert_close(ours, p.detach(), rtol=50 * 2**-23, atol=1e-7)
    for ours, p in zip(moms, theirs):
        torch.testing.assert_close(ours, opt.state[p]["exp_avg"], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_one_rank_ternary_vote_is_lion_each_step_half(dtype):
    """bf16/fp16 storage: each step equals Lion done in fp32 and rounded once to the dtype."""
    lion_pytorch = pytest.importorskip("lion_pytorch")
    sizes = [(31,), (33, 7), (4097,)]
    params, moms = _state(sizes, dtype, 2)
    gen = torch.Generator().manual_seed(3)
    for _ in range(50):
        grads = _grads(sizes, dtype, gen)
        theirs = [torch.nn.Parameter(p.float()) for p in params]
        opt = lion_pytorch.Lion(theirs, lr=1e-2, betas=(0.9, 0.99))
        for p, g, m in zip(theirs, grads, moms):
            p.grad = g.float()
            opt.state[p]["exp_avg"] = m.clone()
        opt.step()
        dk.fused_dlion_step(params, grads, moms, lr=1e-2, votes="ternary", backend="torch")
        for ours, p in zip(params, theirs):
            assert_close_storage(ours, p.detach().to(dtype))


@pytest.mark.parametrize("backend", fast_backends())
@pytest.mark.parametrize("mode,votes", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backend_matches_reference_over_many_steps(backend, mode, votes, dtype):
    """Whole steps on a list of odd sizes: the backend tracks the torch reference step by step."""
    device = backend_device(backend)
    sizes = [(1,), (31,), (33, 3), (4097,), (2, 16)]
    ref_p, ref_m = _state(sizes, dtype, 5)
    p, m = [t.to(device) for t in ref_p], [t.to(device) for t in ref_m]
    gen = torch.Generator().manual_seed(6)
    for step in range(20):
        grads = _grads(sizes, dtype, gen)
        grads[1] = None if step % 3 == 0 else grads[1]
        kw = dict(lr=1e-2, weight_decay=0.05, mode=mode, votes=votes, step=step)
        dk.fused_dlion_step(ref_p, grads, ref_m, backend="torch", **kw)
        dev_grads = [None if g is None else g.to(device) for g in grads]
        stats = dk.fused_dlion_step(p, dev_grads, m, backend=backend, **kw)
        assert stats.backend == backend
        for a, e in zip(m, ref_m):
            assert torch.equal(a.cpu(), e)
        for a, e in zip(p, ref_p):
            assert_close_storage(a, e)
            a.copy_(e)  # keep the comparison one rounding deep, not a drifting trajectory


def test_mixed_dtypes_and_non_contiguous():
    """A list mixing dtypes and non-contiguous views equals the same step on contiguous copies."""
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(40, 66, generator=gen)
    params = [base[:, ::2], torch.randn(33, generator=gen).bfloat16(), torch.randn(5, 7).t()]
    grads = [torch.randn(p.shape, generator=gen).to(p.dtype) for p in params]
    grads[2] = grads[2].t().contiguous().t()  # non-contiguous gradient too
    moms = [torch.randn(p.shape, generator=gen) for p in params]
    copies = [p.contiguous().clone() for p in params]
    mom_copies = [m.clone() for m in moms]
    dk.fused_dlion_step(params, grads, moms, lr=0.1, weight_decay=0.1, backend="torch")
    dk.fused_dlion_step(copies, [g.contiguous() for g in grads], mom_copies, lr=0.1,
                        weight_decay=0.1, backend="torch")
    for a, e in zip(params + moms, copies + mom_copies):
        assert torch.equal(a, e)
    assert not torch.equal(base[:, 1::2], torch.zeros(40, 33))  # untouched columns stay


def test_stats_single_process():
    params, moms = _state([(10,), (3, 3)], torch.float32, 0)
    stats = dk.fused_dlion_step(params, [None, None], moms, lr=0.1, backend="torch")
    assert (stats.bytes_sent, stats.bytes_received, stats.numel, stats.world_size) == (0, 0, 19, 1)
    assert (stats.mode, stats.votes, stats.backend, stats.skipped) == ("vote", "binary", "torch",
                                                                       False)


def test_env_override(monkeypatch):
    params, moms = _state([(10,)], torch.float32, 0)
    monkeypatch.setenv("DLION_BACKEND", "torch")
    assert dk.fused_dlion_step(params, [None], moms, lr=0.1).backend == "torch"
    monkeypatch.setenv("DLION_BACKEND", "fortran")
    with pytest.raises(ValueError, match="backend"):
        dk.fused_dlion_step(params, [None], moms, lr=0.1)


def test_auto_backend_is_best_available():
    params, moms = _state([(10,)], torch.float32, 0)
    stats = dk.fused_dlion_step(params, [None], moms, lr=0.1)
    assert stats.backend == dk.available_backends("cpu")[0]
    assert "torch" in dk.available_backends("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_unavailable_backend_says_why():
    params, moms = _state([(10,)], torch.float32, 0)
    with pytest.raises(BackendUnavailable, match="cuda"):
        dk.fused_dlion_step(params, [None], moms, lr=0.1, backend="cuda")


def _bad_inputs():
    p, m, g = torch.randn(33), torch.zeros(33), torch.randn(33)
    ok = dict(lr=0.1)
    yield "lengths", ([p, p.clone()], [g], [m, m.clone()]), ok, ValueError, "equal lengths"
    yield "shape", ([p], [torch.randn(32)], [m]), ok, ValueError, "shape"
    yield "mom shape", ([p], [g], [torch.zeros(3, 11)]), ok, ValueError, "shape"
    yield "device", ([p], [torch.randn(33, device="meta")], [m]), ok, ValueError, "device"
    yield "int param", ([torch.arange(33)], [g], [m]), ok, TypeError, "dtype"
    yield "int grad", ([p], [torch.arange(33)], [m]), ok, TypeError, "dtype"
    yield "bf16 mom", ([p], [g], [m.bfloat16()]), ok, TypeError, "float32"
    yield "fp64 param", ([p.double()], [g.double()], [m]), ok, TypeError, "dtype"
    yield "sparse grad", ([p], [g.to_sparse()], [m]), ok, TypeError, "dense"
    yield "not a list", (p, [g], [m]), ok, TypeError, "list"
    yield "not a tensor", ([p], [g.tolist()], [m]), ok, TypeError, "Tensor"
    yield "alias", ([p], [g], [p]), ok, ValueError, "alias"
    yield "lr < 0", ([p], [g], [m]), dict(lr=-1.0), ValueError, "lr"
    yield "lr nan", ([p], [g], [m]), dict(lr=float("nan")), ValueError, "lr"
    yield "lr str", ([p], [g], [m]), dict(lr="0.1"), ValueError, "lr"
    yield "beta = 1", ([p], [g], [m]), dict(lr=0.1, betas=(1.0, 0.99)), ValueError, "betas"
    yield "beta < 0", ([p], [g], [m]), dict(lr=0.1, betas=(0.9, -0.1)), ValueError, "betas"
    yield "3 betas", ([p], [g], [m]), dict(lr=0.1, betas=(0.9, 0.9, 0.9)), ValueError, "betas"
    yield "wd < 0", ([p], [g], [m]), dict(lr=0.1, weight_decay=-1), ValueError, "weight_decay"
    yield "mode", ([p], [g], [m]), dict(lr=0.1, mode="sum"), ValueError, "mode"
    yield "votes", ([p], [g], [m]), dict(lr=0.1, votes="unary"), ValueError, "votes"
    yield "backend", ([p], [g], [m]), dict(lr=0.1, backend="fortran"), ValueError, "backend"
    yield "step", ([p], [g], [m]), dict(lr=0.1, step=-1), ValueError, "step"
    yield "nonfinite", ([p], [g], [m]), dict(lr=0.1, nonfinite="zero"), ValueError, "nonfinite"


@pytest.mark.parametrize("name,lists,kwargs,error,match", list(_bad_inputs()),
                         ids=[c[0] for c in _bad_inputs()])
def test_bad_input_raises_and_changes_nothing(name, lists, kwargs, error, match):
    tensors = [t for seq in lists if isinstance(seq, (list, tuple)) for t in seq
               if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type
               == "cpu"]
    before = [t.clone() for t in tensors]
    with pytest.raises(error, match=match):
        dk.fused_dlion_step(*lists, **{"backend": "torch", **kwargs})
    for t, b in zip(tensors, before):
        assert torch.equal(t, b), "a rejected call modified a tensor"


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), -float("inf")])
def test_nonfinite_gradient_raises_or_skips_and_changes_nothing(bad):
    params, moms = _state([(40,), (7,)], torch.float32, 0)
    grads = [torch.randn(40), torch.randn(7)]
    grads[1][3] = bad
    before = [t.clone() for t in params + moms]
    with pytest.raises(dk.NonFiniteGradientError, match="inf or NaN"):
        dk.fused_dlion_step(params, grads, moms, lr=0.1, backend="torch")
    stats = dk.fused_dlion_step(params, grads, moms, lr=0.1, backend="torch", nonfinite="skip")
    assert stats.skipped and stats.bytes_sent == 0
    for t, b in zip(params + moms, before):
        assert torch.equal(t, b)


def test_empty_tensors_and_lists():
    stats = dk.fused_dlion_step([], [], [], lr=0.1, backend="torch")
    assert stats.numel == 0
    p, m = [torch.randn(0), torch.randn(5)], [torch.zeros(0), torch.zeros(5)]
    dk.fused_dlion_step(p, [torch.randn(0), torch.randn(5)], m, lr=0.1, backend="torch")
    assert RTOL  # the tolerance table is shared with the kernel tests


# ----------------------------------------------------------------------------- fused_dlion_step


@fz.FUZZ
@given(st.data())
def test_fuzz_fused_dlion_step(data):
    valid = data.draw(st.booleans())
    inputs = fz.tensor_lists(data, valid)
    hyper = fz.hyperparameters(data, valid)
    step = data.draw(st.sampled_from([None, 0, 5] + ([] if valid else [-1, 1.5, True])))
    ref_in = copy.deepcopy(inputs)  # keeps the aliasing structure (storages are memoized)
    snap = fz.snapshot(inputs)

    got, err = fz.outcome(lambda: dk.fused_dlion_step(*inputs, **hyper, step=step))
    ref, ref_err = fz.outcome(lambda: dk.fused_dlion_step(*ref_in, **hyper, step=step,
                                                        backend="torch"))
    assert type(err) is type(ref_err), (err, ref_err)
    hypothesis.event(f"outcome: {type(err).__name__ if err else 'ran'}")
    if err is not None:
        fz.assert_unchanged(inputs, snap)
        fz.assert_unchanged(ref_in, snap)
        return
    for a, b in zip(fz.flat_tensors(inputs), fz.flat_tensors(ref_in)):
        if a.device.type != "meta":
            if a.dtype == torch.float32:
                fz.same(a, b)
            else:
                assert_close_storage(a, b)
    params, grads, exp_avgs = ref_in
    if not fz.aliased(*ref_in) and all(t.device.type == "cpu" for t in params):
        sp, sg, sm = fz.split_snapshot(snap, inputs)
        want_p, want_m = fz.lion_formula(sp, sg, sm, hyper["lr"], hyper["betas"],
                                       hyper["weight_decay"], hyper["votes"])
        for p, w in zip(params, want_p):
            assert_close_storage(p, w)
        for m, w in zip(exp_avgs, want_m):
            assert_close_storage(m, w)
