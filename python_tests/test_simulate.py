"""The simulation of k workers in one process (``dlion_kernels/simulate.py``) against the real
thing: k gloo processes running ``dk.DistributedLion``, ``dk.DiLoCo`` and torch's AdamW on an
all-reduced mean gradient, at k = 2, 3 and 4, bit for bit.

One launch per k runs every case on the ranks (a tiny MLP, a few steps or syncs, each rank on its
own data); the simulation then replays each case in this process, without a process group, each
worker's gradient computed as its rank computed it, and must give the same parameters after every
step (every worker's, for DiLoCo, whose workers differ between syncs), the same outer momenta and
residuals, and the same bytes per step or sync as the ranks' stats report."""

import contextlib

import pytest
import torch
import torch.distributed as dist
from workers import run_workers

import dlion_kernels as dk
from dlion_kernels.simulate import (
    SimulatedDiLoCo,
    SimulatedDLion,
    all_reduce_mean,
    all_reduce_sum,
    dlion_step_bytes,
    ring_chunks,
    sparseloco_sync_bytes,
)

STEPS = 3  # per-step cases
INNER = 6  # DiLoCo cases: inner steps, H = 2 (3 syncs)
H = 2
LR, BETAS, WD = 3e-3, (0.9, 0.99), 0.1

PER_STEP = [("vote", "binary"), ("vote", "ternary"), ("average", "binary"),
            ("average", "ternary")]
# name -> DiLoCo's keyword arguments (besides the model and the inner optimizer)
OUTER = {
    "dlion": dict(outer="dlion", outer_lr=2e-2),
    "dlion-average": dict(outer="dlion", outer_lr=2e-2, mode="average"),
    "dlion-ef-decay": dict(outer="dlion", outer_lr=2e-2,
                           outer_options=dict(error_feedback=True, ef_decay=0.5)),
    "dlion-ef-scale": dict(outer="dlion", outer_lr=0.5,
                           outer_options=dict(error_feedback=True, scale=True)),
    "dlion-ef-threshold": dict(outer="dlion", outer_lr=2e-2, votes="ternary",
                               outer_options=dict(error_feedback=True, threshold=0.5)),
    "nesterov": dict(outer="nesterov", outer_lr=0.7),
    "sparseloco": dict(outer="sparseloco", outer_lr=1.0,
                       outer_options=dict(chunk=16, topk=12, ef_decay=0.9)),
}


def _model():
    torch.manual_seed(0)  # every rank and every simulated worker starts alike
    return torch.nn.Sequential(torch.nn.Linear(9, 70), torch.nn.Tanh(),
                               torch.nn.Linear(70, 3))


def _loss(model, rank, t):
    gen = torch.Generator().manual_seed(100 * rank + t)  # each rank its own data
    x, y = torch.randn(5, 9, generator=gen), torch.randn(5, 3, generator=gen)
    return torch.nn.functional.mse_loss(model(x), y)


def _grads(model, rank, t):
    model.zero_grad()
    _loss(model, rank, t).backward()
    return [p.grad.clone() for p in model.parameters()]


def _snap(model):
    return [p.detach().clone() for p in model.parameters()]


# ----------------------------------------------------------------------------- the ranks


def _ranks(rank, n):
    out = {}
    for mode, votes in PER_STEP:
        model = _model()
        opt = dk.DistributedLion(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD,
                                 mode=mode, votes=votes)
        steps = []
        for t in range(STEPS):
            opt.zero_grad()
            _loss(model, rank, t).backward()
            opt.step()
            steps.append((_snap(model), opt.last_stats.bytes_sent))
        out[("step", mode, votes)] = steps
    model = _model()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD)
    steps = []
    for t in range(STEPS):  # AdamW on the mean gradient: one fp32 all-reduce, then / n
        opt.zero_grad()
        _loss(model, rank, t).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        flat /= n
        torch._foreach_copy_([p.grad for p in params],
                             [f.view_as(p) for f, p in zip(flat.split(
                                 [p.numel() for p in params]), params)])
        opt.step()
        steps.append((_snap(model), flat.clone()))
    out["adamw"] = steps
    for name, kwargs in OUTER.items():
        model = _model()
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        diloco = dk.DiLoCo(model, inner, sync_every=H, outer_betas=BETAS,
                           outer_weight_decay=WD, **kwargs)
        steps = []
        for t in range(INNER):
            inner.zero_grad()
            _loss(model, rank, t).backward()
            inner.step()
            stats = diloco.step()
            residual = diloco.outer_residuals
            steps.append((_snap(model), None if stats is None else stats.bytes_sent,
                          [m.clone() for m in diloco.outer_momenta],
                          None if residual is None else [r.clone() for r in residual]))
        out[("diloco", name)] = steps
    return out


# ----------------------------------------------------------------------------- the simulation


@contextlib.contextmanager
def _one_thread():
    """The ranks ran with one thread: so does the replay (the same kernels, the same sums)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _equal(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _check_per_step(k, ranks, mode, votes):
    model = _model()
    sim = SimulatedDLion(model.parameters(), k, lr=LR, betas=BETAS, weight_decay=WD,
                         mode=mode, votes=votes)
    for t, (want, want_bytes) in enumerate(ranks[0][("step", mode, votes)]):
        stats = sim.step([_grads(model, w, t) for w in range(k)])
        assert _equal(_snap(model), want), f"{mode}/{votes} k={k}: step {t} differs"
        assert stats.bytes_sent == stats.bytes_received == want_bytes
        assert stats.bytes_sent == dlion_step_bytes([p.numel() for p in model.parameters()], k,
                                                    mode, votes)
        for w in range(k):  # the others' parameters are the same as rank 0's (the library)
            assert _equal(ranks[w][("step", mode, votes)][t][0], want)


def _check_adamw(k, ranks):
    model = _model()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD)
    for t, (want, want_mean) in enumerate(ranks[0]["adamw"]):
        stacked = torch.stack([torch.cat([g.reshape(-1) for g in _grads(model, w, t)])
                               for w in range(k)])
        mean = all_reduce_mean(stacked)
        # the mean itself: a one-ulp difference would mostly vanish in AdamW's normalized step
        assert torch.equal(mean, want_mean), f"adamw k={k}: the mean gradient of step {t}"
        for p, g in zip(params, mean.split([p.numel() for p in params])):
            p.grad = g.view_as(p).clone()
        opt.step()
        assert _equal(_snap(model), want), f"adamw k={k}: step {t} differs"


def _check_diloco(k, ranks, name):
    kwargs = dict(OUTER[name])
    models = [_model() for _ in range(k)]
    inners = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    sim = SimulatedDiLoCo([list(m.parameters()) for m in models], H, kwargs.pop("outer"),
                          outer_betas=BETAS, outer_weight_decay=WD, **kwargs)
    synced = 0
    for t in range(INNER):
        for w in range(k):
            inners[w].zero_grad()
            _loss(models[w], w, t).backward()
            inners[w].step()
        stats = sim.step()
        for w in range(k):
            params, sent, momenta, residual = ranks[w][("diloco", name)][t]
            assert _equal(_snap(models[w]), params), f"{name} k={k}: worker {w}, step {t}"
            row = sim.momentum[0 if name == "nesterov" else w]
            assert _equal(sim.layout.views(row), momenta), f"{name} k={k}: momentum {w}"
            if residual is None:
                assert sim.residual is None
            else:
                assert _equal(sim.layout.views(sim.residual[w]), residual)
            assert (stats is None) == (sent is None)
            if stats is not None:
                assert stats.bytes_sent == stats.bytes_received == sent, (name, k)
        synced += stats is not None
    assert synced == INNER // H
    if name == "sparseloco":
        assert sim.last_stats.bytes_sent == sparseloco_sync_bytes(
            [p.numel() for p in models[0].parameters()], k, chunk=16, topk=12)


@pytest.mark.parametrize("k", [2, 3, 4])
def test_simulation_is_the_multi_process_run(k):
    ranks = run_workers(k, _ranks)
    with _one_thread():
        for mode, votes in PER_STEP:
            _check_per_step(k, ranks, mode, votes)
        _check_adamw(k, ranks)
        for name in OUTER:
            _check_diloco(k, ranks, name)


# ----------------------------------------------------------------------------- pieces


def test_ring_chunks_cover_the_buffer_in_order():
    for k, numel in [(2, 1), (3, 40), (4, 1000), (5, 7), (64, 300_001), (3, 1_000_003)]:
        chunks = ring_chunks(numel, k)
        assert chunks[0][0] == 0 and chunks[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
        assert [c[2] for c in chunks] == [(c - 1) % k for c in range(len(chunks))]


def test_all_reduce_sum_orders():
    """Rank order and gloo's order both sum every worker once; they differ in rounding only,
    and where a chunk starts at rank 0's predecessor the two orders differ in association."""
    gen = torch.Generator().manual_seed(0)
    stacked = torch.randn(3, 1000, generator=gen) * torch.exp(5 * torch.randn(3, 1000,
                                                                              generator=gen))
    exact = stacked.double().sum(0)
    for order in ("gloo", "rank"):
        torch.testing.assert_close(all_reduce_sum(stacked, order).double(), exact, rtol=1e-6,
                                   atol=1e-3)
    assert not torch.equal(all_reduce_sum(stacked, "gloo"), all_reduce_sum(stacked, "rank"))
    with pytest.raises(ValueError, match="order"):
        all_reduce_sum(stacked, "tree")


def test_bad_arguments():
    model = _model()
    with pytest.raises(ValueError, match="workers"):
        SimulatedDLion(model.parameters(), 0, lr=1e-3)
    with pytest.raises(ValueError, match="mode"):
        SimulatedDLion(model.parameters(), 2, lr=1e-3, mode="median")
    sim = SimulatedDLion(model.parameters(), 2, lr=1e-3)
    with pytest.raises(ValueError, match="one list per worker"):
        sim.step([[p.detach() for p in model.parameters()]])
    other = _model()
    with torch.no_grad():
        next(other.parameters())[0, 0] += 1
    with pytest.raises(ValueError, match="worker 1 does not start"):
        SimulatedDiLoCo([list(model.parameters()), list(other.parameters())], 2,
                        outer_lr=1e-2)
    with pytest.raises(ValueError, match="ternary"):
        SimulatedDiLoCo([list(model.parameters())], 2, outer_lr=1e-2,
                        outer_options=dict(error_feedback=True, threshold=0.5))


def test_nonfinite_gradient_raises_or_skips():
    model = _model()
    before = _snap(model)
    grads = [_grads(model, w, 0) for w in range(3)]
    grads[2][0][0, 0] = float("nan")
    with pytest.raises(dk.NonFiniteGradientError):
        SimulatedDLion(model.parameters(), 3, lr=1e-3).step(grads)
    sim = SimulatedDLion(model.parameters(), 3, lr=1e-3, nonfinite="skip")
    assert sim.step(grads).skipped and _equal(_snap(model), before) and sim.steps == 0
    assert not sim.flat_momenta.any()


def test_stacked_workers_match_lists_of_parameters():
    """``stacked=`` (one [k, *shape] tensor per parameter, as vmap trains them) runs the same
    sync as one list of parameters per worker."""
    k = 3
    models = [_model() for _ in range(k)]
    stacked = [torch.stack([p.detach() for p in ps]).clone()
               for ps in zip(*(m.parameters() for m in models))]
    a = SimulatedDiLoCo([list(m.parameters()) for m in models], 1, outer_lr=1e-2,
                        outer_options=dict(error_feedback=True, ef_decay=0.5))
    b = SimulatedDiLoCo(stacked=stacked, sync_every=1, outer_lr=1e-2,
                        outer_options=dict(error_feedback=True, ef_decay=0.5))
    for t in range(2):
        for w in range(k):
            for p, s, g in zip(models[w].parameters(), stacked, _grads(models[w], w, t)):
                with torch.no_grad():
                    p -= 0.1 * g
                    s[w] -= 0.1 * g
        a.step()
        b.step()
        assert torch.equal(a.theta_bar, b.theta_bar)
        for w in range(k):
            assert _equal(_snap(models[w]), [s[w] for s in stacked])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device is visible to torch")
def test_runs_unchanged_on_one_gpu():
    """The same code on CUDA tensors (the best backend there): the parameters of a few D-Lion
    steps and DiLoCo syncs equal the CPU's within one fp32 rounding per step, as the backends
    promise one another."""
    k = 4
    grads = [[_grads(_model(), w, t) for w in range(k)] for t in range(3)]
    runs = {}
    for device in ("cpu", "cuda"):
        model = _model().to(device)
        sim = SimulatedDLion(model.parameters(), k, lr=LR, weight_decay=WD, mode="average",
                             votes="ternary")
        for t in range(3):
            sim.step([[g.to(device) for g in gs] for gs in grads[t]])
        models = [_model().to(device) for _ in range(k)]
        outer = SimulatedDiLoCo([list(m.parameters()) for m in models], 1, outer_lr=1e-2,
                                outer_options=dict(error_feedback=True, ef_decay=0.5))
        for t in range(2):
            for w in range(k):
                with torch.no_grad():
                    for p, g in zip(models[w].parameters(), grads[t][w]):
                        p -= 0.1 * g.to(device)
            outer.step()
        runs[device] = (_snap(model), outer.theta_bar.clone())
    for a, b in zip(runs["cpu"][0] + [runs["cpu"][1]], runs["cuda"][0] + [runs["cuda"][1]]):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-5, atol=1e-6)
