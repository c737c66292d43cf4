"""The diloco-* strategies (the DiLoCo builder of build/) on 3 gloo ranks: each slug builds and
trains; between syncs its step calls no collective and counts no bytes; at a sync it counts
DiLoCo's bytes (D-Lion: 1 bit per parameter each way, Nesterov: a ring all-reduce of fp32);
evaluation runs on theta_bar, the same on every rank, and puts the local parameters back.
diloco-dlion-ef-decay builds DiLoCo with error feedback decayed by 0.5, sends diloco-dlion-ef's
bytes and trains differently from it."""

import dataclasses

import pytest
import torch
from test_diloco import _Recorder
from test_sparseloco import payload_bytes
from workers import run_workers

from dlion_kernels import recipes as b
from dlion_kernels import strategies
from dlion_kernels.recipes import builders
from dlion_kernels.local_steps import fragments as frag
from dlion_kernels.local_steps.outer_options import SparseLoCoOptions

N, H, STEPS = 3, 4, 8
SLUGS = ["diloco-dlion", "diloco-nesterov", "diloco-dlion-ef", "diloco-dlion-ef-decay",
         "diloco-dlion-ef-scale", "diloco-sparseloco"]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(40, 50), torch.nn.GELU(), torch.nn.Linear(50, 3))


def _flat(model):
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


class _Kept(builders.DiLoCo):
    """DiLoCo that keeps its last instance (the builder does not hand it out)."""

    last = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _Kept.last = self


def _train(rank, n, fragments):
    out = {}
    builders.DiLoCo = _Kept  # in this worker process only
    for slug in SLUGS:
        settings = b.Settings(adamw_lr=1e-2, sync_every=H, fragments=fragments)
        built = b.build(slug, _model(), settings)
        options = _Kept.last.outer_options
        steps = []
        for t in range(STEPS):
            torch.manual_seed(100 * rank + t)  # every rank its own data
            built.zero_grad()
            built(torch.randn(8, 40)).square().mean().backward()
            with _Recorder(n) as rec:
                sent = built.step()
            steps.append((rec.calls, sent))
        local = _flat(built.model)
        with built.evaluation():
            evaluated = _flat(built.model)
        out[slug] = dict(steps=steps, local=local, evaluated=evaluated,
                         after=_flat(built.model), mean=built.bytes_per_step,
                         source=built.bytes_source,
                         options=None if options is None else dataclasses.asdict(options))
    return out


@pytest.mark.parametrize("fragments", [1, 2])
def test_diloco_strategies_train_and_send_only_at_syncs(fragments):
    results = run_workers(N, _train, fragments)
    start = _flat(_model())
    cuts = frag.split([p.numel() for p in _model().parameters()], fragments)
    sizes = [sum(p.numel() for i, p in enumerate(_model().parameters()) if i in cut)
             for cut in cuts]
    for slug in SLUGS:
        ranks = [r[slug] for r in results]
        for t in range(1, STEPS + 1):
            due = frag.due(t, H, fragments)
            for r in ranks:
                calls, sent = r["steps"][t - 1]
                if due is None:
                    assert calls == [] and sent == 0, (slug, t)
                    continue
                numel = sizes[due]
                tensors = len(cuts[due])
                if slug == "diloco-nesterov":
                    assert calls == ["all_reduce"], (slug, t)
                    # 2 fp32 step words per rank ride in the all-reduce (the step check)
                    assert sent == round(2 * (N - 1) / N * 4 * (numel + 2 * N)), (slug, t)
                elif slug == "diloco-sparseloco":  # one all_gather of the sparse payload
                    assert calls == ["all_gather"], (slug, t)
                    assert sent == (N - 1) * payload_bytes(
                        [p.numel() for i, p in enumerate(_model().parameters())
                         if i in cuts[due]], SparseLoCoOptions()), (slug, t)
                elif slug == "diloco-dlion-ef-scale":  # + the scales: 4 bytes per tensor
                    assert calls == ["all_to_all_single", "all_gather", "all_gather"], (slug, t)
                    votes = sent - 4 * tensors * (N - 1)
                    assert 2 * (N - 1) / N * numel / 8 <= votes < (N - 1) / N * numel, (slug, t)
                else:  # 1 bit up and 1 bit down per element, padded to words and shards
                    assert calls[0] == "all_to_all_single" and len(calls) == 2, (slug, t)
                    assert 2 * (N - 1) / N * numel / 8 <= sent < (N - 1) / N * numel, (slug, t)
            assert len({r["steps"][t - 1][1] for r in ranks}) == 1, (slug, t)
        syncs = STEPS * fragments // H
        assert all(r["mean"] == round(sum(s for _, s in r["steps"]) / STEPS) for r in ranks)
        assert all(r["source"] == "SyncStats" for r in ranks)
        assert sum(frag.due(t, H, fragments) is not None for t in range(1, STEPS + 1)) == syncs
        # it trained; evaluation sees theta_bar, the same on every rank; local parameters back
        assert not torch.equal(ranks[0]["evaluated"], start), slug
        assert all(torch.equal(r["evaluated"], ranks[0]["evaluated"]) for r in ranks), slug
        assert all(torch.equal(r["after"], r["local"]) for r in ranks), slug
        # the last step synced fragment P-1: with P = 1 every rank is at theta_bar; with P = 2
        # fragment 0 took H / 2 local steps since its sync and differs between ranks
        same = all(torch.equal(r["local"], ranks[0]["local"]) for r in ranks)
        assert same == (fragments == 1), slug
        if fragments == 1:
            assert torch.equal(ranks[0]["local"], ranks[0]["evaluated"]), slug
    # the options each D-Lion slug built; ef-decay: ef's bytes at every step, another training
    for slug, scale, decay in [("diloco-dlion-ef", False, 1.0),
                               ("diloco-dlion-ef-decay", False, 0.5),
                               ("diloco-dlion-ef-scale", True, 1.0)]:
        options = dict(error_feedback=True, scale=scale, threshold=0.0, ef_decay=decay)
        assert all(r[slug]["options"] == options for r in results), slug
    assert all(r["diloco-dlion"]["options"] is None for r in results)
    for r in results:
        ef, decay = r["diloco-dlion-ef"], r["diloco-dlion-ef-decay"]
        assert [s for _, s in decay["steps"]] == [s for _, s in ef["steps"]]
        assert not torch.equal(decay["evaluated"], ef["evaluated"])


def test_registry():
    for slug, outer in [("diloco-dlion", "dlion"), ("diloco-nesterov", "nesterov"),
                        ("diloco-dlion-ef", "dlion"), ("diloco-dlion-ef-decay", "dlion"),
                        ("diloco-dlion-ef-scale", "dlion"),
                        ("diloco-sparseloco", "sparseloco")]:
        s = strategies.get(slug)
        assert (s.family, s.optimizer, s.options["outer"]) == ("diloco", "adamw", outer)
        assert s.problem(3) is None


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(sync_every=0), ValueError, "sync_every must be >= 1, got 0"),
    (dict(fragments=2.0), TypeError, "fragments must be an int, got float"),
    (dict(sync_every=6, fragments=4), ValueError,
     r"sync_every \(6\) must be a multiple of Settings.fragments \(4\)"),
])
def test_bad_settings(kwargs, error, match):
    with pytest.raises(error, match=match):
        b.Settings(**kwargs)
