"""DistributedLion under the frameworks that wrap models and optimizers: torch.compile and
Hugging Face Accelerate (2 gloo processes)."""

import os

import pytest
import torch
from workers import run_workers

import dlion_kernels as dk

STEPS = 4


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(13, 31), torch.nn.Tanh(), torch.nn.Linear(31, 3))


def _batch(step, rank=0):
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 13, generator=gen), torch.randint(0, 3, (8,), generator=gen)


def _train(net, params, rank=0, **options):
    opt = dk.DistributedLion(params, lr=1e-2, weight_decay=0.1, **options)
    for step in range(STEPS):
        x, y = _batch(step, rank)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return opt


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_model_trains_like_eager(backend):
    """Forward and backward compiled (inductor builds C++ kernels with the host compiler)."""
    torch._dynamo.reset()
    eager, compiled = _model(), _model()
    _train(eager, eager.parameters())
    opt = _train(torch.compile(compiled, backend=backend), compiled.parameters())
    assert opt.last_stats is not None and all(s["step"] == STEPS for s in opt.state.values())
    for a, b in zip(eager.parameters(), compiled.parameters()):
        # aot_eager runs the same kernels: exact. Inductor may round differently in a fused
        # kernel, which can flip a rare vote: allow 1% of the elements to differ.
        differ = (a != b).float().mean().item()
        assert differ == 0.0 if backend == "aot_eager" else differ <= 0.01


def test_compiled_model_with_overlap_trains_like_eager():
    """overlap=True on a compiled module: the post-accumulate-grad hooks sit on the parameters,
    which torch.compile leaves alone, so buckets start during the compiled backward. Tiny
    buckets (several per step) and bit-identity with eager overlap=False."""
    torch._dynamo.reset()
    eager, compiled = _model(), _model()
    _train(eager, eager.parameters())
    opt = _train(torch.compile(compiled, backend="aot_eager"), compiled.parameters(),
                 overlap=True, bucket_mb=0.001)
    assert opt.last_stats.buckets > 1
    for a, b in zip(eager.parameters(), compiled.parameters()):
        assert torch.equal(a, b)


def _frameworks_worker(rank, n):
    out = {}
    # torch.compile on every rank: bit-identical parameters.
    torch._dynamo.reset()
    model = _model()
    _train(torch.compile(model, backend="aot_eager"), model.parameters(), rank)
    out["compiled"] = [p.detach().clone() for p in model.parameters()]

    # Accelerate: prepare() wraps the model in DDP and the optimizer in AcceleratedOptimizer.
    # DDP's all-reduce is switched off with accelerator.no_sync: DistributedLion does the
    # exchange (rank-specific data, so without it the ranks would drift apart).
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(n), OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    out["accelerate_processes"] = accelerator.num_processes
    model = _model()
    opt = dk.DistributedLion(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ddp, aopt, asched = accelerator.prepare(model, opt, sched)
    out["wrapped"] = type(ddp).__name__, type(aopt).__name__
    for step in range(STEPS):
        x, y = _batch(step, rank)
        aopt.zero_grad()
        with accelerator.no_sync(ddp):
            accelerator.backward(torch.nn.functional.cross_entropy(ddp(x), y))
        aopt.step()
        asched.step()
    out["accelerate"] = [p.detach().clone() for p in model.parameters()]
    out["lr"] = opt.param_groups[0]["lr"]
    out["steps"] = [s["step"] for s in opt.state.values()]

    # The same run without Accelerate: identical parameters. (Accelerate steps a scheduler
    # num_processes times per optimizer step unless split_batches=True.)
    bare = _model()
    bare_opt = dk.DistributedLion(bare.parameters(), lr=1e-2, weight_decay=0.1)
    bare_sched = torch.optim.lr_scheduler.StepLR(bare_opt, step_size=2, gamma=0.5)
    for step in range(STEPS):
        x, y = _batch(step, rank)
        bare_opt.zero_grad()
        torch.nn.functional.cross_entropy(bare(x), y).backward()
        bare_opt.step()
        for _ in range(n):
            bare_sched.step()
    out["bare"] = [p.detach().clone() for p in bare.parameters()]
    return out


def test_compile_and_accelerate_on_two_gloo_ranks():
    pytest.importorskip("accelerate")
    ranks = run_workers(2, _frameworks_worker)
    for out in ranks:
        for key in ("compiled", "accelerate"):
            assert all(torch.equal(a, b) for a, b in zip(out[key], ranks[0][key])), key
        assert out["accelerate_processes"] == 2
        assert out["wrapped"] == ("DistributedDataParallel", "AcceleratedOptimizer")
        assert all(torch.equal(a, b) for a, b in zip(out["accelerate"], out["bare"]))
        assert out["lr"] == pytest.approx(1e-2 * 0.5**4) and out["steps"] == [STEPS] * 4
