"""DiLoCo(outer="sparseloco"), the SparseLoCo baseline, on 3 real gloo processes in one launch: at
every sync all ranks hold the same theta_bar, equal to SparseLoCo's step computed here in plain
torch from the ranks' snapshots (top-k per run, the 2-bit values, the mean, error feedback in the
accumulator; exact); the bytes are the payload's to each peer; a non-finite pseudo-gradient raises
(or skips) on every rank with nothing changed; a resume mid-window, at a sync and inside an overlap
window is exact. Bad settings are refused in this process."""

import math

import pytest
import torch
from outer_runs import check_resumes_exact, resumed_runs, run, syncs_of
from test_diloco import _inner_step, _model
from workers import run_workers

from dlion_kernels.local_steps import fragments as frag
from dlion_kernels.local_steps.outer_options import SparseLoCoOptions

N, STEPS = 3, 7
CONFIGS = {
    "small-runs": dict(outer_options=SparseLoCoOptions(chunk=16, topk=3, ef_decay=0.95),
                       outer_lr=1.0, outer_weight_decay=0.0, sync_every=3),
    "wd-fragments": dict(outer_options=dict(chunk=64, topk=5, ef_decay=0.9), outer_lr=0.8,
                         outer_weight_decay=0.1, fragments=2, sync_every=4),
    # C = 4096, k = 64, beta = 0.95, lr 1: one run per tensor
    "defaults": dict(sync_every=3, outer_weight_decay=0.0),
}


def _opts(cfg):
    o = cfg.get("outer_options", SparseLoCoOptions())
    return SparseLoCoOptions(**o) if isinstance(o, dict) else o


def reference(before, idx, n, cfg):
    """SparseLoCo's step, plainly, from every rank's snapshot before the sync:
    (theta_bar, [accumulators]) per tensor and rank."""
    o = _opts(cfg)
    lr, wd = cfg.get("outer_lr", 1.0), cfg.get("outer_weight_decay", 0.0)
    theta = [before[0][1][i] for i in idx]
    sent, accs = [], []
    for r in range(n):
        params, _, moms, _ = before[r]
        q_r, a_r = [], []
        for k, i in enumerate(idx):
            a = (moms[i] * o.ef_decay + (theta[k] - params[i])).reshape(-1)
            keep = []
            for start in range(0, a.numel(), o.chunk):
                part = a[start: start + o.chunk]
                kr = o.topk if part.numel() == o.chunk else \
                    math.ceil(o.topk * part.numel() / o.chunk)
                keep.append(torch.topk(part.abs(), kr).indices + start)
            where = torch.cat(keep)
            values = a[where]
            mag = values.abs()
            high = mag >= mag.mean()
            lo = mag[~high].mean() if (~high).any() else torch.tensor(0.0)
            hi = mag[high].mean() if high.any() else torch.tensor(0.0)
            level = torch.where(high, hi, lo)
            q = torch.zeros_like(a)
            q[where] = torch.where(values < 0, -level, level)
            q_r.append(q.view_as(moms[i]))
            a_r.append((a - q).view_as(moms[i]))
        sent.append(q_r)
        accs.append(a_r)
    out = []
    for k in range(len(idx)):
        total = torch.zeros_like(theta[k])
        for r in range(n):
            total = total + sent[r][k]
        mean = total / n
        step = mean + theta[k] * wd if wd else mean
        out.append(theta[k] - step * lr)
    return out, accs


def payload_bytes(numels, opts):
    """One rank's payload: the 8-byte header, two fp32 magnitudes per tensor, a 16-bit offset and
    a 2-bit code per kept element; K kept = k per full run of C, ceil(k r / C) of a run of r."""
    K = 0
    for numel in numels:
        K += (numel // opts.chunk) * opts.topk
        if numel % opts.chunk:
            K += math.ceil(opts.topk * (numel % opts.chunk) / opts.chunk)
    return 8 + 8 * len(numels) + 2 * K + math.ceil(K / 4)


def _worker(rank, n):
    out = {name: run(rank, n, STEPS, outer="sparseloco", **cfg) for name, cfg in CONFIGS.items()}
    base = dict(outer="sparseloco", outer_options=SparseLoCoOptions(chunk=16, topk=3),
                sync_every=3, outer_weight_decay=0.0)
    out["nan-raise"] = run(rank, n, STEPS, poison=(3, 1), **base)
    out["nan-skip"] = run(rank, n, STEPS, poison=(3, 1), nonfinite="skip", **base)
    # resume_run sets the outer weight decay itself
    resumable = {k: v for k, v in base.items() if k != "outer_weight_decay"}
    out["resume"] = resumed_runs(rank, n, [
        ("plain", dict(resumable, sync_every=4), (2, 4)),
        ("overlap", dict(resumable, sync_every=4, overlap_steps=1), (4, 5))])
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_workers(N, _worker)


def _syncs(cfg):
    h, P = cfg["sync_every"], cfg.get("fragments", 1)
    return {t: frag.due(t, h, P) for t in range(1, STEPS + 1) if frag.due(t, h, P) is not None}


def _check(ranks, t, idx, cfg):
    before = [r["records"][t - 1]["before"] for r in ranks]
    theta, accs = reference(before, idx, N, cfg)
    for r, rank in enumerate(ranks):
        after = rank["records"][t - 1]["after"]
        for k, i in enumerate(idx):
            assert torch.equal(after[1][i], theta[k]), (t, r, i)
            assert torch.equal(after[2][i], accs[r][k]), (t, r, i)
            assert torch.equal(after[0][i], after[1][i])
        assert all(torch.equal(a, b) for a, b in zip(after[1], ranks[0]["records"][t - 1]
                                                     ["after"][1]))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_each_sync_equals_the_reference_on_every_rank(ranks, name):
    cfg = CONFIGS[name]
    syncs = _syncs(cfg)
    assert len(syncs) >= 2
    for t, f in syncs.items():
        _check([r[name] for r in ranks], t, ranks[0][name]["fragments"][f], cfg)
    # the step really is sparse: a tensor of more than C elements moves in few of them
    if name == "small-runs":
        rec = ranks[0][name]["records"][2]
        moved = (rec["after"][1][0] != rec["before"][1][0]).sum().item()
        assert 0 < moved <= N * (231 // 16 * 3 + 2)  # at most what the ranks kept


@pytest.mark.parametrize("name", list(CONFIGS))
def test_bytes_per_sync_are_the_payload_to_each_peer(ranks, name):
    cfg = CONFIGS[name]
    numels = [p.numel() for p in _model().parameters()]
    for rank in ranks:
        rec = rank[name]
        for r, sizes in syncs_of(rec, _syncs(cfg), numels):
            want = (N - 1) * payload_bytes(sizes, _opts(cfg))
            assert r["stats"].bytes_sent == want == r["counted"]
            assert r["stats"].outer == "sparseloco"
            # far below DiLoCo-Nesterov's fp32 all-reduce of the same elements
            assert want < r["stats"].allreduce_fp32_bytes


def test_nonfinite_raises_or_skips_on_every_rank_with_nothing_changed(ranks):
    for rank in ranks:
        raised = rank["nan-raise"]["records"]
        assert len(raised) == 3 and "inf or NaN" in raised[-1]["error"]
        for k in (1, 2):
            assert all(torch.equal(x, y) for x, y in zip(raised[-1]["before"][k],
                                                         raised[-1]["after"][k]))
        skipped = rank["nan-skip"]["records"]
        assert skipped[2]["stats"].skipped
        for k in (1, 2):
            assert all(torch.equal(x, y) for x, y in zip(skipped[2]["before"][k],
                                                         skipped[2]["after"][k]))
    cfg = dict(outer_options=SparseLoCoOptions(chunk=16, topk=3), sync_every=3)
    _check([r["nan-skip"] for r in ranks], 6, list(range(4)), cfg)


@pytest.mark.parametrize("name", ["plain", "overlap"])
def test_resume_is_exact(ranks, name):
    # params, theta_bar, accumulators (non-zero)
    check_resumes_exact(ranks, name, parts=3, nonzero=2)


@pytest.mark.parametrize("kwargs, match", [
    (dict(chunk=0), "chunk"), (dict(chunk=40000), "chunk"), (dict(chunk=2.0), "chunk"),
    (dict(topk=0), "topk"), (dict(chunk=8, topk=9), "topk"), (dict(ef_decay=1.5), "ef_decay"),
    (dict(ef_decay=float("inf")), "ef_decay"),
])
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SparseLoCoOptions(**kwargs)


def test_other_options_are_refused_and_a_checkpoint_must_match():
    from dlion_kernels.local_steps.diloco import DiLoCo
    from dlion_kernels.local_steps.outer_options import DLionOuterOptions

    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(TypeError, match="SparseLoCoOptions"):
        DiLoCo(model, inner, 2, "sparseloco", outer_options=DLionOuterOptions(True))
    a = DiLoCo(model, inner, 2, "sparseloco", outer_options=dict(chunk=16, topk=3))
    assert a.outer_lr == 1.0
    for t in range(1, 4):
        _inner_step(model, inner, 0, t)
        a.step()
    other = _model()
    b = DiLoCo(other, torch.optim.AdamW(other.parameters()), 2, "sparseloco")
    theta = [t.clone() for t in b.theta_bar]
    with pytest.raises(ValueError, match="outer_options"):
        b.load_state_dict(a.state_dict())  # other chunk and topk
    assert all(torch.equal(x, y) for x, y in zip(theta, b.theta_bar)) and b.inner_step == 0
