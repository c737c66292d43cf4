"""AccumAdamW / AccumLion kernels (kernels/accum.py): every backend against the fp32 reference,
with and without ``sources`` (x read from another buffer: the decentralized fused mixing)."""

import sys

import pytest
import torch
from conftest import DTYPES, backend_device, fast_backends

from dlion_kernels.kernels import accum

SIZES = [1, 31, 33, 4097]


def _run(kind, backend, dtype, K, steps, device, seed=0, mixing=None):
    """``mixing``: None (in-place steps); "sources": every step reads x from fresh values in
    views at odd offsets of one flat buffer (as the decentralized wrapper's received gossip),
    checked unmodified; "copy": the same values copied into the params first, then an in-place
    step (the unfused path); "alias": sources are other view objects of the params themselves."""
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(s, generator=gen).to(dtype).to(device) for s in SIZES]
    states = [[torch.zeros(s, device=device) for s in SIZES] for _ in range(3)]
    history = []
    for t in range(1, steps + 1):
        # gradients of varying scale so that v spans magnitudes; a zero gradient entry too
        gs = [(torch.randn(s, generator=gen) * 10.0 ** (t % 3 - 1)).to(dtype).to(device)
              for s in SIZES]
        gs[2][0] = 0.0
        sources = None
        if mixing in ("sources", "copy"):
            # an odd start (1 element in) so that the views are unaligned, as bucket views are
            flat = torch.randn(1 + sum(SIZES), generator=gen).to(dtype).to(device)
            offsets = [1 + sum(SIZES[:i]) for i in range(len(SIZES))]
            ys = [flat[o : o + s] for o, s in zip(offsets, SIZES)]
            if mixing == "copy":
                for x, y in zip(xs, ys):
                    x.copy_(y)
            else:
                sources, flat0 = ys, flat.clone()
        elif mixing == "alias":
            sources = [x.view_as(x) for x in xs]
        if kind == "adamw":
            accum.adamw(xs, gs, states[0], states[1], states[2], lr=3e-2, beta1=0.9, beta2=0.999,
                        eps=1e-8, weight_decay=0.1, accum_steps=K, step=t, sources=sources,
                        backend=backend)
        else:
            accum.lion(xs, gs, states[0], states[1], lr=3e-2, beta1=0.9, beta2=0.99,
                       weight_decay=0.1, accum_steps=K, step=t, sources=sources, backend=backend)
        if mixing == "sources":
            assert torch.equal(flat, flat0), f"step {t}: a source was modified"
        history.append(([x.cpu().clone() for x in xs],
                        [[s.cpu().clone() for s in st] for st in states]))
    return history


def _assert_same(actual, expected):
    for t, ((xe, se), (xa, sa)) in enumerate(zip(expected, actual)):
        for i, (a, e) in enumerate(zip(xa, xe)):
            assert torch.equal(a, e), f"step {t + 1}, params[{i}] (size {SIZES[i]})"
        for name, A, E in zip(("accum", "exp_avg", "exp_avg_sq"), sa, se):
            for i, (a, e) in enumerate(zip(A, E)):
                assert torch.equal(a, e), f"step {t + 1}, {name}[{i}] (size {SIZES[i]})"


@pytest.mark.parametrize("backend", fast_backends())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("K", [1, 4])
@pytest.mark.parametrize("kind", ["adamw", "lion"])
def test_backend_matches_reference(backend, dtype, K, kind):
    """Same inputs, 9 steps (flush and non-flush steps): parameters and every state tensor equal
    the reference's bit for bit (same fp32 operations in the same order, one rounding each)."""
    device = backend_device(backend)
    expected = _run(kind, "torch", dtype, K, 9, torch.device("cpu"))
    actual = _run(kind, backend, dtype, K, 9, device)
    _assert_same(actual, expected)


@pytest.mark.parametrize("backend", fast_backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["adamw", "lion"])
def test_whole_chunks_match_reference(backend, dtype, kind, monkeypatch):
    """Tensors of whole chunks (2048 elements: the interpreter's chunk for these sizes, so the
    unmasked vector path runs there too) beside a tail, aligned and (sources: views at an odd
    offset) unaligned, K = 4 over a flush: bit for bit the reference."""
    monkeypatch.setattr(sys.modules[__name__], "SIZES", [2048, 31, 2048])
    device = backend_device(backend)
    _assert_same(_run(kind, backend, dtype, 4, 4, device),
                 _run(kind, "torch", dtype, 4, 4, torch.device("cpu")))
    _assert_same(_run(kind, backend, dtype, 4, 4, device, mixing="sources"),
                 _run(kind, "torch", dtype, 4, 4, torch.device("cpu"), mixing="copy"))


@pytest.mark.parametrize("backend", [*fast_backends(), "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("K", [1, 4])
@pytest.mark.parametrize("kind", ["adamw", "lion"])
def test_sources_match_copy_then_step(backend, dtype, K, kind):
    """x read from sources (unaligned views into one flat buffer, fresh values every step) and
    written to the params equals the reference's copy-then-step bit for bit, over 5 steps
    (K = 4: accumulate, flush at 4, accumulate again); the sources are not modified. Sources
    that are the params (other view objects of them) are the plain in-place step."""
    device = backend_device(backend) if backend != "torch" else torch.device("cpu")
    expected = _run(kind, "torch", dtype, K, 5, torch.device("cpu"), mixing="copy")
    _assert_same(_run(kind, backend, dtype, K, 5, device, mixing="sources"), expected)
    # the copies really changed x: without them the run differs
    assert not torch.equal(expected[-1][0][3], _run(kind, "torch", dtype, K, 5,
                                                    torch.device("cpu"))[-1][0][3])
    plain = _run(kind, "torch", dtype, K, 2, torch.device("cpu"))
    _assert_same(_run(kind, backend, dtype, K, 2, device, mixing="alias"), plain)


def test_bad_sources_modify_nothing():
    """A source of another dtype or shape, one overlapping a written tensor (another param, a
    moment), a wrong count: TypeError / ValueError naming sources, nothing modified."""
    xs = [torch.randn(31), torch.randn(33)]
    ms = [torch.zeros(31), torch.zeros(33)]
    x0 = [x.clone() for x in xs]
    kw = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.0, "accum_steps": 2, "step": 1}
    flat = torch.randn(64)
    bad = [
        (TypeError, [torch.randn(31, dtype=torch.float64), None]),
        (TypeError, [torch.randn(30), None]),
        (ValueError, [None, torch.randn(33, 2)[:, 0]]),
        (ValueError, [xs[1][:31], None]),           # overlaps params[1], which the step writes
        (ValueError, [ms[0], None]),                # overlaps exp_avgs[0]
        (ValueError, [flat[:31], flat[30:63]]),     # fine apart from each other ...
        (ValueError, [flat[:31]]),                  # ... but a wrong count
    ]
    for i, (error, sources) in enumerate(bad):
        if i == 5:
            # two sources overlapping each other are allowed (both are only read)
            accum.lion([x.clone() for x in xs], [torch.randn(31), torch.randn(33)],
                       [torch.zeros(31), torch.zeros(33)], [torch.zeros(31), torch.zeros(33)],
                       sources=sources, **kw)
            continue
        with pytest.raises(error, match="sources"):
            accum.lion(xs, [torch.randn(31), torch.randn(33)], [torch.zeros(31), torch.zeros(33)],
                       ms, sources=sources, **kw)
        for x, x_0 in zip(xs, x0):
            assert torch.equal(x, x_0)
        assert all(not m.any() for m in ms)


def test_reference_k1_never_touches_accumulator():
    """K = 1: a = g / 1 = g is read back at once, so the kernels neither read nor write a."""
    xs, gs = [torch.randn(33)], [torch.randn(33)]
    a = [torch.full((33,), 7.0)]
    accum.adamw(xs, gs, a, [torch.zeros(33)], [torch.zeros(33)], lr=1e-3, beta1=0.9, beta2=0.999,
                eps=1e-8, weight_decay=0.0, accum_steps=1, step=1, backend="cpu")
    assert torch.equal(a[0], torch.full((33,), 7.0))


@pytest.mark.parametrize(
    "change, match",
    [
        ({"lr": -1.0}, "lr"),
        ({"beta1": 1.0}, "beta1"),
        ({"accum_steps": 0}, "accum_steps"),
        ({"step": 0}, "step"),
    ],
)
def test_bad_arguments_modify_nothing(change, match):
    x = torch.randn(31)
    x0 = x.clone()
    kw = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0,
          "accum_steps": 2, "step": 1}
    kw.update(change)
    with pytest.raises(ValueError, match=match):
        accum.adamw([x], [torch.randn(31)], [torch.zeros(31)], [torch.zeros(31)],
                    [torch.zeros(31)], **kw)
    assert torch.equal(x, x0)


def test_bad_lists_modify_nothing():
    x = torch.randn(31)
    x0 = x.clone()
    kw = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.0, "accum_steps": 2, "step": 1}
    with pytest.raises(TypeError, match="grads"):
        accum.lion([x], [torch.randn(31, dtype=torch.float64)], [torch.zeros(31)],
                   [torch.zeros(31)], **kw)
    with pytest.raises(ValueError, match="exp_avgs"):
        accum.lion([x], [torch.randn(31)], [torch.zeros(31)], [], **kw)
    with pytest.raises(TypeError, match="accs"):
        accum.lion([x], [torch.randn(31)], [torch.zeros(31, dtype=torch.bfloat16)],
                   [torch.zeros(31)], **kw)
    assert torch.equal(x, x0)
