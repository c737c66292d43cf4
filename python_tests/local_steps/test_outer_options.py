"""DiLoCo's D-Lion outer options (error feedback, a per-tensor scale, thresholded ternary votes) on
3 real gloo processes, in one launch: at every sync all ranks hold the same theta_bar, equal to
an outer step computed here in plain torch from the ranks' snapshots (exact), with each rank's
momentum and residual; the bytes are the exchange's plus 4 bytes per tensor per peer for the
scale; options all off is the plain step bit for bit; a non-finite pseudo-gradient raises (or
skips) on every rank with nothing changed; a resume mid-window, at a sync and inside an overlap
window is exact. Bad input is refused in this process with nothing changed."""

import copy
import math

import pytest
import torch
from outer_runs import (
    BETAS,
    WD,
    H,
    check_resumes_exact,
    inner_optimizer,
    resumed_runs,
    run,
    syncs_of,
)
from test_diloco import LR, _inner_step, _model, check_outer_step
from workers import run_workers

from dlion_kernels.kernels.layout import HEADER_WORDS, aggregate_planes, block_offsets
from dlion_kernels.local_steps import fragments as frag
from dlion_kernels.local_steps.diloco import DiLoCo
from dlion_kernels.local_steps.outer_options import DLionOuterOptions, SparseLoCoOptions

N, STEPS = 3, 7

# name -> DiLoCo keywords (every one with outer="dlion")
CONFIGS = {
    "ef": dict(outer_options=DLionOuterOptions(error_feedback=True), outer_lr=2e-2),
    "scale": dict(outer_options=dict(scale=True), outer_lr=0.5),
    "threshold": dict(outer_options=DLionOuterOptions(threshold=0.5), votes="ternary",
                      outer_lr=2e-2),
    "ef-scale-average": dict(outer_options=DLionOuterOptions(error_feedback=True, scale=True),
                             mode="average", outer_lr=0.5),
    "all-average-ternary": dict(outer_options=DLionOuterOptions(True, True, 0.3),
                                mode="average", votes="ternary", outer_lr=0.5),
    "ef-scale-fragments": dict(outer_options=DLionOuterOptions(error_feedback=True, scale=True),
                               outer_lr=0.5, fragments=3, sync_every=6),
    "ef-decay": dict(outer_options=DLionOuterOptions(error_feedback=True, ef_decay=0.9),
                     outer_lr=2e-2),
    "ef-decay-scale-fragments": dict(outer_options=dict(error_feedback=True, scale=True,
                                                        ef_decay=0.5),
                                     outer_lr=0.5, fragments=2, sync_every=4),
}


# ----------------------------------------------------------------------------- references


def reference(before, idx, n, opts, mode="vote", votes="binary", outer_lr=0.0, wd=WD,
              betas=BETAS, **_):
    """The outer step with options, plainly, from every rank's snapshot before the sync (its
    pseudo-gradient, momentum and residual): (theta_bar, [momenta], [residuals]) per rank."""
    b1, b2 = betas
    theta = [before[0][1][i] for i in idx]
    ps, cs = [], []
    for r in range(n):
        params, _, moms, res = before[r]
        d = [theta[k] - params[i] for k, i in enumerate(idx)]
        p = [x + res[i] for x, i in zip(d, idx)] if opts.error_feedback else d
        cs.append([moms[i] * b1 + p[k] * (1.0 - b1) for k, i in enumerate(idx)])
        ps.append(p)
    votes_of = []
    for c in cs:
        if votes == "binary":
            votes_of.append([torch.where(x > 0, 1.0, -1.0) for x in c])
        else:
            v = []
            for x in c:
                keep = x.abs() >= x.abs().mean() * opts.threshold if opts.threshold else \
                    torch.ones_like(x, dtype=torch.bool)
                v.append(torch.where(keep, torch.sign(x), 0.0))
            votes_of.append(v)
    out_theta, out_m, out_e = [], [[] for _ in range(n)], [[] for _ in range(n)]
    for k, i in enumerate(idx):
        total = sum(votes_of[r][k] for r in range(n))
        D = torch.sign(total) if mode == "vote" else total / n
        if opts.scale:
            s = ps[0][k].abs().mean()
            for r in range(1, n):
                s = s + ps[r][k].abs().mean()
            D = D * (s / n)
        out_theta.append(theta[k] - (D + theta[k] * wd) * outer_lr)
        for r in range(n):
            e = ps[r][k] - D * outer_lr
            out_e[r].append(e * opts.ef_decay if opts.ef_decay < 1.0 else e)
            out_m[r].append(before[r][2][i] * b2 + ps[r][k] * (1.0 - b2))
    return out_theta, out_m, out_e


def exchange_bytes(numels, n, mode, votes, scale):
    """The D-Lion exchange's bytes per rank for tensors of ``numels`` (an all_to_all of the
    header and n shards of packed votes, an all_gather of the tallied shard), plus the scales'
    all_gather of 4 bytes per tensor to each peer."""
    blocks = block_offsets(numels)[1]
    shard = max(1, math.ceil(blocks / n))
    p_in = 1 if votes == "binary" else 2
    sent = (n - 1) * (HEADER_WORDS + shard * p_in) * 4
    sent += (n - 1) * shard * aggregate_planes(mode, votes, n) * 4
    return sent + (4 * len(numels) * (n - 1) if scale else 0)


def check_sync(ranks, t, idx, n, cfg):
    """Record ``t`` of every rank is a sync of tensors ``idx``: theta_bar, momenta and residuals
    equal the reference exactly, theta_bar bit-identical on every rank."""
    opts = cfg["outer_options"]
    opts = DLionOuterOptions(**opts) if isinstance(opts, dict) else opts
    before = [r["records"][t - 1]["before"] for r in ranks]
    theta, moms, res = reference(before, idx, n, opts, **cfg)
    for r, rank in enumerate(ranks):
        after = rank["records"][t - 1]["after"]
        for k, i in enumerate(idx):
            assert torch.equal(after[1][i], theta[k]), (t, r, i)
            assert torch.equal(after[2][i], moms[r][k]), (t, r, i)
            if opts.error_feedback:
                assert torch.equal(after[3][i], res[r][k]), (t, r, i)
            assert torch.equal(after[0][i], after[1][i])  # the parameters are theta_bar
        assert all(torch.equal(a, b) for a, b in zip(after[1], ranks[0]["records"][t - 1]
                                                     ["after"][1]))


# ----------------------------------------------------------------------------- workers


def _worker(rank, n):
    out = {name: run(rank, n, STEPS, **cfg) for name, cfg in CONFIGS.items()}
    # options all off, as a dataclass or a dict: the plain step; no options: the default,
    # error feedback halved at every sync
    out["plain"] = run(rank, n, STEPS, outer_lr=LR, outer_options=DLionOuterOptions())
    out["off-dict"] = run(rank, n, STEPS, outer_lr=LR, outer_options={})
    out["default"] = run(rank, n, STEPS, outer_lr=LR)
    out["ef-decay-0.5"] = run(rank, n, STEPS, outer_lr=LR, outer_options=DLionOuterOptions(
        error_feedback=True, ef_decay=0.5))
    on = dict(outer_options=DLionOuterOptions(error_feedback=True, scale=True), outer_lr=0.5)
    out["nan-raise"] = run(rank, n, STEPS, poison=(3, 1), **on)
    out["nan-skip"] = run(rank, n, STEPS, poison=(3, 1), nonfinite="skip", **on)
    out["resume"] = resumed_runs(rank, n, [
        ("ef-scale", dict(on, sync_every=4), (2, 4)),
        ("ef-threshold", dict(outer_options=DLionOuterOptions(True, False, 0.5),
                              votes="ternary", outer_lr=2e-2, sync_every=4), (2, 4)),
        ("ef-scale-overlap", dict(on, sync_every=4, overlap_steps=1), (4, 5)),
        ("ef-decay", dict(CONFIGS["ef-decay"], sync_every=4), (2, 4))])
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_workers(N, _worker)


def _syncs(cfg, steps=STEPS):
    h = cfg.get("sync_every", H)
    P = cfg.get("fragments", 1)
    return [(t, frag.due(t, h, P)) for t in range(1, steps + 1)
            if frag.due(t, h, P) is not None]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_each_sync_equals_the_reference_on_every_rank(ranks, name):
    cfg = CONFIGS[name]
    syncs = _syncs(cfg)
    assert len(syncs) >= 2
    for t, f in syncs:
        idx = ranks[0][name]["fragments"][f]
        check_sync([r[name] for r in ranks], t, idx, N, cfg)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_bytes_per_sync_are_the_exchange_plus_the_scales(ranks, name):
    cfg = CONFIGS[name]
    opts = cfg["outer_options"]
    scale = opts["scale"] if isinstance(opts, dict) else opts.scale
    numels = [p.numel() for p in _model().parameters()]
    for rank in ranks:
        rec = rank[name]
        for r, sizes in syncs_of(rec, dict(_syncs(cfg)), numels):
            want = exchange_bytes(sizes, N, cfg.get("mode", "vote"), cfg.get("votes", "binary"),
                                  scale)
            assert r["stats"].bytes_sent == want == r["counted"]
        assert "outer_options" in rec["keys"]


def _same_runs(a_run, b_run) -> None:
    a, b = a_run["records"], b_run["records"]
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for k in range(3):
            assert all(torch.equal(u, v) for u, v in zip(x["after"][k], y["after"][k]))
        assert x["counted"] == y["counted"]
    assert a_run["keys"] == b_run["keys"]


def test_options_off_is_the_plain_step_and_none_the_default_bit_for_bit(ranks):
    for rank in ranks:
        _same_runs(rank["plain"], rank["off-dict"])
        assert "outer_options" not in rank["plain"]["keys"]
        _same_runs(rank["default"], rank["ef-decay-0.5"])
        assert "outer_options" in rank["default"]["keys"]
    # and the plain step is the D-Lion outer step (the reference of test_diloco.py)
    for t in (3, 6):
        check_outer_step([dict(records=[dict(before=r["before"][:3], after=r["after"][:3])
                                        for r in rank["plain"]["records"]]) for rank in ranks],
                         t, list(range(4)), t, "dlion", "vote", "binary", N)


def test_nonfinite_raises_or_skips_on_every_rank_with_nothing_changed(ranks):
    for rank in ranks:
        raised = rank["nan-raise"]["records"]
        assert len(raised) == 3 and raised[-1]["error"] and "inf or NaN" in raised[-1]["error"]
        before, after = raised[-1]["before"], raised[-1]["after"]
        for k in (1, 2, 3):
            assert all(torch.equal(x, y) for x, y in zip(before[k], after[k]))
        skipped = rank["nan-skip"]["records"]
        assert skipped[2]["stats"].skipped and skipped[2]["error"] is None
        before, after = skipped[2]["before"], skipped[2]["after"]
        for k in (1, 2, 3):
            assert all(torch.equal(x, y) for x, y in zip(before[k], after[k]))
        assert all(torch.equal(p, t) for p, t in zip(after[0], after[1]))  # back to theta_bar
    cfg = dict(outer_options=DLionOuterOptions(error_feedback=True, scale=True), outer_lr=0.5)
    check_sync([r["nan-skip"] for r in ranks], 6, list(range(4)), N, cfg)  # the next sync


@pytest.mark.parametrize("name", ["ef-scale", "ef-threshold", "ef-scale-overlap", "ef-decay"])
def test_resume_is_exact(ranks, name):
    # params, theta_bar, momenta, residuals (non-zero)
    check_resumes_exact(ranks, name, parts=4, nonzero=3)


# ----------------------------------------------------------------------------- bad input


def _single(**kwargs):
    model = _model()
    inner = inner_optimizer(model)
    return model, inner, DiLoCo(model, inner, sync_every=2, **kwargs)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(outer_options=DLionOuterOptions(threshold=0.5)), ValueError, "votes='ternary'"),
    (dict(outer_options={"threshold": 0.5}, votes="binary"), ValueError, "votes='ternary'"),
    (dict(outer_options={"bogus": 1}), TypeError, "outer_options"),
    (dict(outer_options=SparseLoCoOptions()), TypeError, "DLionOuterOptions"),
    (dict(outer_options=[True]), TypeError, "outer_options"),
    (dict(outer="nesterov", outer_options=DLionOuterOptions(True)), ValueError,
     "outer_options"),
])
def test_bad_arguments_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        _single(**kwargs)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(threshold=-1.0), ValueError, "threshold"),
    (dict(threshold=float("nan")), ValueError, "threshold"),
    (dict(error_feedback=1), TypeError, "error_feedback"),
    (dict(scale="yes"), TypeError, "scale"),
    (dict(error_feedback=True, ef_decay=0.0), ValueError, "ef_decay"),
    (dict(error_feedback=True, ef_decay=1.5), ValueError, "ef_decay"),
    (dict(error_feedback=True, ef_decay=float("nan")), ValueError, "ef_decay"),
    (dict(error_feedback=True, ef_decay=True), ValueError, "ef_decay"),
    (dict(ef_decay=0.9), ValueError, "error_feedback=True"),
])
def test_bad_options_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        DLionOuterOptions(**kwargs)


def _state(diloco):
    return copy.deepcopy((diloco.inner_step, [t.clone() for t in diloco.theta_bar],
                          [m.clone() for m in diloco.outer_momenta],
                          None if diloco.outer_residuals is None else
                          [r.clone() for r in diloco.outer_residuals]))


def _equal_state(a, b):
    assert a[0] == b[0]
    for k in (1, 2):
        assert all(torch.equal(x, y) for x, y in zip(a[k], b[k]))
    assert (a[3] is None) == (b[3] is None)
    if a[3] is not None:
        assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a[3], b[3]))


def test_a_checkpoint_of_other_options_is_refused_with_nothing_changed():
    ef = dict(outer_options=DLionOuterOptions(error_feedback=True), outer_lr=2e-2)
    model, inner, with_ef = _single(**ef)
    for t in range(1, 5):
        _inner_step(model, inner, 0, t)
        with_ef.step()
    saved = with_ef.state_dict()
    assert any(bool((r != 0).any()) for r in saved["outer_options"]["residual"])
    _, _, plain = _single(outer_lr=2e-2)
    _, _, scaled = _single(outer_options=DLionOuterOptions(scale=True), outer_lr=2e-2)
    _, _, fresh = _single(**ef)
    for target, state, match in [
            (plain, saved, "outer_options"),
            (scaled, saved, "outer_options"),
            (fresh, plain.state_dict(), "outer_options"),
            (fresh, dict(saved, outer_options=dict(saved["outer_options"],
                                                   residual=[torch.zeros(3)])), "residual"),
            (fresh, dict(saved, outer_options=dict(saved["outer_options"],
                                                   residual=[None])), "residual")]:
        before = _state(target)
        with pytest.raises(ValueError, match=match):
            target.load_state_dict(state)
        _equal_state(before, _state(target))
    fresh.load_state_dict(saved)  # and the right one loads
    _equal_state(_state(with_ef), _state(fresh))


@pytest.mark.parametrize("outer, opts", [
    ("dlion", DLionOuterOptions(error_feedback=True, scale=True)),
    ("sparseloco", SparseLoCoOptions(chunk=16, topk=3))])
def test_save_state_round_trip_carries_the_option_state(tmp_path, outer, opts):
    import dlion_kernels as dk

    model, inner, diloco = _single(outer=outer, outer_options=opts, outer_lr=0.5)
    for t in range(1, 6):
        _inner_step(model, inner, 0, t)
        diloco.step()
    dk.save_state(diloco, str(tmp_path))
    _, _, fresh = _single(outer=outer, outer_options=opts, outer_lr=0.5)
    dk.load_state(fresh, str(tmp_path))
    a, b = diloco.state_dict(), fresh.state_dict()
    assert a["inner_step"] == b["inner_step"] == 5
    for key in ("theta_bar", "momentum"):
        assert all(torch.equal(x, y) for x, y in zip(a[key], b[key]))
    for x, y in zip(a["outer_options"]["residual"], b["outer_options"]["residual"]):
        assert (x is None and y is None) or torch.equal(x, y)
