"""The D-Lion protocol on real gloo process groups, checked against a one-process simulation."""

import pytest
import torch
import torch.distributed as dist
from conftest import assert_close_storage, backend_device
from workers import CountingCollectives, run_workers

import dlion_kernels as dk
from dlion_kernels.exchange.header import HEADER_WORDS
from dlion_kernels.kernels import backends, reference
from dlion_kernels.kernels.layout import aggregate_planes, block_offsets, vote_planes

SIZES = [(33,), (4097,), (5, 7), (1,), (64,)]
COMBOS = [(m, v) for m in ("vote", "average") for v in ("binary", "ternary")]
DTYPES = [torch.float32, torch.bfloat16]
STEPS, LR, WD, BETAS = 3, 1e-2, 0.1, (0.9, 0.99)


def _init(dtype):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen).to(dtype) for s in SIZES]


def _grads(rank, step, dtype):
    gen = torch.Generator().manual_seed(1000 * rank + step)
    grads = [torch.randn(s, generator=gen).to(dtype) for s in SIZES]
    if rank == 0 and step == 1:
        grads[3] = None  # a None gradient on one rank only
    return grads


def _protocol_worker(rank, n, backend):
    results = {}
    device = backend_device(backend)
    for mode, votes in COMBOS:
        for dtype in DTYPES:
            params = [p.to(device) for p in _init(dtype)]
            moms = [torch.zeros(s, device=device) for s in SIZES]
            stats, counted = [], []
            for step in range(STEPS):
                grads = [None if g is None else g.to(device) for g in _grads(rank, step, dtype)]
                with CountingCollectives(n) as counter:
                    stats.append(dk.fused_dlion_step(
                        params, grads, moms, lr=LR, betas=BETAS, weight_decay=WD, mode=mode,
                        votes=votes, backend=backend, step=step))
                counted.append(counter.sent)
            results[mode, votes, dtype] = ([p.cpu() for p in params], [m.cpu() for m in moms],
                                           stats, counted)
    return results


def simulate(n, mode, votes, dtype):
    """All n ranks in one process with the reference: the expected params and momenta."""
    ternary = votes == "ternary"
    params = _init(dtype)
    moms = [[torch.zeros(s) for s in SIZES] for _ in range(n)]
    offsets, total = block_offsets(p.numel() for p in params)
    for step in range(STEPS):
        stacked = torch.zeros(n, total * vote_planes(votes), dtype=torch.int32)
        grads = [_grads(r, step, dtype) for r in range(n)]
        for r in range(n):
            reference.local_step(grads[r], moms[r], stacked[r], offsets, BETAS[0], ternary)
        aggregate = torch.empty(total * aggregate_planes(mode, votes, n), dtype=torch.int32)
        reference.tally(stacked, aggregate, n, mode, ternary, step)
        updated = []
        for r in range(n):  # every rank applies the same x update and its own momentum update
            updated = [p.clone() for p in params]
            reference.apply(updated, grads[r], moms[r], aggregate, offsets, LR, WD, BETAS[1], n,
                            mode, ternary)
        params = updated
    return params, moms


def spec_bound(n, mode, votes, d, tensors):
    """The wire-format bytes sent per rank (docs/wire-format.md), plus the documented padding: one
    word per tensor and per rank in each plane, and the step header (flags, step) to each peer."""
    p_in, p_out = vote_planes(votes), aggregate_planes(mode, votes, n)
    return ((n - 1) / n * (p_in + p_out) * d / 8 + 4 * (p_in + p_out) * (tensors + n)
            + 4 * HEADER_WORDS * (n - 1))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_protocol_matches_simulation(backend, n):
    problem = backends._problem(backend, backend_device(backend).type)
    if problem:
        pytest.skip(problem)
    if backend_device(backend).type != "cpu":
        pytest.skip("gloo ranks run on CPU tensors")
    ranks = run_workers(n, _protocol_worker, backend)
    d = sum(torch.Size(s).numel() for s in SIZES)
    for mode, votes in COMBOS:
        for dtype in DTYPES:
            exp_params, exp_moms = simulate(n, mode, votes, dtype)
            for r, result in enumerate(ranks):
                params, moms, stats, counted = result[mode, votes, dtype]
                for a, b in zip(params, ranks[0][mode, votes, dtype][0]):
                    assert torch.equal(a, b), "ranks hold different parameters"
                for a, e in zip(params, exp_params):
                    assert_close_storage(a, e)
                for a, e in zip(moms, exp_moms[r]):
                    assert torch.equal(a, e)
                for s, c in zip(stats, counted):
                    assert (s.world_size, s.numel, s.mode, s.votes) == (n, d, mode, votes)
                    assert s.backend == backend
                    assert s.bytes_sent == s.bytes_received == c
                    assert s.bytes_sent <= spec_bound(n, mode, votes, d, len(SIZES))
                    if n == 1:
                        assert s.bytes_sent == 0


def _subgroup_worker(rank, n):
    sub = dist.new_group([0, 2])
    params = _init(torch.float32)
    if rank == 1:
        return None  # not a member: it takes part in nothing
    moms = [torch.zeros(s) for s in SIZES]
    stats = dk.fused_dlion_step(params, _grads(rank, 0, torch.float32), moms, lr=LR, group=sub,
                                backend="torch", step=0)
    return params, stats


def test_any_process_group():
    """A group that is not the default one: ranks 0 and 2 of three."""
    ranks = run_workers(3, _subgroup_worker)
    (p0, s0), none, (p2, s2) = ranks
    assert none is None and s0.world_size == s2.world_size == 2
    assert s0.bytes_sent > 0
    for a, b in zip(p0, p2):
        assert torch.equal(a, b)


def test_bytes_against_fp32_allreduce():
    """The headline: vote/binary sends about 1/32 of an fp32 ring all-reduce."""
    d, n = 10_000_000, 4
    assert spec_bound(n, "vote", "binary", d, 1) < 2 * (n - 1) / n * 4 * d / 31
