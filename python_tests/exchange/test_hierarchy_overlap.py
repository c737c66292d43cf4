"""Hierarchical D-Lion with overlap=True (exchange/hierarchy.py ``OverlapStep``) on real gloo
processes: bit-identical to hierarchy without overlap (parameters on every rank, and every
node's momentum assembled from its ranks' shards), several buckets, odd sizes, two param groups,
a bf16 parameter, an unused parameter, a NaN step, no_sync accumulation, checkpoint resume."""

from __future__ import annotations

import torch
from workers import run_workers

import dlion_kernels as dk

# (shape, dtype) per param group; the second group's 33-element tensor gets no gradient (unused)
SHAPES = [[((31,), torch.float32), ((4097,), torch.float32), ((70,), torch.bfloat16)],
          [((33,), torch.float32), ((5, 7), torch.float32), ((90,), torch.float32),
           ((1,), torch.float32)]]
UNUSED = (1, 0)
HYPER = [{"lr": 0.01, "betas": (0.9, 0.99), "weight_decay": 0.1},
         {"lr": 0.03, "betas": (0.8, 0.95), "weight_decay": 0.0}]
BUCKET_MB = 0.0002  # ~52 fp32 elements: a bucket closes at almost every tensor
NAN_STEP, NAN_RANK = 2, 1


def _params():
    gen = torch.Generator().manual_seed(7)
    return [[torch.randn(shape, generator=gen).to(dtype) for shape, dtype in group]
            for group in SHAPES]


def _make(L, mode, votes, overlap, init):
    params = [[p.clone().requires_grad_() for p in group] for group in init]
    groups = [{"params": ps, **h} for ps, h in zip(params, HYPER)]
    opt = dk.DistributedLion(groups, mode=mode, votes=votes, hierarchy=L, overlap=overlap,
                             bucket_mb=BUCKET_MB, nonfinite="skip")
    return params, opt


def _backward(params, step, rank, micro=0):
    """loss = sum(p * x): the gradient of p is x, random per (step, rank, micro-batch)."""
    gen = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    loss = 0
    for gi, group in enumerate(params):
        for i, p in enumerate(group):
            x = torch.randn(p.shape, generator=gen).to(p.dtype)
            if (step, rank, micro) == (NAN_STEP, NAN_RANK, 0) and (gi, i) == (0, 1):
                x[4000] = float("nan")
            if (gi, i) != UNUSED:
                loss = loss + (p * x).sum()
    loss.backward()


def _snapshot(params, opt):
    flat = [p for group in params for p in group]
    momentum = [(tuple(opt.state[p]["exp_avg_range"]), opt.state[p]["exp_avg"].clone())
                for p in flat]
    return [p.detach().clone() for p in flat], momentum


def _train(pairs, steps, rank, first=0, micro=1):
    stats = []
    for step in range(first, first + steps):
        for params, opt in pairs:
            opt.zero_grad()
            with opt.no_sync():
                for m in range(1, micro):
                    _backward(params, step, rank, m)
            _backward(params, step, rank)
            if opt.overlap and step > first:  # not the first backward: buckets started
                assert opt.buckets_started >= 2
            opt.step()
        stats.append([opt.last_stats for _, opt in pairs])
    return stats


def _worker(rank, n, L, variants):
    out = []
    for mode, votes in variants:
        init = _params()
        flat = _make(L, mode, votes, False, init)
        over = _make(L, mode, votes, True, init)
        stats = _train([flat, over], 2, rank)
        before = _snapshot(*over)
        stats += _train([flat, over], 1, rank, first=NAN_STEP)  # the NaN step: skipped
        after = _snapshot(*over)
        stats += _train([flat, over], 2, rank, first=3, micro=2)  # no_sync accumulation
        # resume an overlap=True checkpoint into a fresh overlap=True optimizer
        over5 = _snapshot(*over)
        saved = over[1].state_dict()
        resumed = _make(L, mode, votes, True, [[p.detach() for p in g] for g in over[0]])
        resumed[1].load_state_dict(saved)
        _train([over, resumed], 2, rank, first=5)
        over7 = _snapshot(*over)
        # an overlap=True momentum shard does not fit overlap=False: a clear error at step
        wrong = _make(L, mode, votes, False, [[p.detach() for p in g] for g in over[0]])
        wrong[1].load_state_dict(over[1].state_dict())
        _backward(wrong[0], 7, rank)
        try:
            wrong[1].step()
            error = None
        except ValueError as e:
            error = str(e)
        # fp16 GradScaler: the votes were taken from scaled gradients during backward -> a
        # clear error on every rank, nothing modified (as flat overlap); the next step works
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(torch.ones(()))
        over[1].zero_grad()
        _backward(over[0], 8, rank)
        unscaled = _snapshot(*over)
        try:
            scaler.step(over[1])
            scaled = None
        except ValueError as e:
            scaled = str(e)
        changed = _snapshot(*over)
        over[1].zero_grad()
        _backward(over[0], 9, rank)
        over[1].step()
        out.append({"scaled": scaled, "unscaled": unscaled, "changed": changed,
                    "steps": {s["step"] for s in over[1].state.values()}})
        out[-1].update({"flat": _snapshot(*flat), "over5": over5, "over": over7,
                        "resumed": _snapshot(*resumed), "before": before, "after": after,
                        "error": error, "stats": [(a.skipped, b.skipped, b.buckets)
                                                  for a, b in stats]})
    return out


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _node_momentum(results, L, node, which, v):
    """Every parameter's full momentum of one node, from its L ranks' shards (each element
    covered exactly once)."""
    full = None
    for rank in range(node * L, (node + 1) * L):
        momentum = results[rank][v][which][1]
        if full is None:
            full = [torch.full((p.numel(),), float("nan")) for p in results[rank][v][which][0]]
        for f, ((lo, hi), m) in zip(full, momentum):
            assert torch.isnan(f[lo:hi]).all(), "two ranks of a node hold the same element"
            f[lo:hi] = m
    for f in full:
        assert not torch.isnan(f).any(), "an element has no momentum on any rank of the node"
    return full


def _check(n, L, variants):
    results = run_workers(n, _worker, L, variants)
    for v in range(len(variants)):
        r0 = results[0][v]
        for rank in range(n):
            res = results[rank][v]
            for a, b in zip(r0["flat"][0], res["over5"][0]):  # bit-identical everywhere
                assert torch.equal(_bits(a), _bits(b))
            for a, b in zip(r0["over"][0], res["resumed"][0]):
                assert torch.equal(_bits(a), _bits(b))
            # the NaN step changed nothing on this rank (parameters and momentum shard)
            for a, b in zip(res["before"][0], res["after"][0]):
                assert torch.equal(a, b)
            for (ra, a), (rb, b) in zip(res["before"][1], res["after"][1]):
                assert ra == rb and torch.equal(a, b)
            assert "GradScaler" in res["scaled"] and res["steps"] == {7}
            for a, b in zip(res["unscaled"][0], res["changed"][0]):
                assert torch.equal(a, b)
            for (ra, a), (rb, b) in zip(res["unscaled"][1], res["changed"][1]):
                assert ra == rb and torch.equal(a, b)
            # resumed momentum equals the original's, range by range
            for (ra, a), (rb, b) in zip(res["over"][1], res["resumed"][1]):
                assert ra == rb and torch.equal(a, b)
            assert res["error"] is not None and "overlap and bucket_mb" in res["error"]
            skipped = [s[:2] for s in res["stats"]]
            assert skipped == [(False, False)] * 2 + [(True, True)] + [(False, False)] * 2
            assert all(s[2] >= 3 for s in res["stats"])  # several buckets
        for node in range(n // L):
            flat = _node_momentum(results, L, node, "flat", v)
            over = _node_momentum(results, L, node, "over5", v)
            for a, b in zip(flat, over):
                assert torch.equal(a, b)
    return results


def test_hierarchy_overlap_2x2():
    _check(4, 2, [("vote", "binary"), ("average", "ternary")])


def test_hierarchy_overlap_1x2():
    _check(2, 2, [("vote", "ternary"), ("average", "binary")])


def test_hierarchy_overlap_4x2():
    _check(8, 2, [("average", "binary")])
