"""Named strategies built on gloo ranks (dlion_kernels/build.py): every family has a builder,
each built strategy trains with the bytes its exchange sends, and bad input is refused before
any collective."""

import pytest
import torch
import torch.distributed as dist
from workers import run_workers

from dlion_kernels import build as b
from dlion_kernels import strategies
from dlion_kernels.kernels.layout import HEADER_WORDS, num_blocks, shard_blocks

N, L = 4, 2
SETTINGS = b.Settings(lion_lr=1e-3, adamw_lr=1e-3, bucket_mb=0.01, ranks_per_node=L)
SLUGS = ["adamw-allreduce", "lion-allreduce", "lion-allreduce-bf16", "lion-allreduce-fp16",
         "lion-allreduce-hier", "dlion-local", "dlion-vote", "dlion-average-overlap",
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
                         source=built.bytes_source, stats=built.stats is not None)
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
        assert all(same) == (family not in ("decentralized", "local")), slug
        if family != "local":
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
    # D-Lion: SPEC §2 with HEADER_WORDS header words per peer, from its StepStats
    shard = shard_blocks(sum(num_blocks(k) for k in numels), N)
    vote = 4 * (N - 1) * (HEADER_WORDS + 2 * shard)
    assert all(r["sent"] == [vote] * 3 and r["source"] == "StepStats" and r["stats"]
               for r in by["dlion-vote"])
    assert all(r["sent"] == [vote] * 3 for r in by["dlion-vote-ddp-hook"])
    assert all(r["sent"] == [0] * 3 for r in by["dlion-local"])
    assert all(r["sent"][0] > vote for r in by["dlion-average-overlap"])  # 3 planes, buckets
    assert all(r["inter"] is not None and 0 < r["inter"] < vote for r in by["dlion-vote-hier"])
    # gossip: a pair all-reduce of fp32 parameters (ring), pairs or nodes (alternating)
    assert all(r["sent"] == [4 * d] * 3 for r in by["decentralized-ring-accum-adamw"])
    alt = by["decentralized-alternating-exp-ring-accum-lion"]
    assert all(r["source"] == "DecentralizedDataParallel.bytes_sent" and min(r["sent"]) > 0
               for r in alt)


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
    assert settings == "TypeError: settings must be a build.Settings, got dict"


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
