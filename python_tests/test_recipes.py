"""Named strategies built on gloo ranks (dlion_kernels/recipes/): every family has a builder,
each built strategy trains with the bytes its exchange sends, and bad input is refused before
any collective."""

import pytest
import torch
import torch.distributed as dist
from workers import run_workers

from dlion_kernels import recipes as b
from dlion_kernels import strategies
from dlion_kernels.recipes.groups import fsdp_mesh
from dlion_kernels.kernels.layout import HEADER_WORDS, num_blocks, shard_blocks

N, L = 4, 2
SETTINGS = b.Settings(lion_lr=1e-3, adamw_lr=1e-3, bucket_mb=0.01, ranks_per_node=L)
SLUGS = ["adamw-allreduce", "lion-allreduce", "lion-allreduce-bf16", "lion-allreduce-fp16",
         "lion-allreduce-hier", "dlion-no-comm", "dlion-vote", "dlion-average-overlap",
         "dlion-vote-ddp-hook", "dlion-vote-hier", "decentralized-ring-accum-adamw",
         "decentralized-alternating-exp-ring-accum-lion"]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(40, 50), torch.nn.GELU(), torch.nn.Linear(50, 3))


def _train(rank, n, slugs):
    out = {}
    for slug in slugs:
        built = b.build(slug, _model(), SETTINGS)
        sent, grads = [], None
        for step in range(3):
            torch.manual_seed(100 * rank + step)  # every rank its own data
            built.zero_grad()
            loss = built(torch.randn(8, 40)).square().mean()
            loss.backward()
            if step == 0 and strategies.get(slug).family == "allreduce":  # .grad: the mean
                grads = torch.cat([p.grad.reshape(-1) for p in built.model.parameters()])
            sent.append(built.step())
        built.finish()
        flat = torch.cat([p.detach().reshape(-1) for p in built.model.parameters()])
        with built.evaluation():
            evaluated = torch.cat([p.detach().reshape(-1).clone()
                                   for p in built.model.parameters()])
        out[slug] = dict(sent=sent, inter=built.inter_node_bytes, mean=built.bytes_per_step,
                         params=flat, evaluated=evaluated, grads=grads,
                         source=built.bytes_source, stats=built.stats is not None,
                         memory=built.memory())
    return out


@pytest.fixture(scope="module")
def trained():
    return run_workers(N, _train, SLUGS)


def test_every_family_has_a_builder():
    assert {s.family for s in strategies.STRATEGIES.values()} == set(b.BUILDERS)


def test_built_strategies_train_and_count_their_bytes(trained):
    d = sum(p.numel() for p in _model().parameters())
    numels = [p.numel() for p in _model().parameters()]
    fp32 = round(2 * (N - 1) / N * 4 * d)
    by = {slug: [r[slug] for r in trained] for slug in SLUGS}
    for slug, ranks in by.items():
        start = torch.cat([p.detach().reshape(-1) for p in _model().parameters()])
        assert not torch.equal(ranks[0]["params"], start), slug  # it trained
        family = strategies.get(slug).family
        same = [torch.equal(r["params"], ranks[0]["params"]) for r in ranks]
        # synchronous strategies keep every rank identical; gossip and the local tally do not,
        # and gossip is evaluated on the average over the ranks
        assert all(same) == (family not in ("decentralized", "no-comm")), slug
        if family != "no-comm":
            assert all(torch.equal(r["evaluated"], ranks[0]["evaluated"]) for r in ranks), slug
    assert all(r["sent"] == [fp32] * 3 for r in by["adamw-allreduce"] + by["lion-allreduce"])
    assert all(r["sent"] == [fp32 // 2] * 3 for r in by["lion-allreduce-bf16"])
    assert all(r["source"] == "formula" and not r["stats"] for r in by["lion-allreduce"])
    # hierarchical all-reduce: reduce-scatter + all-gather in the node, a ring of N/L nodes
    intra, inter = 2 * round((L - 1) / L * 4 * d), round(2 * (N // L - 1) / (N // L) * 4 * d / L)
    assert all(r["sent"] == [intra + inter] * 3 and r["inter"] == inter
               for r in by["lion-allreduce-hier"])
    # every all-reduce leaves the same mean gradient in .grad (fp32; bf16/fp16 roughly)
    mean = by["lion-allreduce"][0]["grads"]
    for slug, tol in [("lion-allreduce-hier", 1e-6), ("lion-allreduce-bf16", 1e-2),
                      ("lion-allreduce-fp16", 1e-3)]:
        for r in by[slug]:
            torch.testing.assert_close(r["grads"], mean, rtol=tol, atol=tol)
    # D-Lion: the wire-format bytes with HEADER_WORDS header words per peer, from its StepStats
    shard = shard_blocks(sum(num_blocks(k) for k in numels), N)
    vote = 4 * (N - 1) * (HEADER_WORDS + 2 * shard)
    assert all(r["sent"] == [vote] * 3 and r["source"] == "StepStats" and r["stats"]
               for r in by["dlion-vote"])
    # through DDP's hook the headers leave during backward, so step() gathers one more word per
    # rank: the verdict that every rank applies the same step
    assert all(r["sent"] == [vote + 4 * (N - 1)] * 3 for r in by["dlion-vote-ddp-hook"])
    assert all(r["sent"] == [0] * 3 for r in by["dlion-no-comm"])
    assert all(r["sent"][0] > vote for r in by["dlion-average-overlap"])  # 3 planes, buckets
    assert all(r["inter"] is not None and 0 < r["inter"] < vote for r in by["dlion-vote-hier"])
    # gossip: a pair all-reduce of fp32 parameters (ring), pairs or nodes (alternating)
    assert all(r["sent"] == [4 * d] * 3 for r in by["decentralized-ring-accum-adamw"])
    alt = by["decentralized-alternating-exp-ring-accum-lion"]
    assert all(r["source"] == "DecentralizedDataParallel.bytes_sent" and min(r["sent"]) > 0
               for r in alt)
    # memory per rank, counted from the tensors: whole fp32 parameters and gradients; the
    # optimizer's state (the gossip wrapper's optimizers: AccumAdamW's accumulator and moments;
    # hierarchy: its 1/L shard of the node's momentum, padded to whole blocks)
    for slug, ranks in by.items():
        mem = ranks[0]["memory"]
        low = 4 * d / L if slug == "dlion-vote-hier" else 4 * d
        assert mem["params"] == 4 * d and low <= mem["optimizer_state"], (slug, mem)
    assert by["dlion-vote-hier"][0]["memory"]["optimizer_state"] < 4 * d
    assert by["decentralized-ring-accum-adamw"][0]["memory"]["optimizer_state"] == 12 * d


def _refused(rank, n):
    out = []
    for slug, settings in [("decentralized-ring-adamw", b.Settings()),
                           ("dlion-vote-hier", b.Settings(ranks_per_node=1)),
                           ("dlion-median", b.Settings()), ("dlion-vote", {"lr": 1})]:
        try:
            b.build(slug, _model(), settings)
        except (ValueError, TypeError) as e:
            out.append(f"{type(e).__name__}: {e}")
    dist.barrier()  # every rank still talks: nothing collective ran and failed
    return out


def test_bad_input_is_refused_before_any_collective():
    results = run_workers(3, _refused)
    assert results[0] == results[1] == results[2]
    ring, hier, unknown, settings = results[0]
    assert ring == "ValueError: topology 'ring' needs an even number of ranks, got 3"
    assert hier.startswith("ValueError: dlion-vote-hier needs nodes of L > 1 ranks")
    assert unknown.startswith("ValueError: unknown strategy 'dlion-median'; known: ")
    assert settings == "TypeError: settings must be a recipes.Settings, got dict"


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(ranks_per_node=0), ValueError, "ranks_per_node must be >= 1, got 0"),
    (dict(ranks_per_node=2.0), TypeError, "ranks_per_node must be an int, got float"),
    (dict(accum_steps=0), ValueError, "accum_steps must be >= 1, got 0"),
])
def test_bad_settings(kwargs, error, match):
    with pytest.raises(error, match=match):
        b.Settings(**kwargs)


def test_build_needs_a_process_group():
    with pytest.raises(RuntimeError, match="initialized default process group"):
        b.build("dlion-vote", _model(), b.Settings())


# ----------------------------------------------------------------------------- FSDP2

FSDP = ["fsdp-dlion", "fsdp-dlion-overlap", "fsdp-allreduce", "fsdp-allreduce-bf16"]
_FSDP_COLLECTIVES = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
                     "reduce_scatter_tensor", "all_reduce", "all_to_all_single")


class RingBytes:
    """Bytes this rank hands to the collectives, by the ring formulas (all-gather: (p-1)
    inputs, reduce-scatter and all_to_all: (p-1)/p of the input, all-reduce: 2 (p-1)/p), split
    into ``inter`` (a group of the replicate group's ranks: between nodes) and ``intra`` (any
    other group)."""

    def __init__(self, replicate):
        self.replicate, self.inter, self.intra, self.saved = replicate, 0, 0, {}

    def __enter__(self):
        for name in _FSDP_COLLECTIVES:
            if hasattr(dist, name):
                self.saved[name] = getattr(dist, name)
                setattr(dist, name, self._counted(name, self.saved[name]))
        return self

    def _counted(self, name, original):
        def counted(*args, group=None, **kwargs):
            tensor = (args[0] if args else kwargs["tensor"]) if name == "all_reduce" else (
                args[1] if len(args) > 1 else kwargs.get("input", kwargs.get("input_tensor")))
            p, nbytes = dist.get_world_size(group), tensor.numel() * tensor.element_size()
            if name.startswith("all_gather"):
                sent = nbytes * (p - 1)
            elif name == "all_reduce":
                sent = round(2 * (p - 1) / p * nbytes)
            else:
                sent = nbytes * (p - 1) // p
            # the replicate group (by its ranks)
            if group is not None and dist.get_process_group_ranks(group) == \
                    dist.get_process_group_ranks(self.replicate):
                self.inter += sent
            else:
                self.intra += sent
            return original(*args, group=group, **kwargs)

        return counted

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def _fsdp_train(rank, n):
    out = {}
    for slug in FSDP + ["lion-allreduce"]:
        built = b.build(slug, _model(), SETTINGS)
        fsdp = slug.startswith("fsdp")
        replicate = fsdp_mesh(L, "cpu")["replicate"].get_group() if fsdp else None
        steps = []
        for step in range(2):
            torch.manual_seed(100 * rank + step)
            with RingBytes(replicate) as counted:
                built.zero_grad()
                built(torch.randn(8, 40)).square().mean().backward()
                sent = built.step()
            if not fsdp:
                steps.append(dict(params=[p.detach().clone() for p in built.model.parameters()]))
                continue
            shards = [p.to_local().detach() for p in built.model.parameters()]
            same = True  # the replicas of this rank's shards hold the same bits
            for mine in shards:
                got = [torch.empty_like(mine) for _ in range(N // L)]
                dist.all_gather(got, mine.contiguous(), group=replicate)
                same &= all(torch.equal(g, mine) for g in got)
            steps.append(dict(sent=sent, inter=built.inter_node_bytes, counted_inter=counted.inter,
                              counted=counted.inter + counted.intra, same=same,
                              params=[p.full_tensor() for p in built.model.parameters()],
                              shard=sum(t.numel() for t in shards)))
        out[slug] = dict(steps=steps, memory=built.memory() if fsdp else None,
                         source=built.bytes_source, stats=built.stats is not None)
    return out


@pytest.fixture(scope="module")
def fsdp_trained():
    return run_workers(N, _fsdp_train)


def test_fsdp_strategies_train_with_replicas_identical(fsdp_trained):
    """Each FSDP2 slug on a 2 x 2 mesh: trains, the replicas of every shard hold the same bits
    after each step, and the parameters (gathered) are the same on every rank."""
    start = [p.detach() for p in _model().parameters()]
    for slug in FSDP:
        ranks = [r[slug] for r in fsdp_trained]
        for t in range(2):
            assert all(r["steps"][t]["same"] for r in ranks), (slug, t)
            full = [r["steps"][t]["params"] for r in ranks]
            assert all(all(torch.equal(a, c) for a, c in zip(f, full[0])) for f in full), slug
        assert not all(torch.equal(a, c) for a, c in zip(ranks[0]["steps"][1]["params"], start))
    # HSDP's fp32 all-reduce then Lion is lion-allreduce's step on the same mean gradient, to
    # within a sign flip where a mean is near zero and the two sum in another order
    lr = SETTINGS.lion_lr
    for x, y in zip(fsdp_trained[0]["fsdp-allreduce"]["steps"][1]["params"],
                    fsdp_trained[0]["lion-allreduce"]["steps"][1]["params"]):
        torch.testing.assert_close(x, y, rtol=0, atol=4 * lr + 1e-6)
        assert (x == y).float().mean() > 0.95


def test_fsdp_bytes_and_memory(fsdp_trained):
    """Bytes per step: FSDP2's collectives by the formula of accounting.fsdp_model_bytes equal those
    counted at the collectives (ring conventions), D-Lion's between nodes its StepStats; memory
    per rank: parameters, gradients and momentum of the local shards (fp32)."""
    for slug in FSDP:
        for r in fsdp_trained:
            got = r[slug]
            for s in got["steps"]:
                assert s["sent"] == s["counted"] and s["inter"] == s["counted_inter"], slug
                assert s["inter"] > 0
            shard = got["steps"][0]["shard"]
            assert got["memory"] == dict(params=4 * shard, grads=4 * shard,
                                         optimizer_state=4 * shard), slug
            dlion = slug.startswith("fsdp-dlion")
            assert got["source"] == ("StepStats + formula (FSDP2)" if dlion else "formula")
            assert got["stats"] == dlion
    one = fsdp_trained[0]
    fp32 = one["fsdp-allreduce"]["steps"][0]["inter"]
    assert one["fsdp-allreduce-bf16"]["steps"][0]["inter"] == fp32 // 2
    assert one["fsdp-dlion"]["steps"][0]["inter"] < fp32 / 8


# ----------------------------------------------------------------------------- FSDP2 + DiLoCo

FSDP_DILOCO = ["diloco-dlion-fsdp", "diloco-nesterov-fsdp"]
DILOCO_SETTINGS = b.Settings(adamw_lr=1e-3, ranks_per_node=L, sync_every=2)


def _fsdp_diloco_train(rank, n):
    out = {}
    for slug in FSDP_DILOCO:
        built = b.build(slug, _model(), DILOCO_SETTINGS)
        replicate = fsdp_mesh(L, "cpu")["replicate"].get_group()
        steps = []
        for step in range(4):
            torch.manual_seed(100 * rank + step)  # every rank its own data
            with RingBytes(replicate) as counted:
                built.zero_grad()
                built(torch.randn(8, 40)).square().mean().backward()
                sent = built.step()
            shards = [p.to_local().detach().clone() for p in built.model.parameters()]
            same = True  # the replicas of this rank's shards hold the same bits
            for mine in shards:
                got = [torch.empty_like(mine) for _ in range(N // L)]
                dist.all_gather(got, mine.contiguous(), group=replicate)
                same &= all(torch.equal(g, mine) for g in got)
            with built.evaluation():
                evaluated = [p.to_local().detach().clone() for p in built.model.parameters()]
            after = [p.to_local().detach() for p in built.model.parameters()]
            steps.append(dict(sent=sent, inter=built.inter_node_bytes, counted=counted.inter
                              + counted.intra, counted_inter=counted.inter, same=same,
                              evaluation_restored=all(torch.equal(x, y) for x, y in
                                                      zip(after, shards)),
                              evaluated_same=all(torch.equal(x, y) for x, y in
                                                 zip(evaluated, shards))))
        out[slug] = dict(steps=steps, source=built.bytes_source)
    mesh = fsdp_mesh(L, "cpu")
    out["mesh"] = dict(  # the builders' mesh: rows of L consecutive ranks (its groups' timeout:
        # test_collectives, where the job's timeout is not torch's default)
        rows=mesh.mesh.tolist(), shard=dist.get_process_group_ranks(mesh["shard"].get_group()),
        replicate=dist.get_process_group_ranks(mesh["replicate"].get_group()))
    return out


def test_fsdp_diloco_strategies():
    """diloco-*-fsdp on a 2 x 2 mesh, a sync every 2 steps: between syncs only FSDP2's own
    collectives inside the node (nothing between nodes) and the replicas apart; at a sync the
    replicas of every shard identical and the outer step's bytes between nodes; the byte counts
    equal those counted at the collectives; evaluation() swaps theta_bar in and back."""
    for rank, r in enumerate(run_workers(N, _fsdp_diloco_train)):
        mesh = r["mesh"]
        assert mesh["rows"] == [list(range(i, i + L)) for i in range(0, N, L)]
        assert mesh["shard"] == list(range(rank - rank % L, rank - rank % L + L))
        assert mesh["replicate"] == list(range(rank % L, N, L))
        for slug in FSDP_DILOCO:
            got = r[slug]
            assert got["source"] == "SyncStats + formula (FSDP2)"
            for t, s in enumerate(got["steps"], start=1):
                where = (slug, t)
                assert s["sent"] == s["counted"] and s["inter"] == s["counted_inter"], where
                assert s["evaluation_restored"], where
                if t % 2:
                    assert s["inter"] == 0 and s["sent"] > 0 and not s["same"], where
                    assert not s["evaluated_same"], where
                else:
                    assert s["inter"] > 0 and s["same"] and s["evaluated_same"], where
