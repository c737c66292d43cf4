"""Hierarchical D-Lion (hierarchy=L) on real gloo processes: nodes of L ranks, the nodes vote.

Every configuration is checked against a one-process simulation of N = n / L voters whose
gradients are the node means (integer-valued gradients, so every mean is exact), run with the
torch reference stages.
"""

import io
import os

import pytest
import torch
import torch.distributed as dist
from workers import run_workers

import dlion_kernels as dk
from dlion_kernels.exchange import hierarchy as hier
from dlion_kernels.kernels import reference
from dlion_kernels.kernels.layout import aggregate_planes, block_offsets, vote_planes

# Two param groups of different dtypes and hyper-parameters; sizes that straddle shards.
GROUPS = [
    dict(shapes=[(33,), (1,), (10, 30), (31,)], dtype=torch.float32, lr=0.01, betas=(0.9, 0.99),
         weight_decay=0.1),
    dict(shapes=[(257,), (8, 8)], dtype=torch.bfloat16, lr=0.02, betas=(0.8, 0.95),
         weight_decay=0.0),
]
VARIANTS = [("vote", "binary"), ("average", "binary"), ("vote", "ternary"),
            ("average", "ternary")]
STEPS, RESUME_AT = 6, 3


def _init_params():
    gen = torch.Generator().manual_seed(1)
    return [[torch.randn(s, generator=gen).to(g["dtype"]) for s in g["shapes"]] for g in GROUPS]


def _grads(step, rank):
    """Integer-valued gradients of one rank at one step; parameter 1 has no gradient on odd
    ranks at odd steps (None counts as zero)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    out = []
    for g in GROUPS:
        out.append([torch.randint(-3, 4, s, generator=gen).to(g["dtype"]) for s in g["shapes"]])
    if rank % 2 and step % 2:
        out[0][1] = None
    return out


def _f32(x):
    return torch.tensor(x, dtype=torch.float32)


def simulate(n, L, mode, votes, steps):
    """N = n / L voters with node-mean gradients, in one process: D-Lion written out in fp32
    (packing and tally by the reference stages)."""
    N, ternary = n // L, votes == "ternary"
    params = [[p.clone() for p in ps] for ps in _init_params()]
    flat = [p for ps in params for p in ps]
    specs = [spec for spec, ps in zip(GROUPS, params) for _ in ps]
    offsets, total = block_offsets(p.numel() for p in flat)
    p_in, p_out = vote_planes(votes), aggregate_planes(mode, votes, N)
    momenta = [[torch.zeros(p.shape) for p in flat] for _ in range(N)]
    for t in range(steps):
        stacked = torch.zeros(N, total * p_in, dtype=torch.int32)
        for k in range(N):
            mean = [torch.zeros(p.shape) for p in flat]
            for r in range(k * L, (k + 1) * L):
                for i, g in enumerate(x for gs in _grads(t, r) for x in gs):
                    if g is not None:
                        mean[i] += g.float()
            for i, (g, m, spec, off) in enumerate(zip(mean, momenta[k], specs, offsets)):
                b1, b2 = spec["betas"]
                g = g / L
                c = _f32(b1) * m + _f32(1.0 - b1) * g
                m.copy_(_f32(b2) * m + _f32(1.0 - b2) * g)
                words = reference.pack_bits([c > 0, c < 0] if ternary else [c > 0], c.numel())
                stacked[k, off * p_in : off * p_in + words.numel()] = words
        aggregate = torch.empty(total * p_out, dtype=torch.int32)
        reference.tally(stacked, aggregate, N, mode, ternary, t)
        for x, spec, off in zip(flat, specs, offsets):
            nb = -(-x.numel() // 32)
            d = reference.decode(aggregate[off * p_out : (off + nb) * p_out], x.numel(), N, mode,
                                 ternary)
            xf = x.reshape(-1).float()
            xf = xf - _f32(spec["lr"]) * (d + _f32(spec["weight_decay"]) * xf)
            x.copy_(xf.view_as(x).to(x.dtype))
    return flat, momenta


class _Counter:
    """Bytes this rank sends, counted at the torch.distributed collectives, split into groups
    inside one node and groups across nodes."""

    def __init__(self, L):
        self.L, self.intra, self.inter, self.saved = L, 0, 0, {}

    def _add(self, group, nbytes):
        ranks = dist.get_process_group_ranks(group)
        if len({r // self.L for r in ranks}) > 1:
            self.inter += nbytes
        else:
            self.intra += nbytes

    def __enter__(self):
        def wrap(name, sent):
            original = getattr(dist, name)
            self.saved[name] = original

            def counted(output, input, *args, group=None, **kwargs):
                g = group if group is not None else dist.group.WORLD
                size = dist.get_world_size(g)
                self._add(g, sent(input.numel() * input.element_size(), size))
                return original(output, input, *args, group=group, **kwargs)

            setattr(dist, name, counted)

        wrap("all_to_all_single", lambda b, s: b * (s - 1) // s)
        wrap("reduce_scatter_tensor", lambda b, s: b * (s - 1) // s)
        if hasattr(dist, "reduce_scatter_single"):  # what the library calls where it exists
            wrap("reduce_scatter_single", lambda b, s: b * (s - 1) // s)
        wrap("all_gather_into_tensor", lambda b, s: b * (s - 1))
        if hasattr(dist, "all_gather_single"):
            wrap("all_gather_single", lambda b, s: b * (s - 1))
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def _momentum_storage(opt) -> int:
    """fp32 elements of the storage behind every momentum of ``opt`` (the rank's shard buffer,
    padding included), counted once per storage."""
    storages = {}
    for state in opt.state.values():
        m = state["exp_avg"]
        storages[m.untyped_storage().data_ptr()] = m.untyped_storage().nbytes()
    return sum(storages.values()) // 4


def _make(L, mode, votes, params=None, **kw):
    params = [[p.detach().clone().requires_grad_() for p in ps]
              for ps in (params or _init_params())]
    groups = [dict(params=ps, lr=g["lr"], betas=g["betas"], weight_decay=g["weight_decay"])
              for g, ps in zip(GROUPS, params)]
    return params, dk.DistributedLion(groups, mode=mode, votes=votes, hierarchy=L, **kw)


def _set_grads(params, step, rank):
    for ps, gs in zip(params, _grads(step, rank)):
        for p, g in zip(ps, gs):
            p.grad = g


def _worker(rank, n, L, variants):
    os.environ["LOCAL_WORLD_SIZE"] = str(L)
    out = {"errors": []}
    # Bad options: n not a multiple of L, nonsense; all before any step.
    for bad in (3, 0, "rack"):
        if n % 3 == 0 and bad == 3:
            continue
        try:
            _make(bad, "vote", "binary")
        except ValueError as e:
            out["errors"].append(str(e))
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    try:
        dk.register_ddp_comm_hook(ddp, dk.DistributedLion(ddp.parameters(), hierarchy=L))
    except ValueError as e:
        out["errors"].append(str(e))
    for mode, votes in variants:
        hierarchy = "node" if (mode, votes) == ("vote", "binary") else L
        params, opt = _make(hierarchy, mode, votes)
        stats, counted, saved = [], [], None
        for t in range(STEPS):
            if t == RESUME_AT:
                buf = io.BytesIO()
                torch.save(opt.state_dict(), buf)
                saved = ([[p.detach().clone() for p in ps] for ps in params], buf.getvalue())
            _set_grads(params, t, rank)
            with _Counter(L) as c:
                opt.step()
            stats.append(opt.last_stats)
            counted.append((c.intra, c.inter))
        shard = {i: (opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_range"])
                 for i, p in enumerate(p for ps in params for p in ps)}
        # Resume from the checkpoint taken at RESUME_AT on a fresh optimizer.
        params2, opt2 = _make(hierarchy, mode, votes, params=saved[0])
        opt2.load_state_dict(torch.load(io.BytesIO(saved[1]), weights_only=False))
        for t in range(RESUME_AT, STEPS):
            _set_grads(params2, t, rank)
            opt2.step()
        out[(mode, votes)] = dict(
            params=[p.detach().clone() for ps in params for p in ps], stats=stats, counted=counted,
            shard=shard, buffer=_momentum_storage(opt),
            resumed=[p.detach().clone() for ps in params2 for p in ps])

    # The functional API on full-size exp_avgs: only the rank's shard of them is used; same
    # result as the optimizer on the same tensors.
    params, _ = _make(L, "vote", "binary")
    flat = [p for ps in params for p in ps][:4]
    twin = [p.detach().clone().requires_grad_() for p in flat]
    opt = dk.DistributedLion(twin, lr=0.01, betas=(0.9, 0.99), weight_decay=0.1, hierarchy=L)
    exp_avgs = [torch.zeros(p.shape) for p in flat]
    for t in range(2):
        grads = [g for gs in _grads(t, rank) for g in gs][:4]
        dk.fused_dlion_step(flat, grads, exp_avgs, lr=0.01, betas=(0.9, 0.99),
                            weight_decay=0.1, hierarchy=L, step=t)
        for p, g in zip(twin, grads):
            p.grad = g
        opt.step()
    same = all(torch.equal(a, b) for a, b in zip(flat, twin))
    for p, m in zip(twin, exp_avgs):
        lo, hi = opt.state[p]["exp_avg_range"]
        same &= torch.equal(opt.state[p]["exp_avg"], m.reshape(-1)[lo:hi])
        same &= not m.reshape(-1)[:lo].any() and not m.reshape(-1)[hi:].any()
    out["functional"] = ([p.detach().clone() for p in flat], same)

    # Non-finite gradient on the last rank only: every rank raises (or skips), nothing changes.
    params, opt = _make(L, "vote", "binary")
    _set_grads(params, 0, rank)
    opt.step()
    before = [p.detach().clone() for ps in params for p in ps]
    moment = [opt.state[p]["exp_avg"].clone() for ps in params for p in ps]
    _set_grads(params, 1, rank)
    if rank == n - 1:
        params[1][0].grad[5] = float("nan")
    outcome = []
    try:
        opt.step()
        outcome.append("stepped")
    except dk.NonFiniteGradientError:
        outcome.append("raised")
    opt.nonfinite = "skip"
    opt.step()
    outcome.append("skipped" if opt.last_stats.skipped else "stepped")
    after = [p for ps in params for p in ps]
    outcome.append(all(torch.equal(a, b) for a, b in zip(before, after)))
    outcome.append(all(torch.equal(opt.state[p]["exp_avg"], m)
                       for p, m in zip(after, moment)))
    out["nonfinite"] = outcome
    return out


def _check(n, L, variants):
    results = run_workers(n, _worker, L, variants)
    N = n // L
    d = sum(p.numel() for ps in _init_params() for p in ps)
    k = len([p for ps in _init_params() for p in ps])
    for r, res in enumerate(results):
        errors = res["errors"]
        assert any("hierarchy must be" in e for e in errors), errors
        assert any("DDP's comm hook" in e for e in errors), errors
        if n % 3:
            assert any("multiple of the ranks per node" in e for e in errors), errors
        assert res["nonfinite"] == ["raised", "skipped", True, True], (r, res["nonfinite"])

    for mode, votes in variants:
        expect, momenta = simulate(n, L, mode, votes, STEPS)
        p_in, p_out = vote_planes(votes), aggregate_planes(mode, votes, N)
        # the wire's bytes for N voters, per rank, divided by L; padding: the sub-shard rounding
        # (at most one block per tensor and one per rank), the one-word flag and the two-word
        # [flag, step] header of the all_to_all chunks, and the step's commit.
        formula = (p_in + p_out) * (N - 1) / N * d / 8
        padding = (N - 1) * 4 * ((p_in + p_out) * (k // n + 2) + 3)
        padding += (n - 1) * 2 * 4  # the commit over all n ranks: [flag, step] each
        for r, res in enumerate(results):
            got = res[(mode, votes)]
            for e, p in zip(expect, got["params"]):
                assert torch.equal(e, p), (mode, votes, r)
            for e, p in zip(expect, got["resumed"]):
                assert torch.equal(e, p), ("resume", mode, votes, r)
            for s, (intra, inter) in zip(got["stats"], got["counted"]):
                assert (s.intra_node_bytes_sent, s.inter_node_bytes_sent) == (intra, inter)
                assert s.bytes_sent == intra + inter and (s.nodes, s.ranks_per_node) == (N, L)
                assert inter <= formula / L + padding, (inter, formula / L, padding)
                if N > 1:
                    assert inter >= formula / L * 0.9
                else:
                    assert inter == 0
            # The momentum shard: about d / L elements, and the simulation's node momentum.
            held = sum(m.numel() for m, _ in got["shard"].values())
            assert held <= d / L + 32 * (k / L + N) and got["buffer"] <= d / L + 32 * (k / L + N)
            node = r // L
            for i, (m, (lo, hi)) in got["shard"].items():
                assert torch.equal(m, momenta[node][i].reshape(-1)[lo:hi]), (i, r)
        # Inside a node the momentum shards cover every element exactly once.
        for node in range(N):
            for i in range(k):
                ranges = sorted(results[r][(mode, votes)]["shard"][i][1]
                                for r in range(node * L, (node + 1) * L))
                numel = expect[i].numel()
                covered = [x for lo, hi in ranges for x in range(lo, hi)]
                assert covered == list(range(numel))

    # Functional API: like the optimizer, the same on every rank.
    for r in range(n):
        assert results[r]["functional"][1], r
        assert all(torch.equal(a, b) for a, b in zip(results[0]["functional"][0],
                                                      results[r]["functional"][0]))


def test_hierarchy_4_ranks_2_nodes_of_2():
    _check(4, 2, VARIANTS)


def test_hierarchy_8_ranks_4_nodes_of_2():
    _check(8, 2, [("vote", "binary"), ("average", "ternary")])


def test_hierarchy_8_ranks_2_nodes_of_4():
    _check(8, 4, [("vote", "binary"), ("average", "binary")])


def test_hierarchy_options_without_process_group(monkeypatch):
    assert hier.resolve_hierarchy(None) == 1 and hier.resolve_hierarchy(1) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert hier.resolve_hierarchy("node") == 4
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        hier.resolve_hierarchy("node")
    for bad in (0, -2, True, 2.0, "nodes"):
        with pytest.raises(ValueError, match="hierarchy"):
            dk.DistributedLion([torch.zeros(3)], hierarchy=bad)
    with pytest.raises(ValueError, match="resolved once by DistributedLion"):
        hier.resolve_hierarchy("auto")
    # hierarchy=L with overlap=True works (test_hierarchy_overlap.py); "auto" does not yet
    with pytest.raises(ValueError, match="overlap=True are not combined"):
        dk.DistributedLion([torch.zeros(3)], hierarchy="auto", overlap=True)
    # "auto" on one process: nothing to choose, flat.
    assert dk.DistributedLion([torch.zeros(3)], hierarchy="auto").ranks_per_node == 1
    # L = 1 is flat D-Lion: the full-size momentum, one process.
    p = torch.nn.Parameter(torch.ones(5))
    opt = dk.DistributedLion([p], lr=0.1, hierarchy=1)
    p.grad = torch.ones(5)
    opt.step()
    assert opt.state[p]["exp_avg"].shape == (5,) and torch.equal(p.detach(), torch.full((5,), 0.9))
