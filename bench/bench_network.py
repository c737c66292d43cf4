"""The optimizer phase (optimizer + communication, no forward/backward) over an emulated
network: n hosts, each in its own Linux network namespace. Whole training steps (forward +
backward + optimizer) are ``bench_training.py``'s.

Topology (``network.Topology``, one rank per namespace here; built per configuration, torn
down after it, also on Ctrl-C / SIGTERM / errors)::

    netns <tag>-n0 --veth--+
    netns <tag>-n1 --veth--+-- bridge br0 in netns <tag>-hub
    ...                    |
    netns <tag>-n{n-1} ----+

Every host has address 10.<A>.<B>.<k+1>/24 on its veth (a /24 drawn per run); nothing is
routed anywhere else and the root namespace is not touched (the bridge lives in its own
namespace). Each link is shaped in both directions: a ``tbf`` on the host-side veth (uplink)
and one on the bridge-side veth (downlink), i.e. a full-duplex NIC of the given rate per host
into a non-blocking switch. If ``--delay-ms`` > 0, ``netem`` is tried first for the one-way delay
(on the uplink, tbf as its child); kernels without ``sch_netem`` fall back to tbf only, and the
results say so.

One python process per rank runs inside its namespace (``ip netns exec``) with gloo over the
veth (``GLOO_SOCKET_IFNAME``) and a tcp:// rendezvous at rank 0's address, and times, for a flat
fp32 vector of ``--numel`` parameters (25M by default):

- ``lion + all_reduce fp32``: all_reduce of the fp32 gradient, / n, then a local Lion update
  (``fused_dlion_step`` on a one-rank group with vote/ternary, which is exact Lion);
- ``dlion vote/binary`` and ``dlion average/binary``: ``fused_dlion_step`` on all ranks;
- the communication alone of the fp32 all-reduce and of the vote/binary step;
- ``local lion (no comm)``: the Lion update on all ranks at once, no collective: the compute a
  step pays when n processes share this machine's cores.

Before the steps it times a large rank 0 -> rank 1 send to measure what the shaped link really
carries. Needs root (``ip netns add``); without it, prints "skipped" and exits 0.

    sudo python bench/bench_network.py                # 25M params, n = 2,4,8, 1 and 10 Gbit/s
    sudo python bench/bench_network.py --numel 125M --ranks 2 4
    sudo python bench/bench_network.py --smoke        # 1M params, n = 2, 1 Gbit/s
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import network  # noqa: E402
from network import Skip  # noqa: E402

VARIANTS = ["lion_allreduce_fp32", "dlion_vote_binary", "dlion_average_binary",
            "allreduce_fp32_comm", "dlion_vote_binary_comm", "lion_local"]
LABELS = {
    "lion_allreduce_fp32": "lion + all_reduce fp32",
    "dlion_vote_binary": "dlion vote/binary",
    "dlion_average_binary": "dlion average/binary",
    "allreduce_fp32_comm": "comm only: all_reduce fp32",
    "dlion_vote_binary_comm": "comm only: dlion vote/binary",
    "lion_local": "local lion (no comm)",
}


def check_privileges():
    network.check_privileges("dlbn")


# ----------------------------------------------------------------------------- worker


def worker(cfg_path: str, rank: int) -> None:
    """One rank, inside its namespace."""
    import torch
    import torch.distributed as dist

    import dlion_kernels as dk
    from dlion_kernels.accounting import ring_all_reduce_bytes
    from dlion_kernels.kernels.layout import aggregate_planes, num_blocks, shard_blocks, vote_planes

    with open(cfg_path) as f:
        cfg = json.load(f)
    n, d = cfg["n"], cfg["numel"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{cfg['master']}:{cfg['port']}",
                            rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=cfg["timeout"]))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    solo = [dist.new_group([r]) for r in range(n)][rank]  # every rank creates every group
    backend = cfg["backend"]

    def timed(fn, prep=lambda: None, reps=cfg["reps"], warmup=cfg["warmup"]):
        for _ in range(warmup):
            prep()
            dist.barrier()
            fn()
        ts, out = [], None
        for _ in range(reps):
            prep()
            dist.barrier()
            t0 = time.perf_counter()
            out = fn()
            ts.append(time.perf_counter() - t0)
        everyone = torch.empty(n * reps, dtype=torch.float64)
        gather(everyone, torch.tensor(ts, dtype=torch.float64))
        return everyone.view(n, reps).tolist(), out

    result = {"rank_times": {}, "bytes_sent": {}, "backend": {}}

    # what the link really carries: rank 0 -> rank 1, one large message
    probe = torch.empty(cfg["probe_bytes"] // 4, dtype=torch.float32).fill_(1.0)

    def send():
        if rank == 0:
            dist.send(probe, 1)
        elif rank == 1:
            dist.recv(probe, 0)

    probe_t, _ = timed(send, reps=2, warmup=1)
    result["probe_seconds_rank1"] = probe_t[1]
    probe = None  # freed (send() is done with it)

    gen = torch.Generator().manual_seed(1000 + rank)
    grad = torch.randn(d, generator=gen)
    torch.manual_seed(0)
    param, exp_avg = torch.randn(d), torch.zeros(d)
    buf = torch.empty(d)
    kw = {"lr": 1e-4, "betas": (0.9, 0.99), "backend": backend}

    def lion_local():
        return dk.fused_dlion_step([param], [grad], [exp_avg], mode="vote", votes="ternary",
                                   group=solo, **kw)

    def lion_allreduce():
        dist.all_reduce(buf)
        buf.div_(n)
        return dk.fused_dlion_step([param], [buf], [exp_avg], mode="vote", votes="ternary",
                                   group=solo, **kw)

    def dlion(mode):
        return lambda: dk.fused_dlion_step([param], [grad], [exp_avg], mode=mode,
                                           votes="binary", **kw)

    shard = shard_blocks(num_blocks(d), n)
    p_in, p_out = vote_planes("binary"), aggregate_planes("vote", "binary", n)
    votes_send = torch.zeros(n * shard * p_in, dtype=torch.int32)
    votes_recv = torch.empty_like(votes_send)
    owned = torch.zeros(shard * p_out, dtype=torch.int32)
    gathered = torch.empty(n * shard * p_out, dtype=torch.int32)

    def vote_comm():
        dist.all_to_all_single(votes_recv, votes_send)
        gather(gathered, owned)

    fill = lambda: buf.copy_(grad)  # noqa: E731 - the gradient, fresh before each all-reduce
    plan = {
        "lion_allreduce_fp32": (lion_allreduce, fill),
        "dlion_vote_binary": (dlion("vote"), None),
        "dlion_average_binary": (dlion("average"), None),
        "allreduce_fp32_comm": (lambda: dist.all_reduce(buf), fill),
        "dlion_vote_binary_comm": (vote_comm, None),
        "lion_local": (lion_local, None),
    }
    for name in cfg["variants"]:
        fn, prep = plan[name]
        times, stats = timed(fn, prep or (lambda: None))
        result["rank_times"][name] = times
        if isinstance(stats, dk.StepStats):
            result["bytes_sent"][name] = stats.bytes_sent
            result["backend"][name] = stats.backend
    ring = round(ring_all_reduce_bytes(n, 4 * d))  # what a ring all-reduce of fp32 sends per rank
    result["bytes_sent"]["allreduce_fp32_comm"] = ring
    result["bytes_sent"]["lion_allreduce_fp32"] = ring
    result["bytes_sent"]["dlion_vote_binary_comm"] = (n - 1) * shard * (p_in + p_out) * 4
    if rank == 0:
        with open(cfg["result"], "w") as f:
            json.dump(result, f)
    dist.barrier()
    # Leave without tearing gloo down: its pairs' destructors once aborted rank 0 ("terminate
    # called without an active exception", exit -6) when the peer had closed first, in CI's
    # smoke run. Everything is written; the process owns nothing else.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ----------------------------------------------------------------------------- driver


def run_config(n, rate_mbit, args, tmp, timeout) -> dict:
    with network.Topology(n, rate_mbit, args.delay_ms, prefix="dlbn") as topo:
        cfg = {
            "n": n, "numel": args.numel, "master": topo.addrs[0],
            "port": 20000 + int.from_bytes(os.urandom(2), "little") % 30000,
            "backend": args.backend, "warmup": args.warmup, "reps": args.reps,
            "variants": VARIANTS, "timeout": max(60, int(timeout)),
            # ~0.5 s of traffic at the nominal rate, between 8 MiB and 256 MiB
            "probe_bytes": int(min(max(rate_mbit * 1e6 / 8 * 0.5, 8 << 20), 256 << 20)) // 4 * 4,
            "result": os.path.join(tmp, f"result-{n}-{rate_mbit:g}.json"),
        }
        cfg_path = os.path.join(tmp, f"cfg-{n}-{rate_mbit:g}.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        env = dict(os.environ, PYTHONPATH=common.REPO_ROOT + os.pathsep
                   + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
        topo.launch(lambda k: [sys.executable, os.path.abspath(__file__), "--worker", cfg_path,
                               "--rank", str(k)],
                    env, tmp, timeout, label=f"-{n}-{rate_mbit:g}")
        with open(cfg["result"]) as f:
            result = json.load(f)
        result.update(shaper=topo.shaper, netem_error=topo.netem_error, subnet=topo.subnet,
                      probe_bytes=cfg["probe_bytes"])
        return result


def compute_n1(numel, backend, reps=3) -> dict:
    """One process, no process group, 1 thread: the uncontended compute of a step."""
    import torch

    import dlion_kernels as dk

    torch.set_num_threads(1)
    g, p, m = torch.randn(numel), torch.randn(numel), torch.zeros(numel)
    out = {}
    for mode, votes, name in (("vote", "ternary", "lion (n=1)"),
                              ("vote", "binary", "dlion vote/binary (n=1)")):
        ts = []
        for i in range(reps + 1):
            t0 = time.perf_counter()
            stats = dk.fused_dlion_step([p], [g], [m], lr=1e-4, mode=mode, votes=votes,
                                        backend=backend)
            if i:
                ts.append(time.perf_counter() - t0)
        out[name] = {"t_ms": 1e3 * common.median(ts), "backend": stats.backend}
    return out


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(ap)
    ap.add_argument("--numel", default="25M", help="parameters (suffixes k, M, G); e.g. 125M")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--rates-gbit", type=float, nargs="+", default=[1.0, 10.0])
    ap.add_argument("--delay-ms", type=float, default=0.05,
                    help="one-way delay per host (needs sch_netem; else recorded as missing)")
    ap.add_argument("--backend", default=None, help="dlion backend (None = auto)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=560.0,
                    help="configurations not started by then are skipped and listed")
    ap.add_argument("--no-plot", action="store_true", help="do not write bench_network.png")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:
        worker(args.worker, args.rank)
        return 0
    if args.backend in ("None", "auto", ""):
        args.backend = None
    if args.smoke:
        args.numel, args.ranks, args.rates_gbit = "1M", [2], [1.0]
        args.reps, args.budget_s = 2, min(args.budget_s, 50.0)
    if min(args.ranks) < 2:  # the link probe sends from rank 0 to rank 1
        ap.error(f"--ranks: every value must be at least 2, got {args.ranks}")
    args.numel = common.parse_count(args.numel)

    try:
        check_privileges()
    except Skip as e:
        print(f"bench_network skipped: {e}")
        return 0

    network.install_signal_handlers()
    start = time.time()
    out_dir = common.results_dir("bench_network", args.out)
    print(f"bench_network: {common.human_count(args.numel)} params, ranks {args.ranks}, "
          f"rates {args.rates_gbit} Gbit/s -> {out_dir}", flush=True)
    n1 = compute_n1(args.numel, args.backend)
    print(f"compute, n=1: {n1}", flush=True)

    rows, links, skipped, shaper_notes = [], [], [], set()
    with tempfile.TemporaryDirectory(prefix="bench_network-") as tmp:
        for rate in args.rates_gbit:
            for n in args.ranks:
                left = args.budget_s - (time.time() - start)
                need_mem = n * args.numel * 4 * 6
                if left <= 0:
                    skipped.append({"n": n, "rate_gbit": rate, "reason": "time budget spent"})
                    continue
                if need_mem > 0.8 * _mem_available():
                    skipped.append({"n": n, "rate_gbit": rate, "reason":
                                    f"needs ~{common.human_bytes(need_mem)} of memory"})
                    continue
                t0 = time.time()
                res = run_config(n, rate * 1000, args, tmp, timeout=min(600, left + 120))
                print(f"  rate={rate:g} Gbit/s n={n}: {time.time() - t0:.1f} s", flush=True)
                probe_s = min(res["probe_seconds_rank1"])
                links.append({"rate_gbit": rate, "n": n, "shaper": res["shaper"],
                              "probe_mib": res["probe_bytes"] / 2**20,
                              "measured_gbit": res["probe_bytes"] * 8 / probe_s / 1e9,
                              "delay_ms": args.delay_ms if res["shaper"] != "tbf" else 0.0})
                if res["netem_error"]:
                    shaper_notes.add(f"netem unavailable ({res['netem_error']}): delay not "
                                     "emulated, tbf rate limit only")
                for name in VARIANTS:
                    per_rank = res["rank_times"][name]
                    t0_ms = 1e3 * common.median(per_rank[0])
                    tmax_ms = 1e3 * common.median([max(c) for c in zip(*per_rank)])
                    rows.append({"rate_gbit": rate, "n": n, "numel": args.numel,
                                 "variant": LABELS[name], "key": name,
                                 "backend": res["backend"].get(name, "gloo"),
                                 "bytes_sent": res["bytes_sent"].get(name),
                                 "t_rank0_ms": t0_ms, "t_max_ms": tmax_ms})

    for r in rows:
        ref = "allreduce_fp32_comm" if r["key"].endswith("_comm") else "lion_allreduce_fp32"
        base = next(x for x in rows if x["n"] == r["n"] and x["rate_gbit"] == r["rate_gbit"]
                    and x["key"] == ref)
        r["speedup_vs_fp32_allreduce"] = (base["t_max_ms"] / r["t_max_ms"]
                                          if r["key"] != "lion_local" else None)

    summary = []
    for rate in args.rates_gbit:
        for n in args.ranks:
            got = {r["key"]: r for r in rows if r["n"] == n and r["rate_gbit"] == rate}
            if not got:
                continue
            summary.append({
                "rate_gbit": rate, "n": n,
                "lion_ar_ms": got["lion_allreduce_fp32"]["t_max_ms"],
                "dlion_vote_ms": got["dlion_vote_binary"]["t_max_ms"],
                "step_speedup": got["dlion_vote_binary"]["speedup_vs_fp32_allreduce"],
                "ar_comm_ms": got["allreduce_fp32_comm"]["t_max_ms"],
                "vote_comm_ms": got["dlion_vote_binary_comm"]["t_max_ms"],
                "comm_speedup": got["dlion_vote_binary_comm"]["speedup_vs_fp32_allreduce"],
                "local_lion_ms": got["lion_local"]["t_max_ms"],
                "n1_lion_ms": n1["lion (n=1)"]["t_ms"],
                # derived, not measured: the step if every rank had a core of its own
                "projected_speedup_1core": (
                    (got["allreduce_fp32_comm"]["t_max_ms"] + n1["lion (n=1)"]["t_ms"])
                    / (got["dlion_vote_binary_comm"]["t_max_ms"]
                       + n1["dlion vote/binary (n=1)"]["t_ms"])),
            })
    target = next((s for s in summary if s["rate_gbit"] == 1.0 and s["n"] == 4), None)
    if target is None:
        verdict = "target configuration (1 Gbit/s, 4 ranks) not run"
    else:
        met = "met" if target["step_speedup"] >= 10 else "NOT met"
        verdict = (f"1 Gbit/s, 4 ranks, {common.human_count(args.numel)} params: D-Lion "
                   f"vote/binary optimizer phase (optimizer + communication, no forward/"
                   f"backward) {target['step_speedup']:.1f}x faster than Lion + fp32 "
                   f"all-reduce (target >= 10x: {met}); communication alone "
                   f"{target['comm_speedup']:.1f}x; projected with one core per rank "
                   f"{target['projected_speedup_1core']:.1f}x (derived)")
    if not shaper_notes and args.delay_ms <= 0:
        shaper_notes.add("no delay requested (--delay-ms 0): tbf rate limit only")
    backends_used = sorted({r["backend"] for r in rows if r["key"].startswith(("dlion", "lion"))
                            and not r["key"].endswith("_comm")})

    meta = common.metadata({
        "benchmark": "bench_network", "transport": "gloo over veth+bridge in network namespaces",
        "shaping": "tbf on both ends of each host's veth (uplink and downlink)",
        "dlion_backend_requested": args.backend or "auto", "dlion_backend_used": backends_used,
        "threads_per_rank": 1, "args": vars(args)})
    notes = sorted(shaper_notes) + [
        f"this host has {os.cpu_count()} cores shared by all n ranks: compute is contended "
        "(compare 'local lion (no comm)', all ranks computing at once, with the n=1 figure)",
        "times: median over reps; t_max = slowest rank per rep (each rep starts at a barrier)",
        "all_reduce bytes are the ring formula 2(n-1)/n*4d; gloo may use another algorithm",
        verdict,
    ]
    common.save(out_dir, "bench_network", rows, meta, links=links, summary=summary,
                compute_n1=n1, skipped=skipped, notes=notes)

    md = [f"# bench_network ({meta['date']}, {meta['cpu_model']}, {meta['cpu_count']} cores, "
          f"{common.human_count(args.numel)} fp32 params, backend {backends_used})\n"]
    md.append(common.markdown_table(links, [
        ("rate_gbit", "nominal Gbit/s"), ("n", "n"), ("shaper", "shaper"),
        ("delay_ms", "delay ms"), ("probe_mib", "probe MiB", ".0f"),
        ("measured_gbit", "measured Gbit/s (r0->r1)", ".2f")], title="Link check"))
    md.append(common.markdown_table(summary, [
        ("rate_gbit", "Gbit/s"), ("n", "n"), ("lion_ar_ms", "Lion+AR fp32 opt. phase ms", ".0f"),
        ("dlion_vote_ms", "D-Lion vote opt. phase ms", ".0f"),
        ("step_speedup", "opt. phase speedup", ".2f"),
        ("ar_comm_ms", "AR fp32 comm ms", ".0f"), ("vote_comm_ms", "vote comm ms", ".1f"),
        ("comm_speedup", "comm speedup", ".1f"), ("local_lion_ms", "local Lion ms (n procs)",
                                                  ".0f"),
        ("n1_lion_ms", "Lion ms (n=1)", ".0f"),
        ("projected_speedup_1core", "projected opt. phase speedup, 1 core/rank*", ".1f")],
        title="Optimizer phase (optimizer + communication, no forward/backward; "
        "slowest rank, median)"))
    md.append("\\* derived, not measured: (AR fp32 comm + Lion n=1) / (vote comm + D-Lion n=1), "
              "the optimizer-phase speedup if each rank had a core of its own and compute did not "
              "contend.\n")
    md.append(common.markdown_table(rows, [
        ("rate_gbit", "Gbit/s"), ("n", "n"), ("variant", "variant"), ("backend", "backend"),
        ("bytes_sent", "bytes sent/rank"), ("t_rank0_ms", "ms (rank 0)", ".1f"),
        ("t_max_ms", "ms (max)", ".1f"),
        ("speedup_vs_fp32_allreduce", "speedup vs fp32 AR", ".2f")], title="All variants"))
    md.append("### Notes\n\n" + "\n".join(f"- {x}" for x in notes) + "\n")
    if skipped:
        md.append("### Skipped\n\n" + "\n".join(
            f"- n={s['n']} rate={s['rate_gbit']:g} Gbit/s: {s['reason']}" for s in skipped)
            + "\n")
    md.append(f"Total wall time: {time.time() - start:.0f} s. Results: {out_dir}\n")
    text = "\n".join(md)
    common.save_text(out_dir, "bench_network.md", text)
    print(text)
    common.plot_unless(args.no_plot, lambda: plot(rows, out_dir, args.numel))
    return 0


def plot(rows: list[dict], out_dir: str, numel: int) -> str | None:
    """Grouped bars: optimizer-phase time (slowest rank) of each variant at each (rate, n)."""
    plt = common.pyplot()
    if plt is None:
        return None
    configs = list(dict.fromkeys((r["rate_gbit"], r["n"]) for r in rows))
    if not configs:
        return None
    keys = [k for k in VARIANTS if any(r["key"] == k for r in rows)]
    width = 0.8 / len(keys)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.6 * len(configs) + 3.5), 4.2))
    for i, key in enumerate(keys):
        xs, ts = [], []
        for c, (rate, n) in enumerate(configs):
            hit = [r for r in rows if (r["rate_gbit"], r["n"], r["key"]) == (rate, n, key)]
            if hit:
                xs.append(c + (i - (len(keys) - 1) / 2) * width)
                ts.append(hit[0]["t_max_ms"])
        ax.bar(xs, ts, width, label=LABELS[key])
    ax.set_xticks(range(len(configs)))
    ax.set_xticklabels([f"{rate:g} Gbit/s\nn = {n}" for rate, n in configs])
    ax.set_yscale("log")
    ax.set_ylim(bottom=min(r["t_max_ms"] for r in rows) / 2)  # log bars: show every bar's foot
    common.log_ms_axis(ax.yaxis)
    ax.set_ylabel("ms per optimizer phase (slowest rank, median)")
    ax.set_title(f"bench_network, optimizer phase (no fwd/bwd): "
                 f"{common.human_count(numel)} fp32 parameters")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    ax.grid(True, axis="y", which="both", alpha=0.3)
    return common.save_figure(fig, out_dir, "bench_network")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt as e:
        print(f"bench_network interrupted ({e or 'SIGINT'}); namespaces removed", file=sys.stderr)
        sys.exit(130)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        sys.exit(1)
