"""The runtime model's FSDP2 rows: fsdp-allreduce[-bf16] (HSDP) and fsdp-dlion[-overlap], their
bytes inside and between nodes and their memory per rank against the wire-format and FSDP2 byte
formulas, their times in hand-checkable cases, and the callers (``choose_strategy``, the CLI) that
consider them."""

import math

import pytest

from dlion_kernels.kernels.layout import BLOCK, HEADER_WORDS, WORD_BYTES, shard_blocks
from dlion_kernels.plan import model
from dlion_kernels.plan.__main__ import main

# 8 Gbit/s = 1 byte per ns: bytes / 1e6 = ms. No latency, no compute unless a test says so.
GB = dict(inter_gbps=8.0, intra_gbps=8.0, latency_us=0.0, intra_latency_us=0.0)
NO_COMPUTE = dict(fwd_ms=0.0, bwd_ms=0.0, opt_ms=0.0)
FSDP = ("fsdp-allreduce", "fsdp-allreduce-bf16", "fsdp-dlion",
        "fsdp-dlion-overlap")


def rows(d, n, L, **kw):
    return {r.strategy: r for r in model.predict(d, n, L, **{**GB, **NO_COMPUTE, **kw})}


@pytest.mark.parametrize("n, L", [(4, 2), (8, 2), (8, 4)])
def test_bytes_are_spec(n, L):
    N, d = n // L, 32 * 1000 * n  # whole blocks on every shard
    r = rows(d, n, L, bucket_mb=1000)
    gathers = 2 * (L - 1) / L * 4 * d  # fp32 parameter shards, forward and backward
    # HSDP: reduce-scatter in the node, ring all-reduce of the d / L shard among N replicas
    for name, wire in [("fsdp-allreduce", 4), ("fsdp-allreduce-bf16", 2)]:
        inter = 2 * (N - 1) / N * wire * d / L
        assert r[name].inter_bytes_per_rank == pytest.approx(inter)
        assert r[name].intra_bytes_per_rank == pytest.approx(gathers + (L - 1) / L * wire * d)
    # D-Lion: the wire-format bytes for N voters on the d / L local elements (what hierarchy=L sends
    # between nodes), plus the header gather in the node: 8 N bytes from each of the L - 1 peers
    for name in ("fsdp-dlion", "fsdp-dlion-overlap"):
        shard = shard_blocks(math.ceil(d / L / BLOCK), N)
        vote = (N - 1) * (2 * shard + HEADER_WORDS) * WORD_BYTES
        assert r[name].inter_bytes_per_rank == pytest.approx(vote)
        spec = 2 * (N - 1) / N * d / (8 * L)
        assert spec <= r[name].inter_bytes_per_rank <= spec + 2 * (N - 1) * WORD_BYTES * 2
        assert r[name].inter_bytes_per_rank == pytest.approx(
            r["dlion-vote-hier"].inter_bytes_per_rank)
        header = (L - 1) * N * HEADER_WORDS * WORD_BYTES
        assert r[name].intra_bytes_per_rank == pytest.approx(gathers + (L - 1) / L * 4 * d
                                                             + header)
    # 1 bit against 32 between nodes, plus the header words
    assert 30 < (r["fsdp-allreduce"].inter_bytes_per_rank
                 / r["fsdp-dlion"].inter_bytes_per_rank) <= 32


def test_memory_per_rank():
    d, n, L = 10**6, 8, 4
    r = rows(d, n, L, param_dtype="fp32")
    for name in FSDP:  # parameters, gradients, fp32 momentum: each 4d / L
        assert (r[name].param_bytes_per_rank, r[name].grad_bytes_per_rank,
                r[name].state_bytes_per_rank) == (4 * d / L,) * 3
        assert r[name].memory_bytes_per_rank == pytest.approx(12 * d / L)
        # the FSDP2 memory target: at most 1/L of flat D-Lion's, plus 5%
        assert r[name].memory_bytes_per_rank <= 1.05 * r["dlion-vote"].memory_bytes_per_rank / L
    assert r["dlion-vote"].memory_bytes_per_rank == 12 * d
    assert r["lion-allreduce"].memory_bytes_per_rank == 12 * d  # DDP + Lion
    assert r["dlion-vote-hier"].state_bytes_per_rank == 4 * d / L  # hierarchy shards momentum
    assert r["decentralized-ring-accum-adamw"].memory_bytes_per_rank is None
    assert r["fsdp-dlion"].as_dict()["memory_bytes_per_rank"] == 12 * d / L
    bf16 = rows(d, n, L, param_dtype="bf16", grad_dtype="bf16")["fsdp-dlion"]
    assert (bf16.param_bytes_per_rank, bf16.state_bytes_per_rank) == (2 * d / L, 4 * d / L)


def test_times_hand_computed():
    """No compute, one unit, 1 byte/ns everywhere: the step is its collectives back to back;
    the replica all-reduce of the L replicate groups shares the node's link (L streams)."""
    d, n, L = 4 * 10**6, 4, 2
    r = rows(d, n, L, bucket_mb=1000, algorithm="ring")
    hsdp = r["fsdp-allreduce"]
    intra = hsdp.intra_bytes_per_rank / 1e6  # one link each, 1 ms per MB
    inter = L * hsdp.inter_bytes_per_rank / 1e6
    assert hsdp.step_ms == pytest.approx(intra + inter)
    assert hsdp.comm_ms == pytest.approx(intra + inter) == hsdp.exposed_comm_ms
    dl = r["fsdp-dlion"]
    assert dl.step_ms == pytest.approx(dl.comm_ms)
    # much compute, many units: overlap hides the per-unit votes behind backward
    r = rows(10**8, 8, 2, bucket_mb=25, inter_gbps=1.0, intra_gbps=100.0, fwd_ms=300.0,
             bwd_ms=600.0, opt_ms=10.0)
    assert r["fsdp-dlion-overlap"].exposed_comm_ms < r["fsdp-dlion"].exposed_comm_ms
    assert r["fsdp-dlion"].compute_ms == pytest.approx(300 + 600 + 10 / 2)
    # the replica sync is the difference: 1 bit against 32 at 1 Gbit/s
    assert r["fsdp-allreduce"].step_ms > 3 * r["fsdp-dlion-overlap"].step_ms
    assert r["fsdp-allreduce-bf16"].step_ms < r["fsdp-allreduce"].step_ms


def test_only_with_nodes():
    names = {r.strategy for r in model.predict("10M", 4, 1, inter_gbps=10, fwd_ms=1, bwd_ms=2)}
    assert not {n for n in names if n.startswith("fsdp")}


def test_choose_strategy_considers_fsdp():
    inputs = dict(inter_gbps=1.0, intra_gbps=100.0, fwd_ms=300.0, bwd_ms=600.0)
    slug, row = model.choose_strategy("100M", 8, 2, allowed=["fsdp-allreduce", "fsdp-dlion",
                                                               "fsdp-dlion-overlap"], **inputs)
    assert (slug, row.strategy) == ("fsdp-dlion-overlap", "fsdp-dlion-overlap")
    ranked = dict(model.rank_strategies("100M", 8, 2, **inputs))
    assert {"fsdp-allreduce", "fsdp-allreduce-bf16", "fsdp-dlion",
            "fsdp-dlion-overlap"} <= set(ranked)
    assert ranked["fsdp-allreduce-bf16"].strategy == "fsdp-allreduce-bf16"
    with pytest.raises(ValueError, match="none of .* can run on 8 ranks in nodes of 1"):
        model.choose_strategy("100M", 8, 1, allowed=["fsdp-dlion"], **inputs)


def test_cli_lists_fsdp_rows_with_memory(capsys):
    assert main(["--params", "25M", "--ranks", "4", "--ranks-per-node", "2", "--inter-gbps",
                 "1", "--fwd-ms", "100", "--bwd-ms", "200"]) == 0
    out = capsys.readouterr().out
    assert "| mem MB |" in out
    line = next(x for x in out.splitlines() if x.startswith("| fsdp-dlion |"))
    assert line.rstrip(" |").endswith("150.0")  # 3 x 4 bytes x 25M / 2
