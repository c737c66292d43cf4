"""Every training strategy this repository runs, each under one name (its slug).

A strategy is an optimizer together with the way the ranks exchange what it needs. Its slug is
lowercase and dash-separated, family first, then what sets it apart:

- ``adamw-allreduce``, ``lion-allreduce``: DDP's fp32 gradient all-reduce, then the optimizer on
  every rank; ``lion-allreduce-fp16`` / ``-bf16`` compress the all-reduce (a DDP comm hook),
  ``lion-allreduce-hier`` runs it as reduce-scatter in the node, all-reduce of the shard across
  nodes, all-gather in the node
- ``dlion-vote``, ``dlion-average``: ``DistributedLion(mode=...)``; suffixes ``-overlap``
  (``overlap=True``), ``-hier`` (``hierarchy=L``: nodes of L consecutive ranks, L the run's ranks
  per node), ``-hier-overlap``, and ``-ddp-hook`` (``register_ddp_comm_hook`` on a DDP model)
- ``dlion-no-comm``: D-Lion on a group of one rank (each rank tallies alone): the step with no
  communication
- ``fsdp-dlion``, ``fsdp-dlion-overlap``: FSDP2 (``fully_shard``) on the shard dimension of an
  (N replicas x L shards) mesh, L the run's ranks per node, and ``DistributedLion(device_mesh=)``
  voting between the replicas (vote mode; ``-overlap``: ``overlap=True``); ``fsdp-allreduce``,
  ``fsdp-allreduce-bf16``: FSDP2's own HSDP (``fully_shard`` on the 2-D mesh: reduce-scatter in
  the node, all-reduce of the shard between the replicas, fp32 or bf16), then Lion on each shard
- ``decentralized-<topology>-<optimizer>``: ``DecentralizedDataParallel`` on a topology of
  ``topologies.py`` with ``accum-adamw``, ``accum-lion`` or ``adamw`` per bucket
- ``diloco-dlion``, ``diloco-nesterov``: ``DiLoCo`` (local AdamW steps, an outer step every H =
  ``Settings.sync_every`` inner steps in ``Settings.fragments`` fragments) with D-Lion's vote or
  DiLoCo's fp32 Nesterov as the outer step; ``diloco-dlion-fsdp``, ``diloco-nesterov-fsdp``:
  the same on a model sharded as ``fsdp-dlion`` (DiLoCo on the local shards, ``device_mesh=``);
  ``diloco-dlion-ef`` adds error feedback to D-Lion's outer step, ``diloco-dlion-ef-decay`` the
  same with the residual halved at every sync (``ef_decay=0.5``) and ``diloco-dlion-ef-scale``
  also a per-tensor scale (``DLionOuterOptions``); ``diloco-sparseloco`` is the SparseLoCo
  baseline (top-k per run, 2-bit values, error feedback; ``outer="sparseloco"``)

Each entry carries its label for tables, its parameters (``options``, read by its family's
builder in ``recipes/builders.py``), whether it needs nodes of L > 1 ranks, and the runtime
model's row that predicts its step (``plan/model.py``; None where the model has none). The
model names its rows by these slugs: a strategy's row is its own slug, or, where two
strategies run the same exchange, the other's (``adamw-allreduce`` is predicted by
``lion-allreduce``'s row, the decentralized optimizers of a topology by its ``accum-adamw``
row). Numbers that are the same for every strategy of a run (learning rates, bucket size, L,
K) are the builder's ``Settings``, not part of the name.

The demo (``--strategy``), ``bench/bench_training.py`` (``--variants``), ``bench/bench_plan.py``
and the runtime model (``choose_strategy``) name strategies by these slugs. Adding one is an
entry in ``_entries`` below, plus a builder in ``recipes/builders.py`` for a new family.

Pure Python, no torch: the runtime model imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType

from .topologies import TOPOLOGIES, problem

MODES = ("vote", "average")
DECENTRALIZED_OPTIMIZERS = ("accum-adamw", "accum-lion", "adamw")


@dataclass(frozen=True)
class Strategy:
    """One named strategy (see the module docstring)."""

    slug: str
    label: str  # its name in tables
    family: str  # which builder runs it: allreduce, no-comm, dlion, fsdp, decentralized, diloco
    optimizer: str  # the update on each rank: adamw, lion, dlion, accum-adamw, accum-lion
    row: str | None  # the slug of the runtime model's row that predicts its step, or None
    options: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    nodes: bool = False  # runs on nodes of L = ranks_per_node > 1 ranks
    bucketed: bool = False  # exchanges per bucket of bucket_mb during backward
    legacy: str | None = None  # its variant key in older bench_training results

    def problem(self, n: int, ranks_per_node: int = 1) -> str | None:
        """Why it cannot run on n ranks in nodes of ``ranks_per_node``, or None."""
        L = ranks_per_node
        if self.nodes and (L < 2 or n % L):
            return (f"{self.slug} needs nodes of L > 1 ranks (ranks per node) and a world size "
                    f"that is a multiple of L; got {n} ranks with L = {L}")
        topology = self.options.get("topology")
        if topology is not None:
            return problem(topology, n, L if topology == "alternating-exp-ring" else 1)
        return None


def _entries():
    def add(slug, label, family, optimizer, row, nodes=False, bucketed=False, legacy=None,
            **options):
        return Strategy(slug, label, family, optimizer, row, MappingProxyType(options), nodes,
                        bucketed, legacy)

    # DDP: one all-reduce per bucket during backward
    yield add("adamw-allreduce", "AdamW + all-reduce", "allreduce", "adamw", "lion-allreduce",
              bucketed=True, wire="fp32")
    yield add("lion-allreduce", "Lion + all-reduce", "allreduce", "lion", "lion-allreduce",
              bucketed=True, legacy="ddp_fp32", wire="fp32")
    # fp16 moves the bf16 row's bytes; kept out of the model's validation as before (None)
    yield add("lion-allreduce-fp16", "Lion + fp16 all-reduce", "allreduce", "lion", None,
              bucketed=True, legacy="ddp_fp16", wire="fp16")
    yield add("lion-allreduce-bf16", "Lion + bf16 all-reduce", "allreduce", "lion",
              "lion-allreduce-bf16", bucketed=True, legacy="ddp_bf16", wire="bf16")
    yield add("lion-allreduce-hier", "Lion + hier. all-reduce (RS/AR/AG)", "allreduce", "lion",
              None, nodes=True, bucketed=True, legacy="hier_fp32", wire="hier-fp32")
    yield add("dlion-no-comm", "D-Lion, local tally (no comm)", "no-comm", "dlion", None,
              legacy="no_comm")
    for mode in MODES:
        for suffix, label, overlap, hier, hook, modelled, legacy in [
                ("", "", False, False, False, True, "dlion"),
                ("-overlap", ", overlap", True, False, False, True, "dlion_overlap"),
                ("-hier", ", hierarchy", False, True, False, True, "dlion_hier"),
                ("-hier-overlap", ", hierarchy, overlap", True, True, False, True,
                 "dlion_hier_overlap"),
                ("-ddp-hook", ", DDP hook", False, False, True, False, "dlion_ddp_hook")]:
            slug = f"dlion-{mode}{suffix}"
            yield add(slug, f"D-Lion {mode}{label}", "dlion", "dlion", slug if modelled else None,
                      nodes=hier, bucketed=overlap or hook,
                      legacy=legacy if mode == "vote" else None, mode=mode, overlap=overlap,
                      hierarchy=hier, ddp_hook=hook)
    # FSDP2: sharded in nodes of L ranks; the replicas vote, or HSDP all-reduces
    for suffix, label, overlap in [("", "", False), ("-overlap", ", overlap", True)]:
        yield add(f"fsdp-dlion{suffix}", f"FSDP2 + D-Lion vote{label}", "fsdp", "dlion",
                  f"fsdp-dlion{suffix}", nodes=True, bucketed=overlap, sync="dlion",
                  mode="vote", overlap=overlap)
    for suffix, wire in [("", "fp32"), ("-bf16", "bf16")]:
        yield add(f"fsdp-allreduce{suffix}", f"FSDP2 HSDP ({wire} all-reduce) + Lion", "fsdp",
                  "lion", f"fsdp-allreduce{suffix}", nodes=True, sync="allreduce", wire=wire)
    round2 = {"ring": "dec_ring", "one-peer-exp": "dec_one_peer_exp",
              "alternating-exp-ring": "dec_alt_exp_ring"}  # all with accum-adamw
    for topology in TOPOLOGIES:
        for opt in DECENTRALIZED_OPTIMIZERS:
            yield add(f"decentralized-{topology}-{opt}", f"Decentralized {topology} {opt}",
                      "decentralized", opt, f"decentralized-{topology}-accum-adamw",
                      bucketed=True,
                      legacy=round2.get(topology) if opt == "accum-adamw" else None,
                      topology=topology)
    # DiLoCo: inner AdamW alone on every rank, an outer step every H inner steps
    yield add("diloco-dlion", "DiLoCo, D-Lion vote outer step", "diloco", "adamw", "diloco-dlion",
              outer="dlion", mode="vote")
    yield add("diloco-nesterov", "DiLoCo, fp32 Nesterov outer step", "diloco", "adamw",
              "diloco-nesterov", outer="nesterov")
    # D-Lion's outer step with options (local_steps/outer_options.py), and the SparseLoCo baseline
    yield add("diloco-dlion-ef", "DiLoCo, D-Lion vote outer step + error feedback", "diloco",
              "adamw", "diloco-dlion-ef", outer="dlion", mode="vote", error_feedback=True,
              scale=False)
    # the residual decayed by 0.5 per sync: within 1% of Nesterov's loss in the outer study
    yield add("diloco-dlion-ef-decay", "DiLoCo, D-Lion vote outer step + decayed error feedback",
              "diloco", "adamw", "diloco-dlion-ef-decay", outer="dlion", mode="vote",
              error_feedback=True, scale=False, ef_decay=0.5)
    yield add("diloco-dlion-ef-scale", "DiLoCo, D-Lion vote outer step + error feedback + scale",
              "diloco", "adamw", "diloco-dlion-ef-scale", outer="dlion", mode="vote",
              error_feedback=True, scale=True)
    yield add("diloco-sparseloco", "DiLoCo, SparseLoCo outer step (top-k, 2-bit)", "diloco",
              "adamw", "diloco-sparseloco", outer="sparseloco")
    # ... on an FSDP2-sharded model: DiLoCo on the local shards, the outer step between replicas
    yield add("diloco-dlion-fsdp", "FSDP2 + DiLoCo, D-Lion vote outer step", "diloco", "adamw",
              None, nodes=True, outer="dlion", mode="vote", fsdp=True)
    yield add("diloco-nesterov-fsdp", "FSDP2 + DiLoCo, fp32 Nesterov outer step", "diloco",
              "adamw", None, nodes=True, outer="nesterov", fsdp=True)


STRATEGIES: dict[str, Strategy] = {s.slug: s for s in _entries()}
_LEGACY = {s.legacy: s for s in STRATEGIES.values() if s.legacy}


def get(slug: str) -> Strategy:
    """The strategy named ``slug``; ValueError listing the slugs if there is none."""
    if not isinstance(slug, str):
        raise TypeError(f"a strategy name must be a str, got {type(slug).__name__}")
    if slug not in STRATEGIES:
        raise ValueError(f"unknown strategy {slug!r}; known: {', '.join(STRATEGIES)}")
    return STRATEGIES[slug]


def resolve(name: str) -> Strategy:
    """The strategy named by a slug, or by the variant key that older ``bench_training.py``
    versions used before the slugs (``ddp_fp32``, ``dec_ring``, ...: their results files and
    recorded commands)."""
    return _LEGACY[name] if name in _LEGACY else get(name)
