"""dk.DiLoCo checkpoints: a run stopped after inner step k and resumed from the state dicts of the
model, the inner optimizer and DiLoCo follows the uninterrupted run bit for bit, in the middle of
an H window, right at a sync, and inside an overlap window (the in-flight exchange is issued
again); also through dk.save_state/load_state, and loaded back into a live DiLoCo whose exchange
is in flight. A state that does not fit raises and changes nothing."""

import copy

import pytest
import torch
from test_diloco import _inner, _inner_step, _model
from workers import run_workers

import dlion_kernels as dk
from dlion_kernels.local_steps.diloco import DiLoCo

STEPS = 13
CASES = [  # (outer, sync_every, fragments, overlap_steps, k, inner, how)
    ("dlion", 4, 1, 0, 6, "adamw", "fresh"),          # mid-window
    ("dlion", 4, 1, 0, 8, "accum-adamw", "fresh"),    # right after a sync
    ("dlion", 4, 2, 1, 2, "adamw", "fresh"),          # inside an overlap window
    ("dlion", 4, 2, 1, 6, "adamw", "save_state"),     # the same, through dk.save_state
    ("dlion", 4, 1, 2, 4, "adamw", "rollback"),       # into the live object, exchange in flight
    ("nesterov", 4, 1, 0, 6, "adamw", "fresh"),
    ("nesterov", 4, 1, 0, 8, "accum-adamw", "fresh"),
    ("nesterov", 4, 2, 1, 6, "adamw", "fresh"),
    ("nesterov", 4, 1, 2, 4, "adamw", "rollback"),
]


def _build(outer, h, p, tau, inner_kind):
    model = _model()
    inner = _inner(inner_kind, model)
    diloco = DiLoCo(model, inner, sync_every=h, outer=outer, outer_lr=5e-2, fragments=p,
                    overlap_steps=tau, merge_alpha=0.5)
    return model, inner, diloco


def _state(model, diloco):
    return ([p.detach().clone() for p in model.parameters()],
            [t.clone() for t in diloco.theta_bar], [m.clone() for m in diloco.outer_momenta])


def _resume_worker(rank, n, directory):
    out = {}
    for case in CASES:
        outer, h, p, tau, k, inner_kind, how = case
        model, inner, diloco = _build(outer, h, p, tau, inner_kind)
        expected = []
        for t in range(1, STEPS + 1):
            _inner_step(model, inner, rank, t)
            diloco.step()
            expected.append(_state(model, diloco))

        model, inner, diloco = _build(outer, h, p, tau, inner_kind)
        for t in range(1, k + 1):
            _inner_step(model, inner, rank, t)
            diloco.step()
        saved_model = copy.deepcopy(model.state_dict())
        saved_inner = copy.deepcopy(inner.state_dict())
        saved = diloco.state_dict()
        in_flight = saved["in_flight"] is not None
        if how == "save_state":
            dk.save_state(diloco, directory)
        if how == "rollback":  # one step further (the exchange still in flight), then back
            _inner_step(model, inner, rank, k + 1)
            diloco.step()
            assert diloco.state_dict()["in_flight"] is not None
        else:  # a new process would build everything afresh, then load
            model, inner, diloco = _build(outer, h, p, tau, inner_kind)
        model.load_state_dict(saved_model)
        inner.load_state_dict(saved_inner)
        if how == "save_state":
            dk.load_state(diloco, directory)
        else:
            diloco.load_state_dict(saved)
        got = [None] * k
        for t in range(k + 1, STEPS + 1):
            _inner_step(model, inner, rank, t)
            diloco.step()
            got.append(_state(model, diloco))
        out[case] = dict(expected=expected, got=got, in_flight=in_flight,
                         inner_step=diloco.inner_step)
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_exact_resume(n, tmp_path):
    ranks = run_workers(n, _resume_worker, str(tmp_path))
    for case in CASES:
        outer, h, p, tau, k, _, how = case
        for r, res in enumerate(ranks):
            res = res[case]
            assert res["in_flight"] == (tau > 0 and k % (h // p) == 0), case
            assert res["inner_step"] == STEPS
            for t in range(k + 1, STEPS + 1):
                for what, a, b in zip(("params", "theta_bar", "momenta"),
                                      res["got"][t - 1], res["expected"][t - 1]):
                    for x, y in zip(a, b, strict=True):
                        assert torch.equal(x, y), (case, r, t, what)


def test_bad_state_changes_nothing():
    model, inner, diloco = _build("dlion", 4, 2, 1, "adamw")
    for t in range(1, 3):
        _inner_step(model, inner, 0, t)
        diloco.step()
    good = diloco.state_dict()
    assert good["in_flight"] is not None  # fragment 0 synced at step 2, applied at 3
    before = _state(model, diloco)

    def variant(**changes):
        sd = dict(good)
        sd.update(changes)
        return sd

    flight = good["in_flight"]
    cases = [
        ([], "must come from DiLoCo.state_dict"),
        (variant(format="other"), "must come from DiLoCo.state_dict"),
        (variant(sync_every=8), "saved with sync_every=8"),
        (variant(outer="nesterov"), "saved with outer='nesterov'"),
        (variant(fragments=1), "saved with fragments=1"),
        (variant(overlap_steps=0), "saved with overlap_steps=0"),
        (variant(fragment_numels=[1, 2]), "resume with the same model"),
        (variant(inner_step=-1), "inner_step must be an int >= 0"),
        (variant(theta_bar=good["theta_bar"][:1]), "theta_bar must be 2 flat float32"),
        (variant(momentum=[m.double() for m in good["momentum"]]), "momentum must be 2 flat"),
        (variant(inner_step=5), "does not fit inner step 5"),
        (variant(in_flight=dict(flight, fragment=1)), "does not fit inner step 2"),
        (variant(in_flight=dict(flight, pseudo_gradient=torch.zeros(3))),
         "in-flight pseudo_gradient must be a flat float32 tensor"),
    ]
    for sd, message in cases:
        with pytest.raises(ValueError, match=message):
            diloco.load_state_dict(sd)
        for a, b in zip(_state(model, diloco), before):
            for x, y in zip(a, b):
                assert torch.equal(x, y)
        assert diloco.inner_step == 2 and diloco._inflight is not None


def test_resume_in_window_restarts_on_the_next_step():
    """n = 1: the loaded in-flight sync is applied at its step, as without the checkpoint."""
    model, inner, diloco = _build("nesterov", 8, 1, 3, "adamw")
    for t in range(1, 10):
        _inner_step(model, inner, 0, t)
        diloco.step()
    sd, msd, isd = diloco.state_dict(), copy.deepcopy(model.state_dict()), \
        copy.deepcopy(inner.state_dict())
    assert sd["in_flight"]["step"] == 8
    stats = [diloco.step() for _ in range(2)]  # no inner steps: only the sync can move anything
    model2, inner2, diloco2 = _build("nesterov", 8, 1, 3, "adamw")
    model2.load_state_dict(msd)
    inner2.load_state_dict(isd)
    diloco2.load_state_dict(sd)
    stats2 = [diloco2.step() for _ in range(2)]
    assert stats[0] is None and stats2[0] is None
    assert (stats[1].step, stats[1].applied_step) == (stats2[1].step, stats2[1].applied_step) \
        == (8, 11)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
