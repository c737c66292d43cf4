"""DiLoCo runs that the outer-option tests (test_outer_options.py, test_sparseloco.py) share,
each on one rank of a gloo group: ``run`` records every step's snapshots, stats and bytes;
``resume_run`` rebuilds the DiLoCo from a checkpoint mid-run; ``resumed_runs`` and
``check_resumes_exact`` are the resume check both files make (a run whole and resumed from each
save point ends bit for bit the same)."""

import copy

import torch
from test_diloco import _inner_step, _model, _Recorder

from dlion_kernels.exchange.pipeline import NonFiniteGradientError
from dlion_kernels.local_steps.diloco import DiLoCo

H = 3  # inner steps between syncs unless a run says otherwise
WD, BETAS = 0.1, (0.9, 0.99)  # the outer weight decay and betas of every run
RESUME_STEPS = 10


def inner_optimizer(model):
    """The inner optimizer of every run: AdamW, lr 1e-2."""
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def snap(model, diloco):
    """(params, theta_bar, momenta, residuals) per tensor; residuals None without them."""
    residual = diloco.outer_residuals
    residual = None if residual is None else [v.clone() for v in residual]
    return ([p.detach().clone() for p in model.parameters()],
            [t.clone() for t in diloco.theta_bar], [m.clone() for m in diloco.outer_momenta],
            residual)


def run(rank, n, steps, poison=None, **kwargs):
    """``steps`` inner steps; per step the snapshots around ``diloco.step()``, its stats, the
    bytes the recorder counted and the error it raised (then the run stops). ``poison``: (step,
    rank) whose parameters turn NaN before that step's ``diloco.step()``."""
    kwargs.setdefault("sync_every", H)
    model = _model()
    inner = inner_optimizer(model)
    diloco = DiLoCo(model, inner, outer_weight_decay=kwargs.pop("outer_weight_decay", WD),
                    outer_betas=BETAS, **kwargs)
    index = {id(p): i for i, p in enumerate(model.parameters())}
    records = []
    for t in range(1, steps + 1):
        _inner_step(model, inner, rank, t)
        if poison is not None and poison == (t, rank):
            with torch.no_grad():
                next(model.parameters())[0, 0] = float("nan")
        before = snap(model, diloco)
        error, stats = None, None
        with _Recorder(n) as rec:
            try:
                stats = diloco.step()
            except NonFiniteGradientError as e:
                error = str(e)
        records.append(dict(before=before, after=snap(model, diloco), stats=stats,
                            counted=rec.sent, error=error))
        if error:
            break
    fragments = [[index[id(p)] for p in ps] for ps in diloco.fragment_params]
    return dict(records=records, fragments=fragments, keys=sorted(diloco.state_dict()))


def resume_run(rank, n, steps, save_at, **kwargs):
    """The final snapshot of ``steps`` inner steps, the DiLoCo rebuilt on a fresh model from
    the checkpoint of step ``save_at`` (model, inner optimizer, DiLoCo), or never (None)."""
    def build():
        model = _model()
        inner = inner_optimizer(model)
        return model, inner, DiLoCo(model, inner, outer_betas=BETAS, outer_weight_decay=WD,
                                    **kwargs)

    model, inner, diloco = build()
    for t in range(1, steps + 1):
        _inner_step(model, inner, rank, t)
        diloco.step()
        if t == save_at:
            saved = copy.deepcopy((model.state_dict(), inner.state_dict(), diloco.state_dict()))
            model, inner, diloco = build()
            model.load_state_dict(saved[0])
            inner.load_state_dict(saved[1])
            diloco.load_state_dict(saved[2])
    return snap(model, diloco)


def resumed_runs(rank, n, cases, steps=RESUME_STEPS) -> dict:
    """For each (name, DiLoCo keywords, save points) of ``cases``: the final snapshots of a run
    of ``steps`` inner steps never interrupted, then of one resumed at each save point."""
    return {name: [resume_run(rank, n, steps, at, **kw) for at in (None,) + points]
            for name, kw, points in cases}


def syncs_of(run_result, syncs, numels):
    """(record, sizes of the tensors that synced) for each sync of ``run_result`` (``run``'s),
    ``syncs`` mapping a sync's step to its fragment; every other step sent nothing."""
    for t, r in enumerate(run_result["records"], start=1):
        if t not in syncs:
            assert r["stats"] is None and r["counted"] == 0
            continue
        yield r, [numels[i] for i in run_result["fragments"][syncs[t]]]


def check_resumes_exact(ranks, name, parts, nonzero):
    """On every rank, each resumed run of ``name`` ends bit for bit as the run never
    interrupted, in the first ``parts`` parts of its snapshot (``snap``); part ``nonzero`` (the
    option's own state) is non-zero somewhere at the end of that run, or the check proves
    nothing about restoring it."""
    for rank in ranks:
        whole, *resumed = rank["resume"][name]
        assert whole[nonzero] is not None, (name, nonzero)
        assert any(bool((t != 0).any()) for t in whole[nonzero]), (name, nonzero)
        for other in resumed:
            for k in range(parts):
                assert all(torch.equal(x, y) for x, y in zip(whole[k], other[k])), (name, k)
