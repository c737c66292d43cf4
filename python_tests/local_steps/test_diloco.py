"""dk.DiLoCo on real gloo processes (n = 2, 3, 4; n = 1 in this process): between
syncs nothing is sent and nothing changes; at each sync every rank holds the same theta_bar, equal
to the outer step computed here from the ranks' pseudo-gradients (the pure-torch reference for
D-Lion, exact; Nesterov in fp32, to rounding), with the wire format's bytes; fragments sync on their
schedule and partition the parameters; overlap_steps follows the documented merge; non-finite
pseudo-gradients; bad input."""

import pytest
import torch
import torch.distributed as dist
from conftest import assert_close_storage
from workers import run_workers

import dlion_kernels as dk
from dlion_kernels.exchange.header import HEADER_WORDS
from dlion_kernels.kernels import reference
from dlion_kernels.kernels.layout import aggregate_planes, block_offsets, vote_planes
from dlion_kernels.local_steps import fragments as frag
from dlion_kernels.local_steps.diloco import DiLoCo

LR, WD, BETAS, MU = 5e-2, 0.1, (0.9, 0.99), 0.9
COMBOS = [("dlion", "vote", "binary"), ("dlion", "vote", "ternary"),
          ("dlion", "average", "binary"), ("dlion", "average", "ternary"),
          ("nesterov", "vote", "binary")]
_COLLECTIVES = ("all_to_all_single", "all_gather_into_tensor", "all_gather_single", "all_reduce",
                "all_gather", "broadcast", "reduce_scatter_tensor",
                "reduce_scatter_single", "send", "recv", "barrier")


def _model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)  # the same initial weights on every rank
    return torch.nn.Sequential(torch.nn.Linear(7, 33), torch.nn.Tanh(),
                               torch.nn.Linear(33, 3)).to(dtype)


def _inner_step(model, inner, rank, t):
    gen = torch.Generator().manual_seed(1000 * rank + t)  # each rank its own data
    x, y = torch.randn(8, 7, generator=gen), torch.randn(8, 3, generator=gen)
    inner.zero_grad()
    torch.nn.functional.mse_loss(model(x.to(next(model.parameters()).dtype)), y).backward()
    inner.step()


def _inner(kind, model):
    if kind == "accum-adamw":
        return dk.AccumAdamW(model.parameters(), lr=1e-2, accum_steps=2)
    if kind == "accum-lion":
        return dk.AccumLion(model.parameters(), lr=1e-3)
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


class _Recorder:
    """Every torch.distributed collective called inside, in order, and the bytes this rank hands
    to the exchange's collectives (all_to_all: (n-1)/n of its input, all_gather: its input to
    each of n-1 peers)."""

    def __init__(self, n):
        self.n, self.calls, self.sent = n, [], 0

    def __enter__(self):
        self.saved = {k: getattr(dist, k) for k in _COLLECTIVES if hasattr(dist, k)}
        for name, fn in self.saved.items():
            setattr(dist, name, self._wrap(name, fn))
        return self

    def _wrap(self, name, fn):
        def call(*args, **kwargs):
            short = "all_gather" if name.startswith("all_gather") else name
            self.calls.append(short)
            if name == "all_to_all_single":
                self.sent += args[1].numel() * args[1].element_size() * (self.n - 1) // self.n
            elif short == "all_gather":
                self.sent += args[1].numel() * args[1].element_size() * (self.n - 1)
            return fn(*args, **kwargs)

        return call

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def _snap(model, diloco):
    return ([p.detach().clone() for p in model.parameters()],
            [t.clone() for t in diloco.theta_bar], [m.clone() for m in diloco.outer_momenta])


def _plain(outer: str) -> dict:
    """``outer``, with the plain 1-bit step for "dlion" (every option off): the reference here
    is the plain step's math (the default adds error feedback: test_outer_options.py)."""
    return dict(outer=outer, outer_options=dk.DLionOuterOptions() if outer == "dlion" else None)


def _run(rank, n, steps, inner_kind="adamw", **kwargs):
    """``steps`` inner steps with a DiLoCo(**kwargs); per step the state before and after
    ``diloco.step()``, the collectives it called and its stats."""
    model = _model()
    inner = _inner(inner_kind, model)
    diloco = DiLoCo(model, inner, **kwargs)
    index = {id(p): i for i, p in enumerate(model.parameters())}
    records = []
    for t in range(1, steps + 1):
        _inner_step(model, inner, rank, t)
        before = _snap(model, diloco)
        with _Recorder(n) as rec:
            stats = diloco.step()
        records.append(dict(before=before, after=_snap(model, diloco), stats=stats,
                            calls=rec.calls, counted=rec.sent, inner_step=diloco.inner_step))
    fragments = [[index[id(p)] for p in ps] for ps in diloco.fragment_params]
    return dict(records=records, fragments=fragments, bytes_sent=diloco.bytes_sent)


# ----------------------------------------------------------------------------- references


def dlion_reference(thetas, ds, moms, n, mode, votes, step, lr=LR, wd=WD, betas=BETAS):
    """The outer D-Lion step on all n ranks' pseudo-gradients ``ds`` and momenta
    ``moms`` (lists per rank of per-tensor lists), with the pure-torch reference stages:
    (theta_bar after, [momenta after per rank])."""
    ternary = votes == "ternary"
    offsets, total = block_offsets(t.numel() for t in thetas)
    stacked = torch.zeros(n, total * vote_planes(votes), dtype=torch.int32)
    for r in range(n):
        reference.local_step(ds[r], moms[r], stacked[r], offsets, betas[0], ternary)
    aggregate = torch.empty(total * aggregate_planes(mode, votes, n), dtype=torch.int32)
    reference.tally(stacked, aggregate, n, mode, ternary, step)
    theta, new_moms = None, []
    for r in range(n):  # every rank applies the same theta update and its own momentum update
        theta = [t.clone() for t in thetas]
        m = [t.clone() for t in moms[r]]
        reference.apply(theta, ds[r], m, aggregate, offsets, lr, wd, betas[1], n, mode, ternary)
        new_moms.append(m)
    return theta, new_moms


def nesterov_reference(thetas, ds, u, n, lr=LR, mu=MU):
    """DiLoCo's outer step in fp32: d = mean of the ranks' d_i, u = mu u + d,
    theta_bar -= lr (d + mu u). Returns (theta_bar, u)."""
    mean = [sum(ds[r][i] for r in range(n)) / n for i in range(len(thetas))]
    new_u = [mu * a + d for a, d in zip(u, mean)]
    return [t - lr * (d + mu * a) for t, d, a in zip(thetas, mean, new_u)], new_u


def spec_bound(n, mode, votes, d, tensors):
    """The wire's bytes per rank plus the padding: a word per tensor and per rank in each plane,
    and the two-word header to each peer."""
    p_in, p_out = vote_planes(votes), aggregate_planes(mode, votes, n)
    return ((n - 1) / n * (p_in + p_out) * d / 8 + 4 * (p_in + p_out) * (tensors + n)
            + 4 * HEADER_WORDS * (n - 1))


def _pseudo(before, idx):
    """d_i = theta_bar - theta_i of the tensors ``idx`` from a snapshot (params, theta, mom)."""
    return [before[1][i] - before[0][i] for i in idx]


def check_outer_step(ranks, t, idx, start, outer, mode, votes, n):
    """At record ``t`` (applied), fragment tensors ``idx`` of every rank hold the outer step
    computed from the ranks' snapshots at the sync ``start``: theta_bar (and D-Lion's momenta)
    exactly, Nesterov's to rounding; bit-identical on every rank."""
    at_start = [r["records"][start - 1]["before"] for r in ranks]
    at_apply = [r["records"][t - 1]["before"] for r in ranks]
    ds = [_pseudo(s, idx) for s in at_start]
    thetas = [at_apply[0][1][i] for i in idx]
    if outer == "dlion":
        moms = [[s[2][i] for i in idx] for s in at_apply]
        exp_theta, exp_moms = dlion_reference(thetas, ds, moms, n, mode, votes, start)
        for r, rank in enumerate(ranks):
            for k, i in enumerate(idx):
                assert_close_storage(rank["records"][t - 1]["after"][1][i], exp_theta[k])
                assert torch.equal(rank["records"][t - 1]["after"][2][i], exp_moms[r][k])
    else:
        u = [at_apply[0][2][i] for i in idx]
        exp_theta, exp_u = nesterov_reference(thetas, ds, u, n)
        for rank in ranks:
            after = rank["records"][t - 1]["after"]
            for k, i in enumerate(idx):
                torch.testing.assert_close(after[1][i], exp_theta[k], rtol=1e-5, atol=1e-7)
                torch.testing.assert_close(after[2][i], exp_u[k], rtol=1e-5, atol=1e-7)
    for rank in ranks[1:]:
        for i in idx:
            assert torch.equal(rank["records"][t - 1]["after"][1][i],
                               ranks[0]["records"][t - 1]["after"][1][i])


def _unchanged(record, idx):
    before, after = record["before"], record["after"]
    for k in range(3):
        for i in idx:
            assert torch.equal(before[k][i], after[k][i])


# ----------------------------------------------------------------------------- whole model


H, STEPS = 3, 7


def _reference_worker(rank, n):
    out = {}
    for outer, mode, votes in COMBOS:
        inner_kind = ("accum-adamw" if outer == "nesterov" else
                      "accum-lion" if (mode, votes) == ("average", "binary") else "adamw")
        out[outer, mode, votes] = _run(
            rank, n, STEPS, inner_kind, sync_every=H, **_plain(outer), outer_lr=LR,
            outer_betas=BETAS, outer_weight_decay=WD if outer == "dlion" else 0.0,
            outer_momentum=MU, mode=mode, votes=votes)
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_syncs_match_the_reference(n):
    ranks = [_reference_worker(0, 1)] if n == 1 else run_workers(n, _reference_worker)
    idx = list(range(4))
    numel = sum(p.numel() for p in _model().parameters())
    for outer, mode, votes in COMBOS:
        runs = [r[outer, mode, votes] for r in ranks]
        for t in range(1, STEPS + 1):
            recs = [run["records"][t - 1] for run in runs]
            if t % H:  # between syncs: nothing sent, nothing changed
                for rec in recs:
                    assert rec["stats"] is None and rec["calls"] == []
                    _unchanged(rec, idx)
                continue
            check_outer_step(runs, t, idx, t, outer, mode, votes, n)
            for rec in recs:
                params, theta, _ = rec["after"]
                for p, x in zip(params, theta):  # theta_i = theta_bar, bit for bit
                    assert torch.equal(p, x)
                s = rec["stats"]
                assert (s.step, s.applied_step, s.fragment, s.outer, s.numel, s.world_size,
                        s.skipped) == (t, t, 0, outer, numel, n, False)
                if outer == "dlion":
                    assert (s.mode, s.votes) == (mode, votes)
                    assert rec["calls"] == ([] if n == 1 else ["all_to_all_single",
                                                               "all_gather"])
                    assert s.bytes_sent == s.bytes_received == rec["counted"]
                    assert s.bytes_sent <= spec_bound(n, mode, votes, numel, len(idx))
                else:
                    assert rec["calls"] == ([] if n == 1 else ["all_reduce"])
                    # the fp32 all-reduce carries 2 step words per rank (the step check)
                    assert s.bytes_sent == round(2 * (n - 1) / n * 4 * (numel + 2 * n))
        assert runs[0]["bytes_sent"] == sum(
            rec["stats"].bytes_sent for rec in runs[0]["records"] if rec["stats"])


# ----------------------------------------------------------------------------- fragments


FRAGMENT_CASES = [  # (sync_every, fragments, overlap_steps, merge_alpha)
    (8, 4, 0, 0.5), (8, 2, 2, 0.5), (8, 1, 3, 1.0), (4, 2, 1, 0.0)]


def _fragments_worker(rank, n):
    out = {}
    for outer in ("dlion", "nesterov"):
        for h, p, tau, alpha in FRAGMENT_CASES:
            out[outer, h, p, tau, alpha] = _run(
                rank, n, 2 * h + tau + 1, sync_every=h, **_plain(outer), outer_lr=LR,
                outer_betas=BETAS, outer_weight_decay=WD if outer == "dlion" else 0.0,
                fragments=p, overlap_steps=tau, merge_alpha=alpha, mode="average",
                votes="ternary")
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_fragments_and_overlap(n):
    """Each fragment syncs at t mod H == ((f + 1) H / P) mod H and only it changes; with
    overlap_steps tau its exchange starts at t (nothing changes then) and is applied at t + tau:
    theta_bar as the reference computes from the pseudo-gradients taken at t, and the fragment's
    parameters lerp(theta_bar, theta_i, merge_alpha) of their values at t + tau."""
    ranks = run_workers(n, _fragments_worker)
    numels = [p.numel() for p in _model().parameters()]
    for outer, h, p, tau, alpha in ranks[0]:
        runs = [r[outer, h, p, tau, alpha] for r in ranks]
        cuts = [list(c) for c in frag.split(numels, p)]
        assert all(run["fragments"] == cuts for run in runs)  # the parameters, partitioned
        pending = None  # tau > 0: (start step, fragment) of the exchange in flight
        for t in range(1, len(runs[0]["records"]) + 1):
            recs = [run["records"][t - 1] for run in runs]
            starting = [f for f in range(p) if t % h == (f + 1) * h // p % h]
            if tau == 0 and starting:
                _check_applied(runs, t, t, starting[0], cuts, outer, tau, alpha, n)
            elif pending is not None and t == pending[0] + tau:
                assert not starting  # tau < H / P: applied before the next fragment starts
                _check_applied(runs, t, *pending, cuts, outer, tau, alpha, n)
                pending = None
            else:
                for rec in recs:  # nothing changes; only a starting exchange is issued
                    assert rec["stats"] is None
                    assert rec["calls"] == ([] if not starting else ["all_to_all_single"]
                                            if outer == "dlion" else ["all_reduce"])
                    _unchanged(rec, range(len(numels)))
                if starting:
                    assert pending is None
                    pending = (t, starting[0])


def _check_applied(runs, t, start, f, cuts, outer, tau, alpha, n):
    idx = cuts[f]
    check_outer_step(runs, t, idx, start, outer, "average", "ternary", n)
    others = [i for c in cuts for i in c if i not in idx]
    for run in runs:
        rec = run["records"][t - 1]
        _unchanged(rec, others)
        s = rec["stats"]
        assert (s.step, s.applied_step, s.fragment, s.skipped) == (start, t, f, False)
        assert s.numel == sum(rec["after"][1][i].numel() for i in idx)
        params, theta, _ = rec["after"]
        for i in idx:
            if tau == 0:
                assert torch.equal(params[i], theta[i])
            else:  # the merge of the module docstring, on this rank's values at t
                assert torch.equal(params[i], torch.lerp(theta[i], rec["before"][0][i], alpha))
        if tau:  # D-Lion's second collective; Nesterov's all-reduce ran in the background
            assert rec["calls"] == (["all_gather"] if outer == "dlion" else [])


# ----------------------------------------------------------------------------- non-finite


def _nonfinite_worker(rank, n):
    out = {}
    for outer in ("dlion", "nesterov"):
        for policy in ("raise", "skip"):
            model = _model()
            inner = _inner("adamw", model)
            diloco = DiLoCo(model, inner, sync_every=2, **_plain(outer), outer_lr=LR,
                            nonfinite=policy)
            res = dict(error=None)
            for t in range(1, 7):
                _inner_step(model, inner, rank, t)
                if t == 4 and rank == 1:  # rank 1's local model diverged in this window
                    with torch.no_grad():
                        next(model.parameters())[0, 0] = float("nan")
                before = _snap(model, diloco)
                try:
                    stats = diloco.step()
                except dk.NonFiniteGradientError as e:
                    res.update(error=str(e), before=before, after=_snap(model, diloco),
                               inner_step=diloco.inner_step)
                    break
                if t == 4:
                    res.update(before=before, after=_snap(model, diloco), stats=stats)
            res["final"] = _snap(model, diloco)
            out[outer, policy] = res
    return out


def test_nonfinite_pseudo_gradient():
    """A NaN in one rank's local model: "raise" raises on every rank with nothing modified;
    "skip" drops the sync on every rank (theta_bar and momenta unchanged) and returns both ranks
    to theta_bar, and the next sync works."""
    ranks = run_workers(2, _nonfinite_worker)
    for outer in ("dlion", "nesterov"):
        for rank in (0, 1):
            res = ranks[rank][outer, "raise"]
            assert res["error"] and "inner step 4" in res["error"] and "inf or NaN" in \
                res["error"]
            assert res["inner_step"] == 3
            for k in range(3):  # rank 1's NaN stays where it was
                for a, b in zip(res["before"][k], res["after"][k]):
                    assert torch.equal(a.isnan(), b.isnan())
                    assert torch.equal(a.nan_to_num(), b.nan_to_num())
            res = ranks[rank][outer, "skip"]
            assert res["error"] is None and res["stats"].skipped
            before, after = res["before"], res["after"]
            for k in (1, 2):  # theta_bar, momenta
                for a, b in zip(before[k], after[k]):
                    assert torch.equal(a, b)
            for p, x in zip(after[0], after[1]):
                assert torch.equal(p, x)
            for p in res["final"][0]:  # synced again at step 6, finite and equal on both ranks
                assert p.isfinite().all()
        for a, b in zip(ranks[0][outer, "skip"]["final"][0], ranks[1][outer, "skip"]["final"][0]):
            assert torch.equal(a, b)


# ----------------------------------------------------------------------------- bad input


def _start_worker(rank, n):
    out = {}
    model = _model()
    if rank == 1:
        with torch.no_grad():
            model[0].bias[3] += 1e-6
    saved = [p.detach().clone() for p in model.parameters()]
    try:
        DiLoCo(model, _inner("adamw", model), sync_every=4)
    except ValueError as e:
        out["weights"] = str(e)
    out["untouched"] = all(torch.equal(a, p) for a, p in zip(saved, model.parameters()))
    model = _model()
    try:
        DiLoCo(model, _inner("adamw", model), sync_every=4 if rank == 0 else 8)
    except ValueError as e:
        out["config"] = str(e)
    model = _model()
    out["ok"] = DiLoCo(model, _inner("adamw", model), sync_every=4).world_size
    return out


def test_ranks_must_start_alike():
    """Parameters (one element off by 1e-6) or arguments that differ between ranks at
    construction: ValueError on every rank, nothing modified."""
    ranks = run_workers(2, _start_worker)
    for res in ranks:
        assert "ranks [1] differ from rank 0's" in res["weights"] and res["untouched"]
        assert "ranks [1] sync_every=8; rank 0 sync_every=4" in res["config"]
        assert res["ok"] == 2


def test_bad_input_changes_nothing():
    model = _model()
    inner = _inner("adamw", model)
    _inner_step(model, inner, 0, 1)
    saved = [p.detach().clone() for p in model.parameters()]
    inner_state = repr(inner.state_dict())
    other = torch.nn.Linear(2, 2)
    cases = [
        (dict(sync_every=6, fragments=4), "sync_every .6. must be a multiple of fragments"),
        (dict(sync_every=8, fragments=2, overlap_steps=4), "overlap_steps must be < "
         "sync_every / fragments = 4"),
        (dict(sync_every=8, fragments=5), "must be a multiple of fragments"),
        (dict(sync_every=10, fragments=5), "fragments must be at most the number of trainable"),
        (dict(sync_every=0), "sync_every must be an int >= 1"),
        (dict(sync_every=2.0), "sync_every must be an int >= 1"),
        (dict(sync_every=4, overlap_steps=-1), "overlap_steps must be an int >= 0"),
        (dict(sync_every=4, outer="adam"), "outer must be one of"),
        (dict(sync_every=4, outer_lr=-1.0), "lr must be a finite number >= 0"),
        (dict(sync_every=4, outer_lr=float("nan")), "lr must be a finite number >= 0"),
        (dict(sync_every=4, outer_betas=(0.9, 1.0)), "betas must be a pair of numbers in"),
        (dict(sync_every=4, outer_weight_decay=-0.1), "weight_decay must be a finite number"),
        (dict(sync_every=4, outer="nesterov", outer_momentum=1.0), "outer_momentum must be a "
         "number in .0, 1."),
        (dict(sync_every=4, overlap_steps=1, merge_alpha=1.5), "merge_alpha must be a number"),
        (dict(sync_every=4, mode="majority"), "mode must be one of"),
        (dict(sync_every=4, votes="one-bit"), "votes must be one of"),
        (dict(sync_every=4, backend="fortran"), "backend must be one of"),
        (dict(sync_every=4, nonfinite="ignore"), "nonfinite must be one of"),
        (dict(sync_every=4, timeout=-3), "timeout must be"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            DiLoCo(model, inner, **kwargs)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        DiLoCo(list(model.parameters()), inner, sync_every=4)
    with pytest.raises(TypeError, match="inner_optimizer must be a torch.optim.Optimizer"):
        DiLoCo(model, None, sync_every=4)
    foreign = torch.optim.SGD(list(model.parameters()) + list(other.parameters()), lr=0.1)
    with pytest.raises(ValueError, match="not one of model's parameters"):
        DiLoCo(model, foreign, sync_every=4)
    partial = torch.optim.SGD(model[0].parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"missing: \['2.weight', '2.bias'\]"):
        DiLoCo(model, partial, sync_every=4)
    for p, s in zip(model.parameters(), saved):
        assert torch.equal(p, s)
    assert repr(inner.state_dict()) == inner_state


def test_frozen_parameters_are_left_out():
    """requires_grad=False at construction: not synced, not touched (as torch optimizers)."""
    model = _model()
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    inner = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    diloco = DiLoCo(model, inner, sync_every=2, **_plain("dlion"), outer_lr=LR)
    assert [t.shape for t in diloco.theta_bar] == [(33,), (3, 33), (3,)]
    for t in range(1, 5):
        _inner_step(model, inner, 0, t)
        diloco.step()
    assert torch.equal(model[0].weight, frozen)
    for p, x in zip([p for p in model.parameters() if p.requires_grad], diloco.theta_bar):
        assert torch.equal(p, x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_parameters(dtype):
    """theta_bar stays fp32; at a sync the parameters take it rounded to their dtype."""
    model = _model(dtype=dtype)
    inner = torch.optim.SGD(model.parameters(), lr=1e-2)
    for outer in ("dlion", "nesterov"):
        diloco = DiLoCo(model, inner, sync_every=2, **_plain(outer), outer_lr=LR)
        for t in range(1, 5):
            _inner_step(model, inner, 0, t)
            diloco.step()
        assert all(x.dtype == torch.float32 for x in diloco.theta_bar)
        for p, x in zip(model.parameters(), diloco.theta_bar):
            assert p.dtype == dtype and torch.equal(p, x.to(dtype))
