"""Whole training steps (forward + backward + optimizer) over an emulated network.

Every configuration (link rate, n ranks laid out as N nodes x L ranks per node) builds the
network of ``network.py`` (one namespace per node, tbf-shaped veths into a bridge, intra-node
traffic on the namespace's loopback), starts n rank processes (gloo, 1 thread each) and runs
every variant side by side, one after the other, on the same processes:

Variants are strategies of ``dlion_kernels/strategies.py`` (``--variants``, ``--hier-variants``:
slugs; the legacy variant keys in brackets are accepted too), built on each rank by
``dlion_kernels/recipes/`` with lr 1e-4, no weight decay, ``accum_steps=4`` and the case's
``bucket_mb``. By default:

======================================  ============================================================
``dlion-no-comm`` [no_comm]               D-Lion with its exchange replaced by a local tally on a
                                        one-rank group: T_no_comm, the step without communication
``lion-allreduce`` [ddp_fp32]           DDP, its default overlapped fp32 all-reduce, then Lion
``lion-allreduce-fp16`` [ddp_fp16]      DDP + ``fp16_compress_hook``, then Lion
``lion-allreduce-bf16`` [ddp_bf16]      DDP + a bf16 compress hook (torch's ``bf16_compress_hook``
                                        refuses non-NCCL groups), then Lion
``dlion-vote`` [dlion]                  ``DistributedLion(overlap=False)``: the exchange in step()
``dlion-vote-overlap`` [dlion_overlap]  ``DistributedLion(overlap=True, bucket_mb=...)``
``dlion-vote-ddp-hook``                 DDP + ``register_ddp_comm_hook(ddp, opt)``
``dlion-vote-hier`` [dlion_hier]        ``DistributedLion(hierarchy=L)`` (layouts with L > 1)
``dlion-vote-hier-overlap``             the same with ``overlap=True``
``lion-allreduce-hier`` [hier_fp32]     DDP + a hook: reduce-scatter in the node, all-reduce of the
                                        shard across nodes, all-gather in the node, then Lion
``fsdp-dlion``, ``fsdp-dlion-overlap``  FSDP2 on each layer inside the node, D-Lion's vote between
                                        the replicas (L > 1; not by default: ``--hier-variants``)
``fsdp-allreduce``, ``-bf16``           FSDP2's HSDP (replica all-reduce fp32 / bf16), then Lion
``decentralized-<topology>-accum-adamw``  ``DecentralizedDataParallel`` + ``AccumAdamW``,
  [dec_ring, ...]                       topologies ring, one-peer-exp, alternating-exp-ring
======================================  ============================================================

A variant that does not fit the layout (``Strategy.problem``) is listed with
``status = "skipped"`` and the reason.

The model: ``--depth`` x (Linear(width, width) + GELU), 24 x 1024 = 25.2M fp32 parameters by
default, MSE on generated data (one fixed batch per rank, different per rank). One step: [optional
jitter sleep], forward, backward, ``opt.step()``. The warm-up steps and the first timed step start
at a barrier; the timed steps then run back to back, and a step's time is from its start to the
next one's (the last: to the end of any outstanding gossip plus a barrier), so traffic that
crosses a step boundary is paid where it is waited for. Timed phases per rank: fwd, bwd
(includes what DDP / overlap communication the backward waits for), opt.
``--jitter-ms J`` adds a uniform random 0..J ms sleep per rank per step before the forward (a
straggler model for the decentralized / runtime-model experiments).

Output (``bench/results/training-<stamp>/`` or ``--out``): ``bench_training.json`` (metadata with
the command, date, ``uptime`` load before and after, torch version; ``rows``; ``summary``;
``bucket_fits``; ``raw`` per-rank times), ``bench_training.csv`` (rows), ``bench_training.md``
(tables, with the memory per rank: parameters, gradients and optimizer state counted from the
tensors, and the peak RSS) and ``bench_training.png`` (batch sweep: whole-step ratio against
D-Lion). Row schema:
see ``ROW_SCHEMA`` below (also written into the JSON).

    sudo python bench/bench_training.py                  # full sweep, ~25-30 min on 2 quiet cores
    sudo python bench/bench_training.py --smoke          # tiny model, n = 2, < 1 min
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import network  # noqa: E402

from dlion_kernels import strategies  # noqa: E402
from dlion_kernels.accounting import BUCKET_MB  # noqa: E402

WORKER = os.path.join(common.BENCH_DIR, "training_worker.py")  # one rank of a configuration

VARIANTS = ["dlion-no-comm", "lion-allreduce", "lion-allreduce-fp16", "lion-allreduce-bf16",
            "dlion-vote", "dlion-vote-overlap", "dlion-vote-ddp-hook", "dlion-vote-hier",
            "dlion-vote-hier-overlap", "lion-allreduce-hier", "decentralized-ring-accum-adamw",
            "decentralized-one-peer-exp-accum-adamw",
            "decentralized-alternating-exp-ring-accum-adamw"]
HIER_VARIANTS = ["dlion-no-comm", "lion-allreduce", "dlion-vote", "dlion-vote-overlap",
                 "dlion-vote-hier", "dlion-vote-hier-overlap", "lion-allreduce-hier",
                 "decentralized-alternating-exp-ring-accum-adamw"]
NO_COMM, DLION, DDP_FP32 = "dlion-no-comm", "dlion-vote", "lion-allreduce"  # the references
BATCH_SWEEP_VARIANTS = [NO_COMM, DDP_FP32, "lion-allreduce-fp16", "lion-allreduce-bf16", DLION,
                        "dlion-vote-overlap"]
BUCKET_SWEEP_VARIANTS = [DDP_FP32, "dlion-vote-overlap", "dlion-vote-ddp-hook"]
# an overlapped variant's hidden fraction is judged against the same exchange without overlap
OVERLAP_REFERENCE = {"dlion-vote-overlap": DLION, "dlion-vote-ddp-hook": DLION,
                     "dlion-vote-hier-overlap": "dlion-vote-hier"}

ROW_SCHEMA = {
    "n": "ranks (world size)",
    "nodes": "namespaces (emulated hosts) N; n = N * ranks_per_node",
    "ranks_per_node": "L, rank processes per namespace (intra-node traffic on its loopback)",
    "layout": "'flat' (L = 1) or 'NxL'",
    "rate_gbps": "tbf rate of each node's link, both directions, Gbit/s",
    "variant": "strategy slug (dlion_kernels/strategies.py); 'label' is its display name",
    "sweep": "'main', 'batch' (batch-size sweep) or 'bucket' (bucket_mb sweep)",
    "status": "'ok' or 'skipped' ('skip_reason' says why; the timing fields are then null)",
    "params": "model parameters", "batch": "samples per rank per step",
    "bucket_mb": "bucket size given to DDP / overlap / gossip", "buckets": "buckets used",
    "buckets_source": "'engine' (read from the object), 'estimate' (greedy over param sizes)",
    "jitter_ms": "max of the uniform random extra delay per rank per step",
    "step_ms_median": "median over reps and ranks of a rank's step time",
    "step_ms_slowest_rank": "median over reps of the slowest rank's step time (the step time)",
    "step_ms_rank0": "median over reps of rank 0's step time",
    "own_fwd_ms": "this variant's forward, median over reps and ranks",
    "own_bwd_ms": "this variant's backward (with the communication it waits for), median",
    "own_opt_ms": "this variant's opt.step() (with its communication), median",
    "fwd_ms": "the same configuration's dlion-no-comm forward: compute without communication",
    "bwd_ms": "the same configuration's dlion-no-comm backward",
    "opt_ms": "the same configuration's dlion-no-comm opt.step() (local step, tally, apply)",
    "no_comm_ms": "dlion-no-comm's step_ms_slowest_rank in the same configuration and batch",
    "vs_no_comm": "step_ms_slowest_rank / no_comm_ms",
    "hidden_fraction": "overlap variants: 1 - (T - T_no_comm) / (T_ref - T_no_comm), T_ref the "
                       "same exchange without overlap (dlion-vote, dlion-vote-hier)",
    "ratio_vs_ddp_fp32": "lion-allreduce's step_ms_slowest_rank / this one (> 1: faster than "
                         "DDP)",
    "bytes_per_rank": "bytes this rank sends per step, mean over the timed steps (bytes_source)",
    "inter_node_bytes_per_rank": "of those, the bytes sent to other nodes (counted or estimated)",
    "bytes_source": "'StepStats', 'formula' (ring all-reduce), "
                    "'DecentralizedDataParallel.bytes_sent'",
    "wire_bytes_per_rank": "measured: node veth tx bytes per step / L (inter-node, with headers)",
    "stats": "the StepStats fields of the last step, when the variant has them",
    "param_bytes_per_rank": "bytes of parameters a rank holds (a DTensor: its local shard), "
                            "counted from the tensors after the timed steps; max over ranks",
    "grad_bytes_per_rank": "bytes of gradients a rank holds, likewise",
    "state_bytes_per_rank": "bytes of optimizer state a rank holds, likewise",
    "memory_bytes_per_rank": "parameters + gradients + optimizer state, max over ranks",
    "peak_rss_mb": "peak resident set of a rank process (VmHWM, reset when the case starts; "
                   "with --fresh-processes the case is the process's only one), max over "
                   "ranks, MiB",
    "load_1min": "1-minute load average when the configuration started",
}


def estimate_buckets(sizes_bytes: list[int], bucket_mb: float) -> int:
    """DDP's rule over parameters in reverse order: a bucket closes once it holds >= cap."""
    cap, count, cur = bucket_mb * 2**20, 0, 0
    for b in reversed(sizes_bytes):
        cur += b
        if cur >= cap:
            count, cur = count + 1, 0
    return count + (cur > 0)


# ----------------------------------------------------------------------------- driver


def load_1min() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True,
                              timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return f"load average {load_1min()}"


def inter_node_bytes(key: str, n: int, L: int, sent):
    """Of the ``sent`` bytes per rank, those to other nodes, estimated where the strategy does
    not count them itself (wire_bytes_per_rank says what really crossed); None if unknown."""
    family = strategies.get(key).family
    if sent is None or L == 1 or sent == 0:
        return sent  # one rank per node: every peer is on another node
    if family in ("dlion", "no-comm"):
        # flat D-Lion, vote/binary: half the bytes in the all_to_all (direct: n - L of the
        # n - 1 peers are on other nodes), half in gloo's all_gather (a ring in rank order:
        # 1/L of it crosses). Matched the veth counters at 2x2 (2.76 MB of 4.72 MB).
        return round(sent / 2 * ((n - L) / (n - 1) + 1 / L))
    if family == "allreduce":
        # a ring in rank order over N nodes x L ranks: N of its n edges cross nodes, so 1/L of
        # the bytes on average
        return sent / L
    return None


def median(xs):
    return common.median(xs) if xs else None


def summarize(case: dict, res: dict, n: int, L: int, rate: float, load: float,
              d_params: int) -> dict:
    key = case["variant"]
    row = {"n": n, "nodes": n // L, "ranks_per_node": L,
           "layout": "flat" if L == 1 else f"{n // L}x{L}", "rate_gbps": rate,
           "variant": key, "label": strategies.get(key).label, "sweep": case["sweep"],
           "batch": case["batch"],
           "bucket_mb": case["bucket_mb"], "jitter_ms": case["jitter_ms"], "params": d_params,
           "load_1min": load}
    reason = case.get("skip_reason") or (res or {}).get("skip_reason")
    if reason or res is None:
        row.update(status="skipped", skip_reason=reason or "no result")
        return row
    t = res["times"]  # [rank][rep][step, fwd, bwd, opt]
    reps = len(t[0])
    steps = [[t[r][k][0] for r in range(n)] for k in range(reps)]
    phase = lambda j: 1e3 * median([t[r][k][j] for r in range(n) for k in range(reps)])  # noqa
    row.update(
        status="ok", skip_reason=None, params=res["params"],
        step_ms_median=1e3 * median([s for rep in steps for s in rep]),
        step_ms_slowest_rank=1e3 * median([max(rep) for rep in steps]),
        step_ms_rank0=1e3 * median([rep[0] for rep in steps]),
        own_fwd_ms=phase(1), own_bwd_ms=phase(2), own_opt_ms=phase(3),
        wire_bytes_per_rank=res["wire_bytes_total"] / (n * reps),
        stats=res.get("stats"))
    if res.get("memory"):
        mem = res["memory"]  # [rank][params, grads, state, peak rss]
        row.update({k: max(m[j] for m in mem) for j, k in enumerate(
            ("param_bytes_per_rank", "grad_bytes_per_rank", "state_bytes_per_rank"))})
        row.update(memory_bytes_per_rank=max(sum(m[:3]) for m in mem),
                   peak_rss_mb=max(m[3] for m in mem) / 2**20)
    inter = res["inter_node_bytes"]
    if inter is None:
        inter = inter_node_bytes(key, n, L, res["bytes"])
    row.update(bytes_per_rank=res["bytes"], inter_node_bytes_per_rank=inter,
               bytes_source=res["bytes_source"])
    if res.get("buckets_counted"):
        row.update(buckets=res["buckets_counted"], buckets_source="engine")
    elif strategies.get(key).bucketed:
        sizes = [4 * case["width"] * case["width"], 4 * case["width"]] * case["depth"]
        row.update(buckets=estimate_buckets(sizes, case["bucket_mb"]), buckets_source="estimate")
    return row


def derive(rows: list[dict]) -> None:
    """Fill fields that compare a row with others of the same configuration."""
    def same(r, key):
        return next((x for x in rows if x["status"] == "ok" and x["variant"] == key and all(
            x[k] == r[k] for k in ("n", "ranks_per_node", "rate_gbps", "batch", "jitter_ms"))
            and (x["bucket_mb"] == r["bucket_mb"] or key in (NO_COMM, DLION))), None)

    for r in rows:
        if r["status"] != "ok":
            continue
        nc, ddp = same(r, NO_COMM), same(r, DDP_FP32)
        if ddp is None:  # the bucket sweep: compare with the default bucket size's DDP
            ddp = next((x for x in rows if x["status"] == "ok" and x["variant"] == DDP_FP32
                        and x["sweep"] == "main" and x["n"] == r["n"]
                        and x["ranks_per_node"] == r["ranks_per_node"]
                        and x["rate_gbps"] == r["rate_gbps"]), None)
        if nc:
            r.update(fwd_ms=nc["own_fwd_ms"], bwd_ms=nc["own_bwd_ms"], opt_ms=nc["own_opt_ms"],
                     no_comm_ms=nc["step_ms_slowest_rank"],
                     vs_no_comm=r["step_ms_slowest_rank"] / nc["step_ms_slowest_rank"])
        if ddp:
            r["ratio_vs_ddp_fp32"] = ddp["step_ms_slowest_rank"] / r["step_ms_slowest_rank"]
        dl = same(r, OVERLAP_REFERENCE[r["variant"]]) if r["variant"] in OVERLAP_REFERENCE \
            else None
        if nc and dl:
            exposed_off = dl["step_ms_slowest_rank"] - nc["step_ms_slowest_rank"]
            if exposed_off > 0:
                r["hidden_fraction"] = 1 - (r["step_ms_slowest_rank"]
                                            - nc["step_ms_slowest_rank"]) / exposed_off


def bucket_fits(rows: list[dict]) -> list[dict]:
    """Least squares fit step_ms = a + b * buckets per (variant, n, rate) of the bucket sweep."""
    fits = []
    groups = {}
    for r in rows:
        if r["status"] == "ok" and r.get("buckets") and r["variant"] in BUCKET_SWEEP_VARIANTS \
                and r["jitter_ms"] == 0:
            groups.setdefault((r["variant"], r["n"], r["ranks_per_node"], r["rate_gbps"],
                               r["batch"]), []).append(r)
    for (key, n, L, rate, batch), rs in groups.items():
        pts = sorted({(r["bucket_mb"], r["buckets"], r["step_ms_slowest_rank"]) for r in rs})
        if len({p[1] for p in pts}) < 2:
            continue
        xs, ys = [p[1] for p in pts], [p[2] for p in pts]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        fits.append({"variant": key, "n": n, "ranks_per_node": L, "rate_gbps": rate,
                     "batch": batch, "points": len(pts), "a_ms": my - b * mx,
                     "ms_per_bucket": b, "bucket_mb": [p[0] for p in pts],
                     "buckets": xs, "step_ms": [round(y, 1) for y in ys]})
    return fits


def plan_cases(args, n: int, L: int, rate: float, variants: list[str]) -> list[dict]:
    base = {"width": args.width, "depth": args.depth, "jitter_ms": args.jitter_ms}
    cases = [dict(base, variant=v, batch=args.batch, bucket_mb=args.bucket_mb, sweep="main")
             for v in variants]
    if L == 1 and n == args.sweep_n:
        for b in args.batches:
            if b != args.batch:
                cases += [dict(base, variant=v, batch=b, bucket_mb=args.bucket_mb,
                               sweep="batch") for v in BATCH_SWEEP_VARIANTS if v in variants]
        if rate in args.bucket_sweep_rates:
            for mb in args.bucket_mbs:
                if mb != args.bucket_mb:
                    cases += [dict(base, variant=v, batch=args.batch, bucket_mb=mb,
                                   sweep="bucket") for v in BUCKET_SWEEP_VARIANTS
                              if v in variants]
    for c in cases:
        c["skip_reason"] = strategies.get(c["variant"]).problem(n, L)
    return cases


def run_config(nodes, L, rate, args, tmp, timeout) -> tuple[list[dict], list[dict], dict]:
    n = nodes * L
    variants = args.variants if L == 1 else args.hier_variants
    cases = plan_cases(args, n, L, rate, variants)
    runnable = [c for c in cases if not c["skip_reason"]]
    for i, c in enumerate(runnable):
        c["index"] = i
    load = load_1min()
    results: dict = {}
    info = {}
    if runnable:
        with network.Topology(nodes, rate * 1000, args.delay_ms, ranks_per_node=L,
                              prefix="dlbt") as topo:
            # one launch for all cases, or one per case (--fresh-processes: a clean peak RSS)
            launches = [[c] for c in runnable] if args.fresh_processes else [runnable]
            for k, cases_k in enumerate(launches):
                label = f"-{nodes}x{L}-{rate:g}" + (f"-{k}" if len(launches) > 1 else "")
                cfg = {"master": topo.addrs[0],
                       "port": 20000 + int.from_bytes(os.urandom(2), "little") % 30000,
                       "width": args.width, "depth": args.depth, "warmup": args.warmup,
                       "reps": args.reps, "timeout": max(120, int(timeout)), "cases": cases_k,
                       "result": os.path.join(tmp, f"result{label}.json")}
                cfg_path = os.path.join(tmp, f"cfg{label}.json")
                with open(cfg_path, "w") as f:
                    json.dump(cfg, f)
                env = dict(os.environ, PYTHONPATH=common.REPO_ROOT + os.pathsep
                           + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
                           **common.CACHING_MALLOC_ENV)
                topo.launch(lambda r: [sys.executable, WORKER, cfg_path], env, tmp, timeout,
                            label=label)
                with open(cfg["result"]) as f:
                    results.update({r["index"]: r for r in json.load(f)})
            info = {"shaper": topo.shaper, "netem_error": topo.netem_error,
                    "subnet": topo.subnet}
    d = args.depth * (args.width * args.width + args.width)
    rows = [summarize(c, results.get(c.get("index")), n, L, rate, load, d) for c in cases]
    raw = [{"n": n, "ranks_per_node": L, "rate_gbps": rate, "variant": c["variant"],
            "batch": c["batch"], "bucket_mb": c["bucket_mb"],
            "times_s_rank_rep_step_fwd_bwd_opt": results[c["index"]].get("times")}
           for c in runnable if c["index"] in results]
    return rows, raw, info


def parse_layouts(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        try:
            nodes, L = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--layouts: {item!r} is not NODESxRANKS_PER_NODE (e.g. 4x1,2x2)")
        if nodes < 1 or L < 1 or nodes * L < 2:
            raise SystemExit(f"--layouts: {item!r} needs >= 1 node, >= 1 rank, >= 2 ranks")
        out.append((nodes, L))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(ap)
    ap.add_argument("--layouts", default="2x1,4x1,8x1,2x2,4x2,2x4",
                    help="NODESxRANKS_PER_NODE list; 4x1 = 4 namespaces of 1 rank (flat n = 4)")
    ap.add_argument("--rates-gbit", type=float, nargs="+", default=[1.0, 10.0])
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="variants for flat layouts (L = 1): strategy slugs, comma separated")
    ap.add_argument("--hier-variants", default=",".join(HIER_VARIANTS),
                    help="variants for layouts with L > 1")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=24)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--batches", default="8,16,32,64,128",
                    help="batch sweep (flat n = --sweep-n, every rate)")
    ap.add_argument("--sweep-n", type=int, default=4)
    ap.add_argument("--bucket-mb", type=float, default=BUCKET_MB)
    ap.add_argument("--bucket-mbs", default="2,8,16,32,100",
                    help="bucket_mb sweep (flat n = --sweep-n, --bucket-sweep-rates)")
    ap.add_argument("--bucket-sweep-rates", type=float, nargs="+", default=[1.0])
    ap.add_argument("--jitter-ms", type=float, default=0.0,
                    help="uniform random 0..J ms extra delay per rank per step (stragglers)")
    ap.add_argument("--delay-ms", type=float, default=0.0,
                    help="one-way delay (needs sch_netem, else recorded as missing)")
    ap.add_argument("--warmup", type=int, default=2,
                    help=">= 2: the overlap engines record the gradient order on the first step")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=2400.0,
                    help="configurations not started by then are skipped and listed")
    ap.add_argument("--fresh-processes", action="store_true",
                    help="start the rank processes anew for every case (each case then runs "
                    "twice, the first dropped): a peak RSS of that case alone")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)

    if args.smoke:
        args.layouts, args.rates_gbit = "2x1,1x2", [1.0]
        args.width, args.depth, args.batch, args.batches = 256, 4, 8, "8,16"
        args.sweep_n, args.bucket_mbs, args.bucket_mb = 2, "0.25", 1.0
        args.warmup, args.reps = 2, 2
        args.hier_variants = "dlion-no-comm,lion-allreduce,dlion-vote,lion-allreduce-hier," \
            "dlion-vote-hier,fsdp-dlion"
    layouts = parse_layouts(args.layouts)
    try:  # slugs, or the legacy keys recorded commands use
        args.variants = [strategies.resolve(v).slug for v in args.variants.split(",") if v]
        args.hier_variants = [strategies.resolve(v).slug for v in args.hier_variants.split(",")
                              if v]
    except ValueError as e:
        raise SystemExit(f"--variants: {e}") from None
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.bucket_mbs = [float(b) for b in args.bucket_mbs.split(",") if b]

    try:
        network.check_privileges("dlbt")
    except network.Skip as e:
        print(f"bench_training skipped: {e}")
        return 0
    network.install_signal_handlers()
    start = time.time()
    up_before = uptime()
    out_dir = common.results_dir("training", args.out)
    d = args.depth * (args.width * args.width + args.width)
    print(f"bench_training: {d / 1e6:.1f}M params ({d:,}; {args.depth} x Linear({args.width})"
          f"), layouts {args.layouts}, rates {args.rates_gbit} Gbit/s -> {out_dir}\n"
          f"{up_before}", flush=True)

    rows, raw, skipped, infos = [], [], [], []

    def write(final: bool) -> None:
        """The results so far: after every configuration (a killed run keeps them) and at the
        end (then also printed and plotted)."""
        done = [dict(r) for r in rows]
        derive(done)
        fits = bucket_fits(done)
        up_now = uptime()
        meta = common.metadata({
            "benchmark": "bench_training", "uptime_before": up_before, "uptime_after": up_now,
            "complete": final,
            "transport": "gloo; one namespace per node, veth+bridge, tbf both directions; "
                         "intra-node traffic on the namespace's loopback",
            "model": f"{args.depth} x (Linear({args.width}, {args.width}) + GELU), MSE, fp32",
            "params": d, "threads_per_rank": 1, "rank_env": common.CACHING_MALLOC_ENV,
            "args": vars(args)})
        notes = [
            f"{os.cpu_count()} cores shared by all n ranks (1 thread each): compute contends; "
            f"compare every variant with {NO_COMM} of the same configuration, not across n",
            "ranks run with glibc malloc keeping freed memory (MALLOC_MMAP_THRESHOLD_, "
            "MALLOC_TRIM_THRESHOLD_ = 1 GiB), as torch's caching allocator does on a GPU: "
            "fresh gradients would otherwise page-fault every step",
            "step time = median over reps of the slowest rank; reps run back to back (a step "
            "lasts from its start to the next one's)",
            "DDP bytes are the ring formula; wire_bytes_per_rank is what crossed the node's "
            "veth",
            "torch's bf16_compress_hook refuses gloo (needs NCCL); lion-allreduce-bf16 runs the "
            "same hook from dlion_kernels/recipes/baselines.py (cast to bf16, all_reduce, cast "
            "back)",
            f"uptime before: {up_before}; after: {up_now}",
        ]
        if not final:
            notes.append("INCOMPLETE: written after a configuration; the run did not finish")
        if any(i.get("netem_error") for i in infos):
            notes.append("netem unavailable: no delay emulated, tbf rate limit only")
        common.save(out_dir, "bench_training", done, meta, row_schema=ROW_SCHEMA,
                    bucket_fits=fits, skipped=skipped, notes=notes, links=infos, raw=raw)
        text = markdown(done, fits, meta, notes, skipped, time.time() - start, out_dir)
        common.save_text(out_dir, "bench_training.md", text)
        if final:
            print(text)
            if any(r["ranks_per_node"] == 1 and r["status"] == "ok" for r in done):
                common.plot_unless(args.no_plot, lambda: plot(done, out_dir, d))
            else:
                print("no plot: the batch-sweep plot needs flat-layout rows")

    with tempfile.TemporaryDirectory(prefix="bench_training-") as tmp:
        for rate in args.rates_gbit:
            for nodes, L in layouts:
                left = args.budget_s - (time.time() - start)
                if left <= 0:
                    skipped.append({"layout": f"{nodes}x{L}", "rate_gbps": rate,
                                    "reason": "time budget spent"})
                    continue
                t0 = time.time()
                try:
                    got, got_raw, info = run_config(nodes, L, rate, args, tmp,
                                                    timeout=min(3600, left + 300))
                except RuntimeError as e:  # a rank died (e.g. out of memory): record, go on
                    reason = str(e).splitlines()[0][:300]
                    print(f"  {rate:g} Gbit/s {nodes}x{L}: FAILED: {reason}", flush=True)
                    skipped.append({"layout": f"{nodes}x{L}", "rate_gbps": rate,
                                    "reason": f"failed: {reason}"})
                    write(final=False)
                    continue
                rows += got
                raw += got_raw
                infos.append(dict(info, layout=f"{nodes}x{L}", rate_gbps=rate))
                ok = [r for r in got if r["status"] == "ok"]
                print(f"  {rate:g} Gbit/s {nodes}x{L}: {len(ok)} cases in "
                      f"{time.time() - t0:.0f} s (load {got[0]['load_1min'] if got else '-'})",
                      flush=True)
                for r in ok:
                    if r["sweep"] == "main":
                        print(f"    {r['label']:<40} {r['step_ms_slowest_rank']:8.1f} ms",
                              flush=True)
                write(final=False)
    write(final=True)
    return 0


def markdown(rows, fits, meta, notes, skipped, wall, out_dir) -> str:
    md = [f"# bench_training ({meta['date']}, {meta['cpu_model']}, {meta['cpu_count']} cores, "
          f"{meta['model']}, {meta['params'] / 1e6:.1f}M params, torch "
          f"{meta['torch']})\n", f"Command: `{meta['command']}`\n",
          f"Load: before `{meta['uptime_before']}`; after `{meta['uptime_after']}`\n"]
    main_rows = [r for r in rows if r["sweep"] == "main" and r["status"] == "ok"]
    md.append(common.markdown_table(main_rows, [
        ("rate_gbps", "Gbit/s"), ("layout", "layout"), ("n", "n"), ("label", "variant"),
        ("step_ms_slowest_rank", "step ms (slowest)", ".0f"),
        ("step_ms_median", "step ms (median rank)", ".0f"),
        ("own_fwd_ms", "fwd", ".0f"), ("own_bwd_ms", "bwd", ".0f"),
        ("own_opt_ms", "opt", ".0f"), ("vs_no_comm", "x no comm", ".2f"),
        ("ratio_vs_ddp_fp32", "DDP fp32 / this", ".2f"),
        ("hidden_fraction", "comm hidden", ".2f"),
        ("bytes_per_rank", "bytes/rank"), ("wire_bytes_per_rank", "veth bytes/rank", ".3g"),
        ("load_1min", "load")], title="Whole training steps (slowest rank, median)"))
    mem = [dict(r, **{k + "_mb": r[k] / 2**20 for k in (
        "param_bytes_per_rank", "grad_bytes_per_rank", "state_bytes_per_rank",
        "memory_bytes_per_rank")}) for r in main_rows if "memory_bytes_per_rank" in r]
    if mem:
        md.append(common.markdown_table(mem, [
            ("rate_gbps", "Gbit/s"), ("layout", "layout"), ("label", "variant"),
            ("inter_node_bytes_per_rank", "bytes/rank between nodes"),
            ("param_bytes_per_rank_mb", "params MiB", ".1f"),
            ("grad_bytes_per_rank_mb", "grads MiB", ".1f"),
            ("state_bytes_per_rank_mb", "optimizer state MiB", ".1f"),
            ("memory_bytes_per_rank_mb", "sum MiB", ".1f"), ("peak_rss_mb", "peak RSS MiB", ".0f")],
            title="Memory per rank (counted from the tensors; max over ranks) and bytes "
                  "between nodes"))
    batch = [r for r in rows if r["status"] == "ok" and r["variant"] in BATCH_SWEEP_VARIANTS
             and r["sweep"] in ("main", "batch") and r["ranks_per_node"] == 1
             and any(x["sweep"] == "batch" and x["n"] == r["n"] for x in rows)]
    if batch:
        md.append(common.markdown_table(sorted(batch, key=lambda r: (
            r["rate_gbps"], r["batch"], list(strategies.STRATEGIES).index(r["variant"]))), [
            ("rate_gbps", "Gbit/s"), ("n", "n"), ("batch", "batch"), ("label", "variant"),
            ("step_ms_slowest_rank", "step ms", ".0f"), ("vs_no_comm", "x no comm", ".2f"),
            ("ratio_vs_ddp_fp32", "DDP fp32 / this", ".2f")], title="Batch-size sweep"))
    if fits:
        md.append(common.markdown_table(fits, [
            ("variant", "variant"), ("n", "n"), ("rate_gbps", "Gbit/s"),
            ("buckets", "buckets"), ("step_ms", "step ms"), ("a_ms", "a ms", ".0f"),
            ("ms_per_bucket", "ms per bucket (b)", ".2f")],
            title="Fixed cost per bucket: step_ms = a + b * buckets (least squares)"))
    skips = [r for r in rows if r["status"] == "skipped"]
    if skips:
        seen = {}
        for r in skips:
            seen.setdefault((r["label"], r["skip_reason"]), []).append(
                f"{r['layout']}/{r['rate_gbps']:g}")
        md.append("### Skipped variants\n\n" + "\n".join(
            f"- {lab}: {why} ({', '.join(sorted(set(w)))})" for (lab, why), w in seen.items())
            + "\n")
    md.append("### Notes\n\n" + "\n".join(f"- {x}" for x in notes) + "\n")
    if skipped:
        md.append("### Configurations not run\n\n" + "\n".join(
            f"- {s['layout']} at {s['rate_gbps']:g} Gbit/s: {s['reason']}" for s in skipped)
            + "\n")
    md.append(f"Total wall time: {wall:.0f} s. Results: {out_dir}\n")
    return "\n".join(md)


def plot(rows: list[dict], out_dir: str, d: int) -> str | None:
    """Batch sweep: whole-step time of DDP fp32 / fp16 / bf16 over D-Lion's (overlap if it ran,
    else overlap=False), one panel per rate."""
    plt = common.pyplot()
    if plt is None:
        return None
    ok = [r for r in rows if r["status"] == "ok" and r["ranks_per_node"] == 1
          and r["sweep"] in ("main", "batch") and r["jitter_ms"] == 0]
    rates = sorted({r["rate_gbps"] for r in ok})
    if not rates:
        return None
    fig, axes = plt.subplots(1, len(rates), figsize=(5.2 * len(rates), 4.0), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        here = [r for r in ok if r["rate_gbps"] == rate]
        ns = sorted({r["n"] for r in here if r["sweep"] == "batch"}) or sorted(
            {r["n"] for r in here})
        here = [r for r in here if r["n"] == ns[0]]
        ref_key = "dlion-vote-overlap" if any(r["variant"] == "dlion-vote-overlap"
                                              for r in here) else DLION
        ref = {r["batch"]: r["step_ms_slowest_rank"] for r in here if r["variant"] == ref_key}
        for key in (DDP_FP32, "lion-allreduce-fp16", "lion-allreduce-bf16", NO_COMM):
            pts = sorted((r["batch"], r["step_ms_slowest_rank"] / ref[r["batch"]])
                         for r in here if r["variant"] == key and r["batch"] in ref)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                        label=f"{strategies.get(key).label} / {strategies.get(ref_key).label}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        batches = sorted({r["batch"] for r in here})
        ax.set_xticks(batches)
        ax.set_xticklabels([str(b) for b in batches])
        ax.minorticks_off()
        common.log_ms_axis(ax.yaxis)
        ax.set_xlabel("batch per rank")
        ax.set_ylabel("whole-step time ratio (>1: D-Lion faster)")
        ax.set_title(f"{rate:g} Gbit/s, n = {ns[0]}, {d / 1e6:.1f}M params")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    return common.save_figure(fig, out_dir, "bench_training")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt as e:
        print(f"bench_training interrupted ({e or 'SIGINT'}); namespaces removed",
              file=sys.stderr)
        sys.exit(130)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        sys.exit(1)
