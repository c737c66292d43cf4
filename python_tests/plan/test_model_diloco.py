"""The runtime model's diloco-dlion and diloco-nesterov rows (local steps): per inner step,
compute plus one sync's exposed time and outer pass divided by the H / P steps between syncs;
bytes against the wire format and the ring all-reduce; the overlap rule; the jitter wait; bad input;
the CLI and choose_strategy consider them."""

import json
import math

import pytest

from dlion_kernels.kernels.layout import HEADER_WORDS, WORD_BYTES, aggregate_planes, vote_planes
from dlion_kernels.plan import model
from dlion_kernels.plan.__main__ import main

# 8 Gbit/s = 1 byte per ns: bytes / 1e6 = ms. Zero latency.
GB = dict(inter_gbps=8.0, intra_gbps=8.0, latency_us=0.0, intra_latency_us=0.0)
COMPUTE = dict(fwd_ms=10.0, bwd_ms=20.0, opt_ms=4.0)
D, N = 32_000_000, 4


def _rows(d=D, **kw):
    args = dict(GB, **COMPUTE)
    args.update(kw)
    return {r.strategy: r for r in model.predict(d, N, **args)}


@pytest.mark.parametrize("H, P", [(8, 1), (32, 4)])
def test_hand_computed(H, P):
    rows = _rows(sync_every=H, fragments=P)
    k = H // P
    nest, dl = rows["diloco-nesterov"], rows["diloco-dlion"]
    # Nesterov: a ring all-reduce of the fragment's fp32, 2 (n-1)/n * 4 d / P bytes, per sync
    sync = 2 * (N - 1) / N * 4 * D / P
    assert nest.options["sync_bytes"] == pytest.approx(sync)
    assert nest.bytes_per_rank == pytest.approx(sync / k)
    assert nest.options["sync_ms"] == pytest.approx(sync / 1e6)
    outer = COMPUTE["opt_ms"] / P
    assert nest.step_ms == pytest.approx(34.0 + (sync / 1e6 + outer) / k)
    assert nest.exposed_comm_ms == pytest.approx(sync / 1e6 / k)
    # D-Lion (wire format: 1 bit up, 1 bit down per element, headers, padding): 1/32 and a bit
    shard = math.ceil(D / P / 32 / N)
    up = (N - 1) * (shard * vote_planes("binary") + HEADER_WORDS) * WORD_BYTES
    down = (N - 1) * shard * aggregate_planes("vote", "binary", N) * WORD_BYTES
    assert dl.options["sync_bytes"] == pytest.approx(up + down)
    assert dl.bytes_per_rank == pytest.approx((up + down) / k)
    assert 31 < nest.bytes_per_rank / dl.bytes_per_rank <= 32
    assert dl.step_ms == pytest.approx(34.0 + (dl.options["sync_ms"] + outer) / k)
    assert dl.step_ms < nest.step_ms
    assert (dl.options["sync_every"], dl.options["fragments"]) == (H, P)


def test_per_step_strategies_pay_every_step():
    rows = _rows(sync_every=64)
    assert rows["diloco-nesterov"].bytes_per_rank == pytest.approx(
        rows["lion-allreduce"].bytes_per_rank / 64)
    assert rows["diloco-dlion"].bytes_per_rank == pytest.approx(
        rows["dlion-vote"].bytes_per_rank / 64, rel=1e-3)


def test_overlap_hides_behind_inner_steps():
    # tau = 1 inner step of 34 ms hides all of Nesterov's 24 ms all-reduce (H = 8, P = 1)
    rows = _rows(4_000_000, sync_every=8, overlap_steps=1)
    assert rows["diloco-nesterov"].options["sync_ms"] < 34.0
    assert rows["diloco-nesterov"].exposed_comm_ms == 0.0
    # D-Lion's all_gather is issued at the apply step: it stays exposed
    dl = rows["diloco-dlion"]
    assert 0 < dl.exposed_comm_ms < dl.comm_ms
    # a slow link: only tau x compute of the all-reduce hides
    slow = _rows(4_000_000, sync_every=8, overlap_steps=1, inter_gbps=0.8, intra_gbps=0.8)
    nest = slow["diloco-nesterov"]
    assert nest.exposed_comm_ms == pytest.approx((nest.options["sync_ms"] - 34.0) / 8)
    # the host's work cannot hide
    hosted = _rows(4_000_000, sync_every=8, overlap_steps=1, cpu_gbs=1.0)["diloco-nesterov"]
    assert hosted.exposed_comm_ms > 0


def test_jitter_wait_shrinks_with_longer_windows():
    waits = [_rows(sync_every=h, jitter_ms=10.0)["diloco-dlion"].wait_ms for h in (1, 8, 64)]
    assert waits[0] > waits[1] > waits[2] > 5.0  # the mean delay, J / 2, is always paid
    # H = 1: the slowest of n, as a per-step strategy pays (normal approximation of uniform)
    assert waits[0] == pytest.approx(_rows(jitter_ms=10.0)["dlion-vote"].wait_ms, rel=0.1)
    normal = _rows(sync_every=4, jitter_ms=10.0, jitter_dist="normal")["diloco-dlion"].wait_ms
    assert normal == pytest.approx(10.0 * model.expected_max(N, 1.0, "normal") / 2)


@pytest.mark.parametrize("kwargs, match", [
    (dict(sync_every=6, fragments=4), r"sync_every \(6\) must be a multiple of fragments \(4\)"),
    (dict(sync_every=8, fragments=2, overlap_steps=4), "overlap_steps must be < sync_every / "
     "fragments = 4, got 4"),
    (dict(sync_every=0), "sync_every must be a finite number > 0"),
    (dict(fragments=1.5), "fragments must be a whole number"),
])
def test_bad_inputs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _rows(**kwargs)


def test_choose_strategy_and_cli_consider_them(capsys):
    slow = dict(inter_gbps=0.1, latency_us=30.0, fwd_ms=30.0, bwd_ms=60.0)
    slug, row = model.choose_strategy("10M", 8, allowed=["dlion-vote", "diloco-dlion"], **slow)
    assert (slug, row.strategy) == ("diloco-dlion", "diloco-dlion")
    slug, _ = model.choose_strategy("10M", 8, **slow)  # local steps only when named
    assert not slug.startswith("diloco-")
    slug, _ = model.choose_strategy("10M", 8, allowed=["adamw-allreduce", "diloco-nesterov"],
                                    **slow)
    assert slug == "diloco-nesterov"
    assert main(["--params", "10M", "--ranks", "8", "--inter-gbps", "0.1", "--fwd-ms", "30",
                 "--bwd-ms", "60", "--sync-every", "32", "--fragments", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["strategy"]: r for r in out["rows"]}
    # the fastest per inner step, but not ranked against training steps: best is per step
    assert rows["diloco-dlion"]["step_ms"] < min(
        r["step_ms"] for r in out["rows"] if not r["strategy"].startswith("diloco-"))
    assert out["rows"][0]["strategy"] == "diloco-dlion"  # the rows as predict() ranks them
    assert out["best"] == "dlion-vote-overlap"
    assert rows["diloco-nesterov"]["options"]["sync_every"] == 32
    assert rows["diloco-nesterov"]["options"]["fragments"] == 4
    assert main(["--params", "10M", "--ranks", "8", "--inter-gbps", "0.1", "--fwd-ms", "30",
                 "--bwd-ms", "60", "--sync-every", "32", "--fragments", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = [x.split(" | ")[0].lstrip("| ") for x in lines if x.startswith("| ")][2:]
    local = set(table[-len(model.DILOCO_OUTERS):])  # last: not ranked
    assert local == {f"diloco-{o}" for o in model.DILOCO_OUTERS}
    assert table[-1] == "diloco-nesterov"  # the slowest of them on this slow link
    assert next(x for x in lines if x.startswith("fastest: ")).startswith(
        "fastest: dlion-vote-overlap (")
    ranked_not = next(x for x in lines if x.startswith("not ranked: "))
    assert "diloco-dlion" in ranked_not and "per inner step" in ranked_not
    assert "sync every 32 inner steps" in ranked_not
    pays = next(x for x in lines if x.startswith("when local steps pay: "))
    quick = min((r for r in out["rows"] if r["strategy"].startswith("diloco-")),
                key=lambda r: r["step_ms"])
    ratio = rows["dlion-vote-overlap"]["step_ms"] / quick["step_ms"]
    assert f"{quick['strategy']} takes {ratio:.2f}x less time" in pays
    assert f"fewer than {ratio:.2f}x as many steps" in pays and "H = 32" in pays


def test_local_steps_do_not_pay_on_a_fast_link(capsys):
    assert main(["--params", "1M", "--ranks", "4", "--inter-gbps", "1000", "--fwd-ms", "30",
                 "--bwd-ms", "60", "--sync-every", "8", "--jitter-ms", "20"]) == 0
    pays = next(x for x in capsys.readouterr().out.splitlines()
                if x.startswith("when local steps pay: "))
    assert pays.startswith("when local steps pay: not here (")


@pytest.mark.parametrize("H, P", [(8, 1), (32, 4)])
def test_outer_option_rows_hand_computed(H, P):
    """diloco-dlion-ef and -ef-decay send diloco-dlion's bytes (the decay is ef's row exactly),
    -ef-scale adds one fp32 per tensor gathered; SparseLoCo gathers (header, 8 bytes per tensor,
    2 bytes + 2 bits per kept element); outer passes 1.5 (error feedback) and 2 (SparseLoCo); the
    residual adds 4 bytes per element."""
    T = 40
    rows = _rows(sync_every=H, fragments=P, tensors=T)
    k, t = H // P, math.ceil(T / P)
    dl, ef, efs, sl = (rows[f"diloco-{o}"] for o in ("dlion", "dlion-ef", "dlion-ef-scale",
                                                     "sparseloco"))
    assert ef.options["sync_bytes"] == pytest.approx(dl.options["sync_bytes"])
    decay = rows["diloco-dlion-ef-decay"]  # the decay is free: ef's row exactly
    assert decay.options["sync_bytes"] == pytest.approx(dl.options["sync_bytes"])
    for field in ("step_ms", "compute_ms", "comm_ms", "bytes_per_rank", "memory_bytes_per_rank"):
        assert getattr(decay, field) == pytest.approx(getattr(ef, field)), field
    assert efs.options["sync_bytes"] == pytest.approx(dl.options["sync_bytes"] + (N - 1) * 4 * t)
    kept = math.ceil(D / P * 64 / 4096)
    payload = HEADER_WORDS * WORD_BYTES + 8 * t + 2 * kept + math.ceil(kept / 4)
    assert sl.options["sync_bytes"] == pytest.approx((N - 1) * payload)
    assert sl.bytes_per_rank == pytest.approx((N - 1) * payload / k)
    outer = COMPUTE["opt_ms"] / P
    assert ef.step_ms == pytest.approx(34.0 + (ef.options["sync_ms"] + 1.5 * outer) / k)
    assert decay.step_ms == pytest.approx(34.0 + (decay.options["sync_ms"] + 1.5 * outer) / k)
    assert sl.step_ms == pytest.approx(34.0 + (sl.options["sync_ms"] + 2.0 * outer) / k)
    assert ef.memory_bytes_per_rank == pytest.approx(dl.memory_bytes_per_rank + 4 * D)
    assert sl.memory_bytes_per_rank == pytest.approx(dl.memory_bytes_per_rank)
    # SparseLoCo's list to each of the 3 peers: about 18 bits per 64 elements
    assert sl.options["sync_bytes"] < dl.options["sync_bytes"]


def test_best_ranks_only_per_step_rows():
    """best() names the fastest per-step row; diloco-* rows (per inner step) only among
    themselves."""
    rows = model.predict("10M", 8, inter_gbps=0.1, fwd_ms=30, bwd_ms=60, sync_every=32,
                         fragments=4)
    assert rows[0].strategy == "diloco-dlion" and model.per_inner_step(rows[0])
    assert model.best(rows) == next(r.strategy for r in rows if not model.per_inner_step(r))
    assert model.best([r for r in rows if model.per_inner_step(r)]) == "diloco-dlion"
