"""AccumAdamW / AccumLion kernels (kernels/accum.py): every backend against the fp32 reference."""

import pytest
import torch
from conftest import DTYPES, backend_device, fast_backends

from dlion_kernels.kernels import accum

SIZES = [1, 31, 33, 4097]


def _run(kind, backend, dtype, K, steps, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(s, generator=gen).to(dtype).to(device) for s in SIZES]
    states = [[torch.zeros(s, device=device) for s in SIZES] for _ in range(3)]
    history = []
    for t in range(1, steps + 1):
        # gradients of varying scale so that v spans magnitudes; a zero gradient entry too
        gs = [(torch.randn(s, generator=gen) * 10.0 ** (t % 3 - 1)).to(dtype).to(device)
              for s in SIZES]
        gs[2][0] = 0.0
        if kind == "adamw":
            accum.adamw(xs, gs, states[0], states[1], states[2], lr=3e-2, beta1=0.9, beta2=0.999,
                        eps=1e-8, weight_decay=0.1, accum_steps=K, step=t, backend=backend)
        else:
            accum.lion(xs, gs, states[0], states[1], lr=3e-2, beta1=0.9, beta2=0.99,
                       weight_decay=0.1, accum_steps=K, step=t, backend=backend)
        history.append(([x.cpu().clone() for x in xs],
                        [[s.cpu().clone() for s in st] for st in states]))
    return history


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
    for t, ((xe, se), (xa, sa)) in enumerate(zip(expected, actual)):
        for i, (a, e) in enumerate(zip(xa, xe)):
            assert torch.equal(a, e), f"step {t + 1}, params[{i}] (size {SIZES[i]})"
        for name, A, E in zip(("accum", "exp_avg", "exp_avg_sq"), sa, se):
            for i, (a, e) in enumerate(zip(A, E)):
                assert torch.equal(a, e), f"step {t + 1}, {name}[{i}] (size {SIZES[i]})"


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
    kw = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "accum_steps": 2, "step": 1}
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
