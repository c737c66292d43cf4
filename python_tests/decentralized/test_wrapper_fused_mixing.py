"""DecentralizedDataParallel's fused mixing (the received gossip handed to AccumAdamW /
AccumLion as ``sources``) against the copy-then-step path, on real gloo processes (n = 2, 4):
bit for bit over several iterations, every topology, with an unused parameter, a scheduler,
clipping and bf16 parameters; and which paths fuse."""

from typing import ClassVar

import pytest
import torch
import torch.distributed as dist
from workers import run_workers

import dlion_kernels as dk

ITERATIONS = 7


class _Net(torch.nn.Module):
    def __init__(self, seed, dtype):
        super().__init__()
        torch.manual_seed(seed)
        self.a = torch.nn.Linear(7, 33)
        self.unused = torch.nn.Parameter(torch.randn(5))  # never gets a gradient: still mixed
        self.b = torch.nn.Linear(33, 3)
        self.to(dtype)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _flat(module):
    return torch.cat([p.detach().float().reshape(-1).clone() for p in module.parameters()])


class _CountingAdamW(dk.AccumAdamW):
    """AccumAdamW that counts the steps given sources (the fused mixing)."""

    fused_calls: ClassVar[int] = 0

    def step(self, closure=None, *, sources=None):
        if sources:
            _CountingAdamW.fused_calls += 1
        return super().step(closure, sources=sources)


def _variants():
    return {
        "adamw-k1": {"opt": lambda ps: _CountingAdamW(ps, lr=1e-2, accum_steps=1)},
        "adamw-k4-sched": {
            "opt": lambda ps: _CountingAdamW(ps, lr=1e-2, weight_decay=0.1, accum_steps=4),
            "sched": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)},
        "lion-k2-clip": {
            "opt": lambda ps: dk.AccumLion(ps, lr=3e-3, weight_decay=0.1, accum_steps=2),
            "clip": 0.5},
        "lion-k1-torch": {"opt": lambda ps: dk.AccumLion(ps, lr=3e-3, backend="torch")},
        "adamw-k2-bf16": {"opt": lambda ps: dk.AccumAdamW(ps, lr=1e-2, accum_steps=2),
                          "dtype": torch.bfloat16},
    }


def _train(rank, topology, variant, fuse):
    dtype = variant.get("dtype", torch.float32)
    model = _Net(0, dtype)
    ddp = dk.DecentralizedDataParallel(
        model, variant["opt"], topology=topology, bucket_mb=0.0005,
        lr_scheduler_fn=variant.get("sched"), max_grad_norm=variant.get("clip"),
        local_world_size=2)
    ddp._fuse_mixing = fuse
    record = []
    for it in range(ITERATIONS):
        gen = torch.Generator().manual_seed(1000 * rank + it)
        x, y = torch.randn(8, 7, generator=gen), torch.randn(8, 3, generator=gen)
        torch.nn.functional.mse_loss(ddp(x.to(dtype)).float(), y).backward()
        record.append(_flat(model))
    ddp.synchronize()
    record.append(_flat(model))
    ddp.remove()
    return record, len(ddp.optimizers)


def _fused_vs_unfused(rank, n, topologies):
    out = {}
    for topology in topologies:
        for name, variant in _variants().items():
            _CountingAdamW.fused_calls = 0
            fused, buckets = _train(rank, topology, variant, True)
            fused_calls = _CountingAdamW.fused_calls
            _CountingAdamW.fused_calls = 0
            unfused, _ = _train(rank, topology, variant, False)
            out[topology, name] = {"fused": fused, "unfused": unfused, "buckets": buckets,
                                   "calls": (fused_calls, _CountingAdamW.fused_calls)}
            dist.barrier()
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_fused_mixing_is_bit_identical(n):
    """Every topology at n, five optimizer set-ups: the parameters after every iteration and
    after synchronize() are identical with and without fusing; fusing really ran (the counting
    optimizer saw sources in every iteration after the first, per bucket) and the ranks really
    differ (so the mixing mattered)."""
    topologies = ["complete", "ring", "one-peer-exp"] + (["alternating-exp-ring"] if n == 4
                                                          else [])
    results = run_workers(n, _fused_vs_unfused, topologies)
    for key in results[0]:
        for rank, r in enumerate(results):
            run = r[key]
            assert run["buckets"] > 1, key
            for it, (a, b) in enumerate(zip(run["fused"], run["unfused"])):
                assert torch.equal(a, b), f"{key}, rank {rank}, iteration {it}"
            if key[1].startswith("adamw-k") and "bf16" not in key[1]:
                # every bucket from the second iteration on, none unfused
                assert run["calls"][1] == 0, key
                assert run["calls"][0] >= (ITERATIONS - 1) * (run["buckets"] - 1), key
        if key[0] != "complete":
            assert not torch.equal(results[0][key]["fused"][3], results[1][key]["fused"][3])


def test_which_buckets_fuse():
    """Without a process group nothing is in flight, so nothing fuses; AccumAdamW / AccumLion
    with fp32 gossip get received-buffer views of every parameter; bf16 gossip and torch
    optimizers do not (they keep the copy path)."""
    def build(opt, **kw):
        ddp = dk.DecentralizedDataParallel(_Net(0, torch.float32), opt, bucket_mb=0.0005, **kw)
        x = torch.randn(4, 7)
        ddp(x).sum().backward()
        return ddp

    _CountingAdamW.fused_calls = 0
    ddp = build(lambda ps: _CountingAdamW(ps, lr=1e-2))
    ddp(torch.randn(4, 7)).sum().backward()
    assert _CountingAdamW.fused_calls == 0  # n = 1: no gossip to mix
    states = list(ddp._states.values())
    assert all(set(map(id, st.recv_views)) == set(map(id, st.bucket.params)) for st in states)
    for st in states:
        for p, v in st.recv_views.items():
            send = st.sends[p.dtype]
            assert v.shape == p.shape and v.untyped_storage().data_ptr() == \
                send.untyped_storage().data_ptr()
    assert not any(st.recv_views for st in build(lambda ps: dk.AccumLion(ps, lr=1e-3),
                                                  gossip_dtype="bf16")._states.values())
    assert not any(st.recv_views for st in build(lambda ps: torch.optim.AdamW(ps, lr=1e-3))
                   ._states.values())
    assert all(st.recv_views for st in build(lambda ps: dk.AccumLion(ps, lr=1e-3))
               ._states.values())
