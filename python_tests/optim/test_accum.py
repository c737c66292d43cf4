"""dk.AccumAdamW / dk.AccumLion as torch optimizers: K = 1 equivalences, Decent-DP's own
AccumAdamW, per-parameter step counts, exact resume, errors."""

import copy

import pytest
import torch

import dlion_kernels as dk

BACKENDS = ["torch", "cpu"]


def _model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(13, 31), torch.nn.Tanh(), torch.nn.Linear(31, 5)
    ).to(dtype)


def _train(model, opt, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 13, generator=gen).to(next(model.parameters()).dtype)
        y = torch.randn(16, 5, generator=gen).to(x.dtype)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _assert_params_close(a, b, rtol, atol):
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p.float(), q.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_accum_adamw_k1_is_torch_adamw(backend):
    m1, m2 = _model(), _model()
    _train(m1, dk.AccumAdamW(m1.parameters(), lr=1e-2, weight_decay=0.1, accum_steps=1,
                             backend=backend), 30)
    _train(m2, torch.optim.AdamW(m2.parameters(), lr=1e-2, weight_decay=0.1), 30)
    _assert_params_close(m1, m2, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_accum_lion_k1_is_lion(backend):
    lion_pytorch = pytest.importorskip("lion_pytorch")
    m1, m2 = _model(), _model()
    _train(m1, dk.AccumLion(m1.parameters(), lr=1e-3, weight_decay=0.1, accum_steps=1,
                            backend=backend), 30)
    _train(m2, lion_pytorch.Lion(m2.parameters(), lr=1e-3, weight_decay=0.1), 30)
    # Lion's steps are +-lr: a sign that flips on a rounding-level tie would show as 2 lr.
    _assert_params_close(m1, m2, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("K", [1, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_accum_adamw_equals_decent_dp(K, backend):
    """Decent-DP's own AccumAdamW (PyPI decent-dp, _foreach ops) over 50 steps."""
    decent_optim = pytest.importorskip("decent_dp.optim")
    m1, m2 = _model(), _model()
    _train(m1, dk.AccumAdamW(m1.parameters(), lr=1e-2, weight_decay=0.05, accum_steps=K,
                             backend=backend), 50)
    _train(m2, decent_optim.AccumAdamW(m2.parameters(), lr=1e-2, weight_decay=0.05,
                                       accum_iter=K), 50)
    _assert_params_close(m1, m2, rtol=1e-5, atol=1e-6)


def _lion_accum_oracle(params, grads_per_step, lr, b1, b2, wd, K):
    """AccumLion's rule written out with plain tensor ops (fp64)."""
    xs = [p.detach().double().clone() for p in params]
    ms = [torch.zeros_like(x) for x in xs]
    accs = [torch.zeros_like(x) for x in xs]
    for t, grads in enumerate(grads_per_step, start=1):
        for x, m, a, g in zip(xs, ms, accs, grads):
            g = g.double()
            c = b1 * m + (1 - b1) * g
            x -= lr * (torch.sign(c) + wd * x)
            a += g / K
            if t % K == 0:
                m.mul_(b2).add_((1 - b2) * a)
                a.zero_()
    return xs


@pytest.mark.parametrize("backend", BACKENDS)
def test_accum_lion_k4_matches_equations(backend):
    gen = torch.Generator().manual_seed(3)
    params = [torch.randn(33, generator=gen), torch.randn(4097, generator=gen)]
    grads = [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(12)]
    expected = _lion_accum_oracle(params, grads, 1e-2, 0.9, 0.99, 0.1, 4)
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = dk.AccumLion(ps, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, accum_steps=4,
                       backend=backend)
    for gs in grads:
        for p, g in zip(ps, gs):
            p.grad = g.clone()
        opt.step()
    for p, e in zip(ps, expected):
        torch.testing.assert_close(p.detach().double(), e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cls", [dk.AccumAdamW, dk.AccumLion])
def test_none_grad_is_skipped_and_count_does_not_advance(cls):
    a, b = torch.nn.Parameter(torch.randn(31)), torch.nn.Parameter(torch.randn(33))
    opt = cls([a, b], lr=1e-2, accum_steps=2)
    b0 = b.detach().clone()
    for _ in range(3):
        a.grad, b.grad = torch.randn(31), None
        opt.step()
    assert torch.equal(b.detach(), b0) and len(opt.state[b]) == 0
    assert opt.state[a]["step"] == 3
    b.grad = torch.randn(33)
    opt.step()
    assert opt.state[a]["step"] == 4 and opt.state[b]["step"] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cls", [dk.AccumAdamW, dk.AccumLion])
def test_state_dict_resume_is_exact(cls, dtype):
    """Stop after 5 steps (mid-accumulation), reload into a fresh model and optimizer: the next
    6 steps match an uninterrupted run bit for bit; the fp32 state stays fp32."""
    ref = _model(dtype=dtype)
    opt_ref = cls([{"params": ref[0].parameters()},
                   {"params": ref[2].parameters(), "lr": 3e-3}], lr=1e-2, accum_steps=3)
    _train(ref, opt_ref, 5)
    sd = copy.deepcopy(opt_ref.state_dict())
    model_sd = copy.deepcopy(ref.state_dict())
    _train(ref, opt_ref, 6, seed=2)

    resumed = _model(seed=9, dtype=dtype)
    resumed.load_state_dict(model_sd)
    opt = cls([{"params": resumed[0].parameters()},
               {"params": resumed[2].parameters(), "lr": 3e-3}], lr=1e-2, accum_steps=3)
    opt.load_state_dict(sd)
    for st in opt.state.values():
        assert st["exp_avg"].dtype == torch.float32 and st["accum"].dtype == torch.float32
    _train(resumed, opt, 6, seed=2)
    for p, q in zip(ref.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"lr": -1.0}, "lr"),
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"accum_steps": 0}, "accum_steps"),
        ({"accum_steps": 2.5}, "accum_steps"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"backend": "tpu"}, "backend"),
    ],
)
@pytest.mark.parametrize("cls", [dk.AccumAdamW, dk.AccumLion])
def test_bad_hyperparameters(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls([torch.nn.Parameter(torch.zeros(3))], **kwargs)


def test_integer_params_rejected():
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        dk.AccumAdamW([torch.zeros(3, dtype=torch.float64, requires_grad=True)])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cls", [dk.AccumAdamW, dk.AccumLion])
def test_step_with_sources_is_copy_then_step(cls, dtype, backend):
    """step(sources={p: y}) (the decentralized wrapper's fused mixing) equals p.copy_(y) then
    step() bit for bit over 6 steps, with a StepLR scheduler (no order warning: the scheduler
    sees an ordinary step); y is not modified; a parameter without a gradient ignores its
    source and is not touched."""
    import warnings

    fused, plain = _model(dtype=dtype), _model(dtype=dtype)
    idle = [torch.nn.Parameter(torch.randn(7).to(dtype)) for _ in range(2)]
    idle[1].data.copy_(idle[0].detach())
    opts = [cls([*m.parameters(), q], lr=1e-2, weight_decay=0.05, accum_steps=2, backend=backend)
            for m, q in ((fused, idle[0]), (plain, idle[1]))]
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in opts]
    gen = torch.Generator().manual_seed(3)
    idle0 = idle[0].detach().clone()
    for _ in range(6):
        x = torch.randn(16, 13, generator=gen).to(dtype)
        y = torch.randn(16, 5, generator=gen).to(dtype)
        numel = sum(p.numel() for p in fused.parameters()) + 7
        recv = torch.randn(numel, generator=gen).to(dtype)
        recv0, views, offset = recv.clone(), [], 0
        for p in [*fused.parameters(), idle[0]]:
            views.append(recv[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        for m, opt in zip((fused, plain), opts):
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
        for p, v in zip(plain.parameters(), views):
            with torch.no_grad():
                p.copy_(v)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            opts[0].step(sources=dict(zip([*fused.parameters(), idle[0]], views)))
            opts[1].step()
            for s in scheds:
                s.step()
        assert torch.equal(recv, recv0)
        for p, q in zip(fused.parameters(), plain.parameters()):
            assert torch.equal(p, q)
    assert torch.equal(idle[0].detach(), idle0) and len(opts[0].state[idle[0]]) == 0
    assert opts[0].param_groups[0]["lr"] == opts[1].param_groups[0]["lr"] < 1e-2


@pytest.mark.parametrize("cls", [dk.AccumAdamW, dk.AccumLion])
def test_bad_sources_modify_nothing(cls):
    a, b = torch.nn.Parameter(torch.randn(31)), torch.nn.Parameter(torch.randn(33))
    opt = cls([a, b], lr=1e-2, accum_steps=2)
    a.grad, b.grad = torch.randn(31), torch.randn(33)
    opt.step()
    a0, b0 = a.detach().clone(), b.detach().clone()
    state0 = copy.deepcopy(opt.state_dict())
    stranger = torch.nn.Parameter(torch.randn(31))
    cases = [
        (TypeError, [torch.randn(31)], "mapping"),
        (ValueError, {stranger: torch.randn(31)}, "not a parameter"),
        (TypeError, {a: torch.randn(31, dtype=torch.float64)}, "sources"),
        (ValueError, {a: b.detach()[:31]}, "overlaps"),  # b is written by the same step
        (ValueError, {a: opt.state[b]["exp_avg"][:31]}, "overlaps"),
    ]
    for error, sources, match in cases:
        with pytest.raises(error, match=match):
            opt.step(sources=sources)
        assert torch.equal(a.detach(), a0) and torch.equal(b.detach(), b0)
        sd = opt.state_dict()
        for i in (0, 1):
            assert sd["state"][i]["step"] == state0["state"][i]["step"]
            assert torch.equal(sd["state"][i]["exp_avg"], state0["state"][i]["exp_avg"])
