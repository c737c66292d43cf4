"""DistributedLion as a torch.optim.Optimizer, in one process and on real gloo ranks."""

import contextlib
import copy
import math

import fuzzing as fz
import hypothesis
import pytest
import torch
import torch.distributed as dist
from conftest import assert_close_storage
from hypothesis import given
from hypothesis import strategies as st
from workers import run_workers

import dlion_kernels as dk


def _model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(13, 31), torch.nn.Tanh(),
                               torch.nn.Linear(31, 3)).to(dtype)


def _batch(rank, step, dtype=torch.float32):
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 13, generator=gen).to(dtype), torch.randint(0, 3, (8,), generator=gen)


def _train(model, opt, steps, rank=0, start=0, scheduler=None):
    for step in range(start, start + steps):
        x, y = _batch(rank, step, next(model.parameters()).dtype)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x).float(), y).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


def _groups(model, **kw):
    return [
        {"params": model[0].parameters(), "lr": 3e-3, "weight_decay": 0.1},
        {"params": model[2].parameters(), "lr": 1e-3, "betas": (0.95, 0.98)},
    ]


def test_param_groups_equal_per_group_steps():
    """Groups with their own hyper-parameters: same result as fused_dlion_step per group."""
    model, twin = _model(), _model()
    opt = dk.DistributedLion(_groups(model), lr=1e-2, backend="torch")
    moms = [torch.zeros_like(p) for p in twin.parameters()]
    for step in range(5):
        x, y = _batch(0, step)
        for m in (model, twin):
            m.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
        p0, p2 = list(twin[0].parameters()), list(twin[2].parameters())
        dk.fused_dlion_step(p0, [p.grad for p in p0], moms[:2], lr=3e-3, weight_decay=0.1,
                            backend="torch", step=step)
        dk.fused_dlion_step(p2, [p.grad for p in p2], moms[2:], lr=1e-3, betas=(0.95, 0.98),
                            backend="torch", step=step)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    assert opt.last_stats.numel == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_state_dict_resume_is_exact(dtype):
    model = _model(dtype)
    opt = dk.DistributedLion(_groups(model), backend="torch")
    _train(model, opt, 4)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = copy.deepcopy(opt.state_dict())  # as a checkpoint on disk would be
    _train(model, opt, 4, start=4)

    resumed = _model(dtype, seed=1)
    resumed.load_state_dict(saved_model)
    opt2 = dk.DistributedLion(_groups(resumed), backend="torch")
    opt2.load_state_dict(saved_opt)
    assert all(s["exp_avg"].dtype == torch.float32 for s in opt2.state.values())
    _train(resumed, opt2, 4, start=4)
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_lr_scheduler_and_zero_grad():
    model = _model()
    opt = dk.DistributedLion(model.parameters(), lr=1e-2, backend="torch")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    w = model[2].bias
    deltas = []
    for step in range(3):
        before = w.detach().clone()
        _train(model, opt, 1, start=step, scheduler=sched)
        deltas.append((w.detach() - before).abs().max().item())
    # Binary vote, no weight decay: every element moves by exactly lr.
    assert deltas == pytest.approx([1e-2, 5e-3, 2.5e-3], rel=1e-5)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    opt.step()  # all gradients None: still a valid step (momentum votes)


def test_non_contiguous_parameter():
    weight = torch.nn.Parameter(torch.randn(7, 5).t())  # non-contiguous
    twin = torch.nn.Parameter(weight.detach().contiguous())
    opt = dk.DistributedLion([weight], lr=0.1, weight_decay=0.1, backend="torch")
    opt_twin = dk.DistributedLion([twin], lr=0.1, weight_decay=0.1, backend="torch")
    for step in range(3):
        g = torch.randn(5, 7)
        weight.grad, twin.grad = g.clone(), g.clone()
        opt.step()
        opt_twin.step()
    assert not weight.is_contiguous()
    assert torch.equal(weight, twin)


def test_closure_and_bad_construction():
    model = _model()
    opt = dk.DistributedLion(model.parameters(), lr=1e-3, backend="torch")

    def closure():
        x, y = _batch(0, 0)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    assert opt.step(closure) is not None
    with pytest.raises(ValueError, match="lr"):
        dk.DistributedLion(model.parameters(), lr=-1)
    with pytest.raises(ValueError, match="mode"):
        dk.DistributedLion(model.parameters(), mode="median")
    with pytest.raises(TypeError, match="dtype"):
        dk.DistributedLion([torch.zeros(3, dtype=torch.float64, requires_grad=True)])


def _optim_worker(rank, n):
    out = {}
    # Param groups, a parameter unused on one rank (None gradient there), resume.
    model = _model()
    opt = dk.DistributedLion(_groups(model), backend="torch")
    for step in range(3):
        x, y = _batch(rank, step)
        opt.zero_grad()
        h = model[1](model[0](x))
        if rank == n - 1:  # this rank never uses the second layer's output path for bias grad
            logits = h @ model[2].weight.t()
        else:
            logits = model[2](h)
        torch.nn.functional.cross_entropy(logits, y).backward()
        opt.step()
    out["params"] = [p.detach().clone() for p in model.parameters()]
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    _train(model, opt, 2, rank=rank, start=3)
    out["continued"] = [p.detach().clone() for p in model.parameters()]
    resumed = _model(seed=5)
    resumed.load_state_dict(saved[0])
    opt2 = dk.DistributedLion(_groups(resumed), backend="torch")
    opt2.load_state_dict(saved[1])
    _train(resumed, opt2, 2, rank=rank, start=3)
    out["resumed"] = [p.detach().clone() for p in resumed.parameters()]

    # A non-finite gradient on one rank only: every rank raises, or every rank skips.
    for policy in ("raise", "skip"):
        opt3 = dk.DistributedLion(model.parameters(), backend="torch", nonfinite=policy)
        x, y = _batch(rank, 9)
        opt3.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if rank == 1:
            model[0].weight.grad[0, 0] = float("nan")
        before = [p.detach().clone() for p in model.parameters()]
        try:
            opt3.step()
            out[policy] = "skipped" if opt3.last_stats.skipped else "stepped"
        except dk.NonFiniteGradientError:
            out[policy] = "raised"
        out[policy + "_unchanged"] = all(torch.equal(a, b) for a, b in
                                         zip(before, model.parameters()))
        dist.barrier()
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_distributed_optimizer(n):
    ranks = run_workers(n, _optim_worker)
    for out in ranks:
        for key in ("params", "continued", "resumed"):
            for a, b in zip(out[key], ranks[0][key]):
                assert torch.equal(a, b), f"ranks differ in {key}"
        for a, b in zip(out["continued"], out["resumed"]):
            assert torch.equal(a, b), "resume is not exact"
        assert out["raise"] == "raised" and out["raise_unchanged"]
        assert out["skip"] == "skipped" and out["skip_unchanged"]


def _ddp_worker(rank, n):
    """The README's recipe: a DDP-wrapped model, every backward under no_sync() (D-Lion replaces
    the gradient all-reduce), two accumulated micro-batches per step. Returns the DDP run's
    parameters and those of the same run on the bare model."""
    results = []
    for wrap in (True, False):
        model = _model(seed=rank)  # different on purpose: DDP broadcasts rank 0's at wrap time
        if not wrap:
            model = _model(seed=0)
        net = torch.nn.parallel.DistributedDataParallel(model) if wrap else model
        opt = dk.DistributedLion(net.parameters(), lr=1e-2, weight_decay=0.1, backend="torch")
        for step in range(4):
            opt.zero_grad()
            for micro in range(2):
                x, y = _batch(rank, 10 * step + micro)
                sync = net.no_sync() if wrap else contextlib.nullcontext()
                with sync:
                    loss = torch.nn.functional.cross_entropy(net(x), y) / 2
                    loss.backward()
            opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
    return results


def test_ddp_no_sync_with_gradient_accumulation():
    ranks = run_workers(2, _ddp_worker)
    for ddp, bare in ranks:
        for a, b, c in zip(ddp, bare, ranks[0][0]):
            assert torch.equal(a, b), "DDP + no_sync differs from the bare model"
            assert torch.equal(a, c), "ranks differ"


# ----------------------------------------------------------------------------- DistributedLion


@fz.FUZZ
@given(st.data())
def test_fuzz_distributed_lion(data):
    """Constructor (lists, param groups with their own bad values, generators; wrong types and
    values) and one step; the same optimizer with backend="torch" on copies is the reference."""
    valid = data.draw(st.booleans())
    params, grads, _ = fz.tensor_lists(data, valid)
    if isinstance(params, torch.Tensor):
        params = [params]
    for p, g in zip(params, grads):
        if isinstance(p, torch.Tensor) and p.is_floating_point() and p.is_leaf:
            p.requires_grad_(True)
            if isinstance(g, torch.Tensor) and g.shape == p.shape and g.dtype == p.dtype and \
                    g.device == p.device:
                p.grad = g.detach().clone()
    hyper = fz.hyperparameters(data, valid)
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

    snap = fz.snapshot(params)
    opt, err = fz.outcome(lambda: make(params))
    ref, ref_err = fz.outcome(lambda: make(ref_params, backend="torch"))
    assert type(err) is type(ref_err), (err, ref_err)
    if err is not None:
        fz.assert_unchanged(params, snap)
        return
    _, err = fz.outcome(opt.step)
    _, ref_err = fz.outcome(ref.step)
    assert type(err) is type(ref_err), (err, ref_err)
    hypothesis.event(f"outcome: {type(err).__name__ if err else 'ran'}")
    if err is not None:
        fz.assert_unchanged(params, snap)
        return
    for p, q in zip(params, ref_params):
        if isinstance(p, torch.Tensor) and p.device.type != "meta":
            assert_close_storage(p.detach(), q.detach())
            if opt.state.get(p):
                assert_close_storage(opt.state[p]["exp_avg"], ref.state[q]["exp_avg"])
                assert opt.state[p]["step"] == ref.state[q]["step"]  # 0 when skipped


