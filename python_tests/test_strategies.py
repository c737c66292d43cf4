"""The registry of named strategies (dlion_kernels/strategies.py): one slug scheme, a row of the
runtime model for every modelled strategy, the legacy variant keys resolved, and the layout
rules."""

import re

import pytest

from dlion_kernels import strategies
from dlion_kernels.plan import model
from dlion_kernels.topologies import TOPOLOGIES

# bench_training's legacy variant keys and the runtime-model rows bench_plan validates them on
LEGACY_KEYS = {
    "no_comm": ("dlion-no-comm", None), "ddp_fp32": ("lion-allreduce", "lion-allreduce"),
    "ddp_fp16": ("lion-allreduce-fp16", None), "ddp_bf16": ("lion-allreduce-bf16",
                                                             "lion-allreduce-bf16"),
    "dlion": ("dlion-vote", "dlion-vote"), "dlion_overlap": ("dlion-vote-overlap",
                                                             "dlion-vote-overlap"),
    "dlion_ddp_hook": ("dlion-vote-ddp-hook", None),
    "dlion_hier": ("dlion-vote-hier", "dlion-vote-hier"),
    "dlion_hier_overlap": ("dlion-vote-hier-overlap", "dlion-vote-hier-overlap"),
    "hier_fp32": ("lion-allreduce-hier", None),
    "dec_ring": ("decentralized-ring-accum-adamw", "decentralized-ring-accum-adamw"),
    "dec_one_peer_exp": ("decentralized-one-peer-exp-accum-adamw",
                         "decentralized-one-peer-exp-accum-adamw"),
    "dec_alt_exp_ring": ("decentralized-alternating-exp-ring-accum-adamw",
                         "decentralized-alternating-exp-ring-accum-adamw"),
}


def test_one_slug_scheme():
    labels = [s.label for s in strategies.STRATEGIES.values()]
    assert len(set(labels)) == len(labels)
    for slug, s in strategies.STRATEGIES.items():
        assert s.slug == slug
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", slug), slug
        assert slug.startswith(s.family if s.family in ("dlion", "fsdp", "decentralized", "diloco")
                               else s.optimizer if s.family == "allreduce" else "dlion-no-comm")
    # every combination of the decentralized family is named
    for topology in TOPOLOGIES:
        for opt in strategies.DECENTRALIZED_OPTIMIZERS:
            s = strategies.get(f"decentralized-{topology}-{opt}")
            assert (s.optimizer, s.options["topology"]) == (opt, topology)


def test_the_model_names_its_rows_by_slug():
    """Every row predict() returns is named by a strategy's slug and predicts that strategy; a
    strategy whose row is another's shares that one's exchange (the same family and wire)."""
    for n, L in [(8, 1), (8, 2), (16, 4)]:
        for r in model.predict("10M", n, L, inter_gbps=10, fwd_ms=1, bwd_ms=2,
                               modes=strategies.MODES):
            assert strategies.get(r.strategy).row == r.strategy, r.strategy
    shared = {s.slug: s.row for s in strategies.STRATEGIES.values()
              if s.row is not None and s.row != s.slug}
    assert shared["adamw-allreduce"] == "lion-allreduce"
    assert shared["decentralized-ring-adamw"] == "decentralized-ring-accum-adamw"
    assert len(shared) == 1 + 2 * len(TOPOLOGIES)
    for slug, row in shared.items():
        a, b = strategies.get(slug), strategies.get(row)
        assert (a.family, a.options.get("wire"), a.options.get("topology")) == (
            b.family, b.options.get("wire"), b.options.get("topology")), slug


def test_every_row_is_one_the_model_predicts():
    """A strategy's row is a row predict() returns on a cluster where the strategy can run."""
    for s in strategies.STRATEGIES.values():
        if s.row is None:
            continue
        n, L = (8, 2) if s.nodes or "alternating" in s.slug else (8, 1)
        assert s.problem(n, L) is None
        rows = {r.strategy for r in model.predict("10M", n, L, inter_gbps=10, fwd_ms=1,
                                                  bwd_ms=2, modes=strategies.MODES)}
        assert s.row in rows, s.slug


def test_legacy_names_resolve():
    for key, (slug, row) in LEGACY_KEYS.items():
        s = strategies.resolve(key)
        assert (s.slug, s.row) == (slug, row), key
        assert strategies.resolve(slug) is s
    with pytest.raises(ValueError, match="unknown strategy 'ddp_int8'"):
        strategies.resolve("ddp_int8")
    with pytest.raises(ValueError, match="unknown strategy 'dlion'"):
        strategies.get("dlion")  # a legacy key is not a slug


def test_get_names_what_is_allowed():
    assert strategies.get("dlion-vote").options["mode"] == "vote"
    with pytest.raises(ValueError, match="known: adamw-allreduce, lion-allreduce, "):
        strategies.get("D-Lion vote")
    with pytest.raises(TypeError, match="must be a str, got int"):
        strategies.get(3)


@pytest.mark.parametrize("slug, n, L, match", [
    ("dlion-vote-hier", 4, 1, "needs nodes of L > 1 ranks"),
    ("dlion-vote-hier", 6, 4, "multiple of L; got 6 ranks with L = 4"),
    ("lion-allreduce-hier", 4, 1, "needs nodes of L > 1"),
    ("decentralized-ring-adamw", 3, 1, "'ring' needs an even number of ranks, got 3"),
    ("decentralized-one-peer-exp-accum-lion", 6, 2, "power-of-two number of ranks, got 6"),
    ("decentralized-alternating-exp-ring-accum-adamw", 4, 4, "make 1 node"),
])
def test_problems(slug, n, L, match):
    assert re.search(match, strategies.get(slug).problem(n, L))


def test_what_runs_where():
    assert strategies.get("dlion-vote-hier").problem(4, 2) is None
    assert strategies.get("dlion-vote").problem(3, 1) is None
    # alternating-exp-ring counts nodes of L; the other topologies ignore L
    assert strategies.get("decentralized-alternating-exp-ring-adamw").problem(8, 2) is None
    assert strategies.get("decentralized-one-peer-exp-adamw").problem(8, 8) is None
    bucketed = {s.slug for s in strategies.STRATEGIES.values() if s.bucketed}
    assert {"lion-allreduce", "dlion-vote-overlap", "dlion-vote-ddp-hook",
            "decentralized-ring-adamw"} <= bucketed
    assert not {"dlion-vote", "dlion-vote-hier", "dlion-no-comm"} & bucketed
