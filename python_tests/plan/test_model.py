"""The runtime model: closed forms against hand-computed cases, monotonic behaviour, bad inputs,
the CLI's --json schema, and the helpers for hierarchy="auto" / --strategy auto."""

import itertools
import json
import math
import os
import subprocess
import sys

import pytest

import dlion_kernels as dk
from dlion_kernels import strategies
from dlion_kernels.plan import model
from dlion_kernels.plan.__main__ import main

# 8 Gbit/s = 1 byte per ns: bytes / 1e6 = ms. Zero latency unless a test says otherwise.
GB = dict(inter_gbps=8.0, intra_gbps=8.0, latency_us=0.0, intra_latency_us=0.0)
NO_COMPUTE = dict(fwd_ms=0.0, bwd_ms=0.0, opt_ms=0.0)


def rows_by_name(rows):
    return {r.strategy: r for r in rows}


# ----------------------------------------------------------------------------- closed forms


def test_parse_size_powers_of_ten():
    assert model.parse_size("124M") == 124_000_000
    assert model.parse_size("1.3G") == 1_300_000_000
    assert model.parse_size("7g") == 7_000_000_000
    assert model.parse_size("25k") == 25_000
    assert model.parse_size(4096) == 4096
    assert model.parse_size("4097") == 4097


def test_ring_allreduce_fp32_hand_computed():
    # n = 4 flat, d = 1M fp32 in one bucket: 2 (n-1)/n * 4 MB = 6 MB -> 6 ms at 1 GB/s.
    rows = rows_by_name(model.predict(1_000_000, 4, **GB, **NO_COMPUTE, bucket_mb=100,
                                      algorithm="ring"))
    r = rows["lion-allreduce"]
    assert r.bytes_per_rank == pytest.approx(6e6)
    assert r.inter_bytes_per_rank == pytest.approx(6e6)
    assert r.comm_ms == pytest.approx(6.0)
    assert r.exposed_comm_ms == pytest.approx(6.0) and r.step_ms == pytest.approx(6.0)
    assert rows["lion-allreduce-bf16"].comm_ms == pytest.approx(3.0)
    # Latency: 2 (n-1) ring steps of 10 us each.
    rows = rows_by_name(model.predict(1_000_000, 4, **{**GB, "latency_us": 10.0}, **NO_COMPUTE,
                                      bucket_mb=100, algorithm="ring"))
    assert rows["lion-allreduce"].comm_ms == pytest.approx(6.0 + 6 * 0.010)


def test_tree_allreduce_hand_computed():
    # Tree: 2 ceil(log2 p) alpha + 2 S / beta. p = 8, S = 800 B, alpha = 100 us:
    # ring 14 * (0.1 + 100 B) = 1.4014 ms; tree 6 * 0.1 + 1600 B = 0.6016 ms.
    cl = model.Cluster(8, 1, model.Link(0, 8.0), model.Link(100.0, 8.0), "auto")
    c = model.all_reduce(cl, model.Group(8, 8, 1), 800)
    assert c.algorithm == "tree" and c.ms == pytest.approx(0.6 + 0.0016)
    ring = model.all_reduce(model.Cluster(8, 1, cl.intra, cl.inter, "ring"),
                            model.Group(8, 8, 1), 800)
    assert ring.algorithm == "ring" and ring.ms == pytest.approx(14 * (0.1 + 0.0001))


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_dlion_bytes_are_spec_section2(n):
    # d = 32 * n * 1000 elements: n shards of 1000 words; 2 header words per all_to_all chunk.
    d = 32 * n * 1000
    rows = rows_by_name(model.predict(d, n, **GB, **NO_COMPUTE, modes=("vote", "average"),
                                      bucket_mb=1000))
    vote = rows["dlion-vote"]
    assert vote.bytes_per_rank == (n - 1) * ((1000 + 2) + 1000) * 4
    spec = 2 * (n - 1) / n * d / 8
    assert spec <= vote.bytes_per_rank <= spec + 2 * (n - 1) * 4  # padding: 2 words a peer
    avg = rows["dlion-average"]
    planes = math.ceil(math.log2(n + 1))
    assert avg.bytes_per_rank == (n - 1) * ((1000 + 2) + planes * 1000) * 4
    # Time at 1 byte/ns, no latency: the NIC carries every byte a rank sends.
    assert vote.comm_ms == pytest.approx(vote.bytes_per_rank / 1e6)
    assert vote.exposed_comm_ms == vote.comm_ms
    # 1/32 of the fp32 ring all-reduce, up to the padding.
    fp32 = rows["lion-allreduce"]
    assert fp32.bytes_per_rank / vote.bytes_per_rank == pytest.approx(32, rel=1e-3)


def test_all_to_all_shares_the_node_nic():
    # 2 nodes of 2: a rank sends 1 shard inside its node, 2 across; the NIC carries 2 x 2.
    cl = model.Cluster(4, 2, model.Link(0, 80.0), model.Link(0, 8.0))
    c = model.all_to_all(cl, model.Group(4, 2, 2), 1000)
    assert c.intra_bytes == 1000 and c.inter_bytes == 2000
    assert c.ms == pytest.approx(4000 / 1e6)


@pytest.mark.parametrize("gather", ["aggregate", "params"])
def test_hierarchical_hand_computed(gather):
    # n = 8 as 2 nodes of 4 (N = 2 voters), d = 32 * 4 * 2 * 1000: each rank's 1/L shard has
    # 2000 blocks, 1000 per voter. Intra 80 Gbit/s (10 B/ns), inter 8 Gbit/s (1 B/ns).
    d, n, L = 32 * 4 * 2 * 1000, 8, 4
    inputs = dict(inter_gbps=8.0, intra_gbps=80.0, latency_us=0.0, intra_latency_us=0.0)
    r = rows_by_name(model.predict(d, n, L, **inputs, **NO_COMPUTE, bucket_mb=1000,
                                   topologies=[], hier_gather=gather))["dlion-vote-hier"]
    rs = (L - 1) * 4 * d / L  # reduce-scatter of fp32 gradients
    if gather == "params":
        ag = (L - 1) * 4 * d / L  # all-gather of fp32 parameter shards
    else:
        ag = (L - 1) * 2000 * 4  # all-gather of the packed aggregate: 1 bit per element
    up, down = (1000 + 2) * 4, 1000 * 4  # one message each way between the 2 voters
    assert r.intra_bytes_per_rank == pytest.approx(rs + ag)
    assert r.inter_bytes_per_rank == pytest.approx(up + down)
    # The L inter groups cross the node's NIC at once: L x (up + down) bytes at 1 B/ns.
    expected = (rs + ag) / 10 / 1e6 + L * (up + down) / 1e6
    assert r.comm_ms == pytest.approx(expected)
    # Inter bytes per rank: 1/L of flat D-Lion with N voters (hierarchy=L), plus a header word.
    flat_n_voters = 2 * (2 - 1) / 2 * d / 8
    assert r.inter_bytes_per_rank <= flat_n_voters / L + 2 * 4


def test_expected_max_closed_forms():
    assert model.expected_max(1, 10.0, "uniform") == pytest.approx(5.0)
    assert model.expected_max(4, 10.0, "uniform") == pytest.approx(8.0)
    assert model.expected_max(2, 3.0, "normal") == pytest.approx(3.0 / math.sqrt(math.pi),
                                                                 rel=1e-6)
    assert model.expected_max(3, 1.0, "normal") == pytest.approx(1.5 / math.sqrt(math.pi),
                                                                 rel=1e-6)
    assert model.expected_max(1000, 0.0) == 0.0


def test_bucket_timeline():
    # Buckets ready at 10, 20, 30 taking 15 each on one channel: 25, 40, 55.
    assert model.bucket_timeline([10, 20, 30], [15, 15, 15]) == 55
    assert model.bucket_timeline([10, 20, 30], [1, 1, 1]) == 31


def test_ddp_overlap_hides_all_but_the_last_bucket():
    # 4 buckets of 250k fp32 (1 MB) over n = 2 flat: 1 MB each = 1 ms per bucket; backward
    # 100 ms: only the last bucket is exposed. jitter 10 uniform, n = 2: wait 20/3.
    rows = rows_by_name(model.predict(1_000_000, 2, **GB, fwd_ms=50, bwd_ms=100, opt_ms=5,
                                      jitter_ms=10, bucket_mb=1e6 / 2**20, algorithm="ring"))
    r = rows["lion-allreduce"]
    assert r.buckets == 4
    assert r.comm_ms == pytest.approx(4.0)
    assert r.exposed_comm_ms == pytest.approx(1.0)
    assert r.wait_ms == pytest.approx(20 / 3)
    assert r.step_ms == pytest.approx(50 + 20 / 3 + 100 + 1.0 + 5)
    # Without overlap, D-Lion exposes all of its exchange; with overlap only the last bucket's.
    off, on = rows["dlion-vote"], rows["dlion-vote-overlap"]
    assert off.exposed_comm_ms == pytest.approx(off.comm_ms)
    assert on.exposed_comm_ms < off.exposed_comm_ms
    assert off.step_ms == pytest.approx(50 + 20 / 3 + 100 + 5 + off.comm_ms)


def test_decentralized_ring_hides_gossip_and_waits_for_its_pair():
    # n = 4 flat, 1M fp32 params: a pair all-reduce sends S = 4 MB per rank: 4 ms.
    rows = rows_by_name(model.predict(1_000_000, 4, **GB, fwd_ms=50, bwd_ms=100, opt_ms=5,
                                      jitter_ms=12, bucket_mb=100))
    ring = rows["decentralized-ring-accum-adamw"]
    assert ring.comm_ms == pytest.approx(4.0)
    assert ring.bytes_per_rank == pytest.approx(4e6)
    assert ring.exposed_comm_ms == 0.0
    assert ring.wait_ms == pytest.approx(12 * 2 / 3)  # the pair, not all 4
    assert ring.step_ms == pytest.approx(155 + 8)
    assert rows["decentralized-complete-accum-adamw"].wait_ms == pytest.approx(12 * 4 / 5)
    # No compute to hide behind: the step is the gossip.
    rows = rows_by_name(model.predict(1_000_000, 4, **GB, **NO_COMPUTE, bucket_mb=100))
    assert rows["decentralized-ring-accum-adamw"].step_ms == pytest.approx(4.0)


def test_rows_have_every_strategy_and_are_sorted():
    rows = model.predict("124M", 32, 8, inter_gbps=25, intra_gbps=1600, latency_us=30,
                         fwd_ms=80, bwd_ms=160, jitter_ms=10)
    names = {r.strategy for r in rows}
    assert names == {"lion-allreduce", "lion-allreduce-bf16", "dlion-vote", "dlion-vote-overlap",
                     "dlion-vote-hier", "dlion-vote-hier-overlap",
                     "decentralized-complete-accum-adamw",
                     "decentralized-ring-accum-adamw", "decentralized-one-peer-exp-accum-adamw",
                     "decentralized-alternating-exp-ring-accum-adamw", "fsdp-allreduce",
                     "fsdp-allreduce-bf16", "fsdp-dlion", "fsdp-dlion-overlap",
                     "diloco-dlion", "diloco-nesterov", "diloco-dlion-ef",
                     "diloco-dlion-ef-decay", "diloco-dlion-ef-scale", "diloco-sparseloco"}
    assert [r.step_ms for r in rows] == sorted(r.step_ms for r in rows)
    assert model.best(rows) == rows[0].strategy
    for r in rows:
        assert r.exposed_comm_ms <= r.comm_ms + 1e-9
        assert r.step_ms >= r.compute_ms + r.wait_ms - 1e-9
        assert r.bytes_per_rank == pytest.approx(r.intra_bytes_per_rank
                                                 + r.inter_bytes_per_rank)


def test_topologies_that_do_not_fit_are_left_out():
    names = {r.strategy for r in model.predict("10M", 6, 2, inter_gbps=10, fwd_ms=1, bwd_ms=2)}
    assert {"decentralized-ring-accum-adamw", "decentralized-complete-accum-adamw"} <= names
    assert "decentralized-one-peer-exp-accum-adamw" not in names  # 6 is not a power of two
    assert "decentralized-alternating-exp-ring-accum-adamw" not in names  # 3 nodes


# ----------------------------------------------------------------------------- monotonic

GRID = list(itertools.product(["1M", "124M"], [(4, 1), (8, 2), (16, 4)], [1.0, 10.0, 100.0]))


@pytest.mark.parametrize("params,shape,gbps", GRID)
def test_more_bandwidth_never_slower(params, shape, gbps):
    n, L = shape
    base = dict(latency_us=30, fwd_ms=20, bwd_ms=40, jitter_ms=5, modes=("vote", "average"))
    for algorithm in ("auto", "ring"):
        slow = rows_by_name(model.predict(params, n, L, inter_gbps=gbps, intra_gbps=4 * gbps,
                                          algorithm=algorithm, **base))
        for faster in (dict(inter_gbps=2 * gbps, intra_gbps=4 * gbps),
                       dict(inter_gbps=gbps, intra_gbps=40 * gbps)):
            fast = rows_by_name(model.predict(params, n, L, algorithm=algorithm, **faster,
                                              **base))
            for name, r in slow.items():
                assert fast[name].step_ms <= r.step_ms + 1e-9, name
                assert fast[name].comm_ms <= r.comm_ms + 1e-9, name
        lower = rows_by_name(model.predict(params, n, L, inter_gbps=gbps, intra_gbps=4 * gbps,
                                           algorithm=algorithm, **{**base, "latency_us": 3}))
        for name, r in slow.items():
            assert lower[name].step_ms <= r.step_ms + 1e-9, name


@pytest.mark.parametrize("dist", ["uniform", "normal"])
def test_more_jitter_never_faster(dist):
    prev = None
    for jitter in (0, 1, 5, 20, 80):
        rows = rows_by_name(model.predict("124M", 16, 4, inter_gbps=10, intra_gbps=100,
                                          fwd_ms=30, bwd_ms=60, jitter_ms=jitter,
                                          jitter_dist=dist))
        if prev:
            for name, r in rows.items():
                assert r.step_ms >= prev[name].step_ms - 1e-9, name
        prev = rows
    # A gossip pair waits less than the whole group.
    assert prev["decentralized-ring-accum-adamw"].wait_ms < prev["lion-allreduce"].wait_ms


def test_more_ranks_wait_longer():
    waits = [model.expected_max(k, 10, d) for d in ("uniform", "normal") for k in (2, 4, 32)]
    assert waits[0] < waits[1] < waits[2] and waits[3] < waits[4] < waits[5]


# ----------------------------------------------------------------------------- bad inputs

OK = dict(inter_gbps=10, fwd_ms=1, bwd_ms=2)


@pytest.mark.parametrize("kwargs,match", [
    (dict(params=-5), "params must be a finite number >= 0"),
    (dict(params="12X"), "unknown unit 'X'"),
    (dict(params="twelve"), "cannot read 'twelve'"),
    (dict(params="1e400"), "params must be a finite number"),
    (dict(ranks=0), "ranks must be a finite number > 0"),
    (dict(ranks=6, ranks_per_node=4), r"ranks \(6\) must be a multiple of ranks_per_node \(4\)"),
    (dict(ranks=2.5), "ranks must be a whole number"),
    (dict(inter_gbps=0), "inter_gbps must be a finite number > 0"),
    (dict(intra_gbps=-1), "intra_gbps must be a finite number > 0"),
    (dict(fwd_ms=-1), "fwd_ms must be a finite number >= 0"),
    (dict(jitter_ms=-1), "jitter_ms must be a finite number >= 0"),
    (dict(jitter_dist="pareto"), "jitter_dist must be one of uniform, normal"),
    (dict(algorithm="bcube"), "algorithm must be one of auto, ring, tree"),
    (dict(modes=("majority",)), "unknown mode 'majority'"),
    (dict(grad_dtype="int8"), "grad_dtype must be one of fp32, bf16, fp16"),
    (dict(ranks=6, topologies=["one-peer-exp"]), "power-of-two number of ranks, got 6"),
    (dict(ranks=5, topologies=["ring"]), "'ring' needs an even number of ranks, got 5"),
    (dict(ranks=12, ranks_per_node=4, topologies=["alternating-exp-ring"]),
     "power-of-two number >= 2 of nodes; 12 ranks in nodes of 4 make 3 node"),
    (dict(topologies=["star"]), "topology must be one of .*, got 'star'"),
    (dict(strategies=["dlion-foo"]), r"\['dlion-foo'\] not among the strategies"),
])
def test_bad_inputs_raise_clear_errors(kwargs, match):
    args = dict(params="124M", ranks=8, ranks_per_node=1, **OK)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        model.predict(args.pop("params"), args.pop("ranks"), args.pop("ranks_per_node"), **args)


def test_bad_types_raise_type_error():
    with pytest.raises(TypeError, match="params must be a number or a string"):
        model.predict([1], 4, **OK)
    with pytest.raises(TypeError, match="fwd_ms must be a number"):
        model.predict("1M", 4, inter_gbps=10, fwd_ms="80", bwd_ms=1)


# ----------------------------------------------------------------------------- CLI

CMD = ["--params", "124M", "--ranks", "32", "--ranks-per-node", "8", "--inter-gbps", "25",
       "--intra-gbps", "1600", "--latency-us", "30", "--fwd-ms", "80", "--bwd-ms", "160",
       "--jitter-ms", "10"]


def test_cli_json_schema(capsys):
    assert main(CMD + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"rows", "best", "inputs"}
    per_step = [r for r in out["rows"] if r["options"]["kind"] != "diloco"]
    assert out["best"] == per_step[0]["strategy"]
    for row in out["rows"]:
        for key, kind in [("strategy", str), ("step_ms", float), ("comm_ms", float),
                          ("exposed_comm_ms", float), ("bytes_per_rank", (int, float)),
                          ("intra_bytes_per_rank", (int, float)),
                          ("inter_bytes_per_rank", (int, float))]:
            assert isinstance(row[key], kind), key
    steps = [r["step_ms"] for r in out["rows"]]
    assert steps == sorted(steps)
    assert out["inputs"]["params"] == 124_000_000 and out["inputs"]["ranks"] == 32
    # The Python API returns the same rows; best() ranks the per-step ones.
    py = dk.plan.predict("124M", 32, 8, inter_gbps=25, intra_gbps=1600, latency_us=30,
                         fwd_ms=80, bwd_ms=160, jitter_ms=10)
    assert [r.as_dict() for r in py] == out["rows"]
    assert dk.plan.best(py) == out["best"]


def test_cli_table(capsys):
    assert main(CMD) == 0
    out = capsys.readouterr().out
    assert "| strategy | step ms |" in out
    assert "fastest: " in out and "exposed ms:" in out


@pytest.mark.parametrize("argv,match", [
    (["--params", "12X", "--ranks", "4", "--inter-gbps", "1", "--fwd-ms", "1", "--bwd-ms", "1"],
     "unknown unit"),
    (["--params", "1M", "--ranks", "6", "--ranks-per-node", "4", "--inter-gbps", "1",
      "--fwd-ms", "1", "--bwd-ms", "1"], "must be a multiple of ranks_per_node"),
    (["--params", "1M", "--ranks", "5", "--inter-gbps", "1", "--fwd-ms", "1", "--bwd-ms", "1",
      "--topologies", "ring"], "even number of ranks"),
    (["--params", "1M", "--ranks", "4"], "--inter-gbps, --fwd-ms, --bwd-ms"),
    (["--params", "1M", "--ranks", "4", "--inter-gbps", "1", "--fwd-ms", "1", "--bwd-ms", "1",
      "--topologies", "star"], "unknown"),
])
def test_cli_bad_inputs(argv, match, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert match in capsys.readouterr().err


def test_model_needs_no_torch():
    # plan.model and what it imports (the topology rules, the wire layout) load and predict
    # with torch made unimportable. The package's own __init__ is replaced by an empty package
    # here: whether it stays light is its own test's business.
    root = os.path.dirname(os.path.dirname(os.path.dirname(model.__file__)))
    code = ("import sys, types\n"
            "sys.modules['torch'] = None\n"
            "pkg = types.ModuleType('dlion_kernels')\n"
            f"pkg.__path__ = [{os.path.join(root, 'dlion_kernels')!r}]\n"
            "sys.modules['dlion_kernels'] = pkg\n"
            "from dlion_kernels.plan import model as m\n"
            "rows = m.predict('124M', 8, 2, inter_gbps=10, fwd_ms=1, bwd_ms=2)\n"
            "print(m.best(rows))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in {r.strategy for r in rows_by_name(
        model.predict("124M", 8, 2, inter_gbps=10, fwd_ms=1, bwd_ms=2)).values()}


# ----------------------------------------------------------------------------- callers


def test_choose_hierarchy():
    slow_inter = dict(inter_gbps=1, intra_gbps=1000, fwd_ms=10, bwd_ms=20)
    assert model.choose_hierarchy(16, 4, "124M", **slow_inter) == 4
    # Intra-node links slower than the network: averaging inside the node does not pay.
    slow_intra = dict(inter_gbps=100, intra_gbps=1, fwd_ms=10, bwd_ms=20)
    assert model.choose_hierarchy(16, 4, "124M", **slow_intra) == 1
    assert model.choose_hierarchy(16, 1, "124M", **slow_inter) == 1


def test_choose_strategy():
    inputs = dict(inter_gbps=1, intra_gbps=1000, fwd_ms=10, bwd_ms=20)
    slug, row = model.choose_strategy("124M", 16, 4, **inputs)
    every = model.predict("124M", 16, 4, modes=("vote", "average"), **inputs)
    per_step = [r for r in every if not r.strategy.startswith("diloco-")]  # unless named
    assert row.strategy == model.best(per_step) and strategies.get(slug).row == row.strategy
    slug, row = model.choose_strategy("124M", 16, 4, allowed=["adamw-allreduce", "dlion-vote"],
                                      **inputs)
    assert (slug, row.strategy) == ("dlion-vote", "dlion-vote")
    assert row.options == {"kind": "dlion", "mode": "vote", "votes": "binary", "overlap": False,
                           "hierarchy": 1}


def test_rank_strategies_names_every_row_once():
    """Every row of the model predicts a named strategy; strategies one row predicts appear
    once (by the row's own slug when it is allowed); those that cannot run on the cluster are
    left out."""
    inputs = dict(inter_gbps=10, fwd_ms=10, bwd_ms=20)
    ranked = model.rank_strategies("10M", 6, 2, **inputs)
    rows = {r.strategy for r in model.predict("10M", 6, 2, modes=("vote", "average"),
                                              **inputs)}
    # every row but local steps (diloco-*), which are ranked only when named
    assert {r.strategy for _, r in ranked} == {r for r in rows if not r.startswith("diloco-")}
    named = model.rank_strategies("10M", 6, 2, allowed=["diloco-dlion", "diloco-nesterov"],
                                  **inputs)
    assert {r.strategy for _, r in named} == {"diloco-dlion", "diloco-nesterov"}
    slugs = dict((r.strategy, slug) for slug, r in ranked)
    assert slugs["lion-allreduce"] == "lion-allreduce"  # the row's own slug, when allowed
    assert slugs["dlion-average-hier-overlap"] == "dlion-average-hier-overlap"
    assert "decentralized-one-peer-exp-accum-adamw" not in slugs  # 6 ranks: not a power of two
    steps = [r.step_ms for _, r in ranked]
    assert steps == sorted(steps)
    ranked = model.rank_strategies("10M", 6, 2, allowed=["lion-allreduce", "adamw-allreduce",
                                                        "dlion-vote-hier"], **inputs)
    assert sorted(slug for slug, _ in ranked) == ["dlion-vote-hier", "lion-allreduce"]
    # a row shared by two strategies goes by its own slug when allowed, else by the other's
    for allowed, slug in [(["adamw-allreduce", "lion-allreduce"], "lion-allreduce"),
                          (["adamw-allreduce"], "adamw-allreduce")]:
        ranked = model.rank_strategies("10M", 6, 2, allowed=allowed, **inputs)
        assert [(s, r.strategy) for s, r in ranked] == [(slug, "lion-allreduce")]
    # one rank per node: the hierarchical strategy cannot run and is left out
    ranked = model.rank_strategies("10M", 6, 1, allowed=["dlion-vote", "dlion-vote-hier"],
                                   **inputs)
    assert [slug for slug, _ in ranked] == ["dlion-vote"]
    with pytest.raises(ValueError, match="no row for 'dlion-no-comm'"):
        model.rank_strategies("10M", 6, 2, allowed=["dlion-no-comm"], **inputs)
    with pytest.raises(ValueError, match="none of .* can run on 6 ranks"):
        model.rank_strategies("10M", 6, 1, allowed=["dlion-vote-hier"], **inputs)
    with pytest.raises(ValueError, match="unknown strategy 'dlion-median'"):
        model.rank_strategies("10M", 6, 2, allowed=["dlion-median"], **inputs)


def test_one_rank_sends_nothing():
    rows = model.predict("124M", 1, **OK)
    assert {r.strategy for r in rows} >= {"lion-allreduce", "dlion-vote",
                                          "decentralized-ring-accum-adamw"}
    for r in rows:
        assert r.comm_ms == 0 and r.bytes_per_rank == 0 and r.wait_ms == 0
        assert r.step_ms == pytest.approx(r.compute_ms)


def test_host_work_needs_the_cores():
    # cpu_gbs = 1 GB/s: a ring all-reduce of 4 MB over n = 2 sends 4 MB and sums 2 MB: 6 ms of
    # host work; the link takes 4 ms. It overlaps the transfer but not backward.
    inputs = dict(**GB, fwd_ms=10, bwd_ms=100, opt_ms=0, bucket_mb=100, algorithm="ring")
    free = rows_by_name(model.predict(1_000_000, 2, **inputs))["lion-allreduce"]
    busy = rows_by_name(model.predict(1_000_000, 2, **inputs, cpu_gbs=1.0))["lion-allreduce"]
    assert free.comm_ms == pytest.approx(4.0) and busy.comm_ms == pytest.approx(6.0)
    assert busy.exposed_comm_ms == pytest.approx(6.0)
    assert busy.step_ms == pytest.approx(10 + 100 + 6)
