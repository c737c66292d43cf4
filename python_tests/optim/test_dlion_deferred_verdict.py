"""The deferred verdict (``DistributedLion`` on CUDA with ``nonfinite="skip"`` or a GradScaler):
the step reads nothing back on the host; the decision is settled at the next step,
``state_dict()`` or ``last_stats``. Forced on here through ``_defer_on_cpu`` (the same code path
as CUDA but for the pinned copy and its event), on real gloo ranks, against the immediate
verdict: parameters, momenta, step counters, ``last_stats`` and GradScaler scales are identical,
a skipped step's counters go back, and a step mismatch raises at the next step on every rank
after changing nothing."""

import warnings

import pytest
import torch
from workers import run_workers

import dlion_kernels as dk
from dlion_kernels.exchange.header import StepMismatchError
from dlion_kernels.kernels import backends

STEPS, INF_STEP = 6, 3


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(13, 37), torch.nn.Tanh(), torch.nn.Linear(37, 5))


def _backward(model, step, rank, scaler=None):
    gen = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(8, 13, generator=gen), torch.randint(0, 5, (8,), generator=gen)
    if step == INF_STEP and rank == 1:
        x[0, 0] = float("nan")  # in the data: overlap takes the votes during backward
    loss = torch.nn.functional.cross_entropy(model(x), y)
    (scaler.scale(loss) if scaler is not None else loss).backward()


def _run(rank, deferred, overlap, scaled):
    dk.DistributedLion._defer_on_cpu = deferred
    model = _model()
    opt = dk.DistributedLion(model.parameters(), lr=1e-2, weight_decay=0.1, nonfinite="skip",
                             overlap=overlap, bucket_mb=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2) if scaled \
        else None
    trace = []
    for step in range(STEPS):
        opt.zero_grad()
        _backward(model, step, rank, scaler)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        pending = opt.decision_pending
        counts = [opt.state[p]["step"] for p in model.parameters()]
        skipped = opt.last_stats.skipped  # settles
        trace.append(dict(pending=pending, counts_before_settle=counts, skipped=skipped,
                          counts=[opt.state[p]["step"] for p in model.parameters()],
                          scale=None if scaler is None else scaler.get_scale(),
                          params=[p.detach().clone() for p in model.parameters()],
                          exp_avg=[opt.state[p]["exp_avg"].clone() for p in model.parameters()]))
    return trace


def _worker(rank, n):
    out = {}
    # (fp16 GradScaler and overlap=True are not combined: it raises, test_amp.py)
    for overlap, scaled in ((False, False), (True, False), (False, True)):
        out[(overlap, scaled)] = [_run(rank, d, overlap, scaled) for d in (False, True)]
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_deferred_equals_immediate(n):
    results = run_workers(n, _worker)
    for rank, res in enumerate(results):
        for (overlap, scaled), (immediate, deferred) in res.items():
            where = f"rank {rank} overlap={overlap} scaled={scaled}"
            for step, (a, b) in enumerate(zip(immediate, deferred, strict=True)):
                assert not a["pending"] and b["pending"], where
                assert a["skipped"] == b["skipped"] == (step == INF_STEP), (where, step)
                assert a["counts"] == b["counts"], (where, step)
                # deferred: the step counts as taken until the verdict is read
                assert b["counts_before_settle"] == [step + 1 - (step > INF_STEP)] * 4, where
                assert a["scale"] == b["scale"], (where, step)
                for x, y in zip(a["params"] + a["exp_avg"], b["params"] + b["exp_avg"]):
                    assert torch.equal(x, y), (where, step)
            if rank:  # the same on every rank
                for a, b in zip(results[0][(overlap, scaled)][1], deferred):
                    for x, y in zip(a["params"], b["params"]):
                        assert torch.equal(x, y), where


def _mismatch(rank, n):
    dk.DistributedLion._defer_on_cpu = True
    model = _model()
    opt = dk.DistributedLion(model.parameters(), lr=1e-2, nonfinite="skip")
    for step in range(2):
        opt.zero_grad()
        _backward(model, step, rank)
        opt.step()
    if rank == 1:  # as if resumed from another checkpoint
        for p in model.parameters():
            opt.state[p]["step"] += 5
    before = [p.detach().clone() for p in model.parameters()]
    momenta = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    counts = [opt.state[p]["step"] for p in model.parameters()]
    opt.zero_grad()
    _backward(model, 2, rank)
    opt.step()  # exchanges with mismatched headers; the device flag skips every apply
    unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters())) and all(
        torch.equal(m, opt.state[p]["exp_avg"]) for m, p in zip(momenta, model.parameters()))
    try:
        opt.zero_grad()
        _backward(model, 3, rank)
        opt.step()  # settles the previous step first: raises before any collective
        error = None
    except StepMismatchError as e:
        error = str(e)
    return dict(unchanged=unchanged, error=error, counts_before=counts,
                counts_after=[opt.state[p]["step"] for p in model.parameters()],
                pending=opt.decision_pending)


def test_deferred_step_mismatch_raises_at_next_step():
    for rank, res in enumerate(run_workers(2, _mismatch)):
        assert res["unchanged"], rank
        assert res["error"] is not None and "different steps" in res["error"], rank
        assert res["counts_after"] == res["counts_before"], rank  # the counters went back
        assert not res["pending"], rank


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device is visible to torch")
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("overlap", [False, True])
def test_no_host_sync_on_cuda_with_skip(overlap, dtype, backend):
    """One rank, no process group: a CUDA step with nonfinite="skip" makes no synchronizing call
    (torch's sync debug mode warns at each one: all of them are listed, file and line); reading
    last_stats then settles it."""
    problem = backends._problem(backend, "cuda")
    if problem:
        pytest.skip(problem)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(),
                                torch.nn.Linear(256, 8)).to("cuda", dtype)
    opt = dk.DistributedLion(model.parameters(), lr=1e-3, nonfinite="skip", overlap=overlap,
                             backend=backend)
    x = torch.randn(16, 64, device="cuda", dtype=dtype)
    for _ in range(2):  # the first step records the bucket order and builds the tables
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()
    assert opt.last_stats is not None
    opt.zero_grad()
    model(x).float().square().mean().backward()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # (setting the mode warns once per process that it is a prototype: not counted)
    syncs = [f"{w.filename}:{w.lineno}" for w in caught
             if "called a synchronizing CUDA operation" in str(w.message)]
    assert not syncs, syncs
    assert opt.decision_pending
    stats = opt.last_stats  # settles the step: one read of the headers, now
    assert stats.skipped is False and not opt.decision_pending
