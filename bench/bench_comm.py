"""Communication per step: D-Lion's packed sign votes against an fp32 / bf16 gradient all-reduce.

n gloo processes on one host (loopback, ``torch.set_num_threads(1)`` each) run, for a flat fp32
parameter vector of d elements:

- ``fused_dlion_step`` for vote/binary, vote/ternary, average/binary, average/ternary
  (the whole step: local step, all_to_all_single, tally, all_gather, apply; bytes from
  ``StepStats.bytes_sent``);
- the communication of that step alone (all_to_all_single + all_gather_into_tensor of the
  packed sizes the step uses, no compute);
- ``dist.all_reduce`` of an fp32 and of a bf16 gradient of the same d (bytes of a ring
  all-reduce: 2 (n-1)/n * 4d and 2 (n-1)/n * 2d).

Each timing is taken after a barrier on every rank; the tables give the median over reps of
rank 0's time and of the slowest rank's time. Loopback is memory bandwidth, not a network: see
bench_network.py for a rate-limited link. The whole default run keeps to ``--budget-s``:
sizes whose predicted time does not fit are skipped and listed.

    python bench/bench_comm.py            # n = 2, 4, 8; d = 1M, 4M, 16M, 64M
    python bench/bench_comm.py --smoke    # n = 2, d = 64k, 256k
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dlion_kernels.accounting import ring_all_reduce_bytes  # noqa: E402
from dlion_kernels.kernels.layout import WORD_BYTES  # noqa: E402

DLION_VARIANTS = [("vote", "binary"), ("vote", "ternary"), ("average", "binary"),
                  ("average", "ternary")]


# ----------------------------------------------------------------------------- formulas


def spec_bytes(mode: str, votes: str, n: int, d: int) -> float:
    """The wire format's bytes one rank sends per step (ternary rows are upper bounds)."""
    frac = (n - 1) / n * d / 8
    if votes == "binary":
        down = 1 if mode == "vote" else math.ceil(math.log2(n + 1))
        return (1 + down) * frac
    down = 2 if mode == "vote" else math.ceil(math.log2(2 * n + 1))
    return (2 + down) * frac


def allreduce_bytes(n: int, d: int, elem_bytes: int) -> float:
    """Ring all-reduce: every rank sends 2 (n-1)/n of the buffer."""
    return ring_all_reduce_bytes(n, elem_bytes * d)


def packed_sizes(mode: str, votes: str, n: int, d: int) -> tuple[int, int, int]:
    """(shard blocks, vote planes, aggregate planes) of the step's wire format (layout.py)."""
    from dlion_kernels.kernels.layout import aggregate_planes, num_blocks, shard_blocks, vote_planes

    return shard_blocks(num_blocks(d), n), vote_planes(votes), aggregate_planes(mode, votes, n)


# ----------------------------------------------------------------------------- worker


def _all_gather(out, inp):
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp)


def _timed(fn, prep, warmup: int, reps: int, n: int):
    """Per-rank durations of ``fn`` (after ``prep`` and a barrier), gathered: tensor [n, reps]."""
    for _ in range(warmup):
        prep()
        dist.barrier()
        fn()
    times = []
    result = None
    for _ in range(reps):
        prep()
        dist.barrier()
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    mine = torch.tensor(times, dtype=torch.float64)
    everyone = torch.empty(n * reps, dtype=torch.float64)
    _all_gather(everyone, mine)
    return everyone.view(n, reps), result


def _summary(all_t: torch.Tensor) -> dict:
    """rank-0 median and median over reps of the slowest rank, in ms."""
    return {
        "t_rank0_ms": 1e3 * common.median(all_t[0].tolist()),
        "t_max_ms": 1e3 * common.median(all_t.max(dim=0).values.tolist()),
    }


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def _run_size(rank, n, d, cfg, rows):
    backend = cfg["backend"]
    reps = cfg["reps"] if d < cfg["large"] else cfg["reps_large"]
    warmup = cfg["warmup"]
    gen = torch.Generator().manual_seed(1234 + rank)
    grad = torch.randn(d, generator=gen)
    base = {"n": n, "d": d, "d_human": common.human_count(d), "reps": reps}
    fp32_formula = allreduce_bytes(n, d, 4)

    # D-Lion full steps and their communication alone
    for mode, votes in DLION_VARIANTS:
        torch.manual_seed(0)  # identical parameters on every rank
        p = torch.randn(d)
        m = torch.zeros(d)

        def step(p=p, m=m, mode=mode, votes=votes):
            return common_step(p, grad, m, mode, votes, backend)

        all_t, stats = _timed(step, lambda: None, warmup, reps, n)
        formula = spec_bytes(mode, votes, n, d)
        row = dict(base, variant=f"dlion {mode}/{votes}", backend=stats.backend,
                   bytes_sent=stats.bytes_sent, bytes_formula=round(formula),
                   formula_kind="exact" if votes == "binary" else "upper bound",
                   padding_bytes=round(stats.bytes_sent - formula),
                   bytes_vs_fp32_allreduce=fp32_formula / stats.bytes_sent, **_summary(all_t))

        shard, p_in, p_out = packed_sizes(mode, votes, n, d)
        send = torch.zeros(n * shard * p_in, dtype=torch.int32)
        recv = torch.empty(n * shard * p_in, dtype=torch.int32)
        owned = torch.zeros(shard * p_out, dtype=torch.int32)
        gathered = torch.empty(n * shard * p_out, dtype=torch.int32)

        def comm(send=send, recv=recv, owned=owned, gathered=gathered):
            dist.all_to_all_single(recv, send)
            _all_gather(gathered, owned)

        comm_t, _ = _timed(comm, lambda: None, warmup, reps, n)
        cs = _summary(comm_t)
        row["comm_rank0_ms"], row["comm_max_ms"] = cs["t_rank0_ms"], cs["t_max_ms"]
        row["comm_bytes"] = (n - 1) * shard * (p_in + p_out) * WORD_BYTES
        rows.append(row)
        del p, m, send, recv, owned, gathered

    # all-reduce of an fp32 and of a bf16 gradient
    for dtype, name, elem in ((torch.float32, "fp32", 4), (torch.bfloat16, "bf16", 2)):
        src = grad.to(dtype)
        buf = torch.empty_like(src)
        all_t, _ = _timed(lambda buf=buf: dist.all_reduce(buf), lambda buf=buf, src=src:
                          buf.copy_(src), warmup, reps, n)
        b = allreduce_bytes(n, d, elem)
        s = _summary(all_t)
        rows.append(dict(base, variant=f"all_reduce {name}", backend="gloo", bytes_sent=None,
                         bytes_formula=round(b), formula_kind="ring",
                         bytes_vs_fp32_allreduce=fp32_formula / b, **s,
                         comm_rank0_ms=s["t_rank0_ms"], comm_max_ms=s["t_max_ms"],
                         comm_bytes=round(b)))
        del src, buf


def common_step(p, g, m, mode, votes, backend):
    import dlion_kernels as dk

    return dk.fused_dlion_step([p], [g], [m], lr=1e-4, betas=(0.9, 0.99), mode=mode,
                               votes=votes, backend=backend)


def _worker(rank, n, cfg):
    """One rank: every size of cfg that fits the budget; rank 0 returns the rows."""
    rows, skipped = [], []
    deadline = cfg["deadline"]
    prev = None  # (d, seconds) of the last size run
    for d in cfg["sizes"]:
        # rank 0 decides whether this size fits the time and memory budget; all follow
        decision = torch.zeros(1, dtype=torch.int32)
        reason = ""
        if rank == 0:
            need_mem = n * d * 26  # ~6.5 fp32 vectors of d per rank at the peak
            left = deadline - time.time()
            predicted = prev[1] * d / prev[0] * 1.15 if prev else 0.0
            if need_mem > 0.8 * _mem_available():
                reason = (f"needs ~{common.human_bytes(need_mem)}, "
                          f"{common.human_bytes(_mem_available())} available")
            elif predicted > left:
                reason = f"predicted {predicted:.0f} s > {max(left, 0):.0f} s left in budget"
            decision[0] = 1 if reason else 0
        dist.broadcast(decision, 0)
        if decision.item():
            if rank == 0:
                skipped.append({"n": n, "d": d, "reason": reason})
            continue
        t0 = time.time()
        _run_size(rank, n, d, cfg, rows)
        prev = (d, time.time() - t0)
        if rank == 0:
            print(f"  n={n} d={common.human_count(d)}: {prev[1]:.1f} s", flush=True)
    return {"rows": rows, "skipped": skipped} if rank == 0 else None


# ----------------------------------------------------------------------------- n = 1 compute


def compute_only(sizes, backend, reps, deadline) -> list[dict]:
    """The step's compute on one process, no collective (n = 1): what the 2-core box pays."""
    torch.set_num_threads(1)
    rows = []
    for d in sizes:
        if time.time() > deadline:
            break
        g = torch.randn(d)
        for mode, votes in DLION_VARIANTS:
            p, m = torch.randn(d), torch.zeros(d)
            times, stats = [], None
            for i in range(reps + 1):
                t0 = time.perf_counter()
                stats = common_step(p, g, m, mode, votes, backend)
                if i:
                    times.append(time.perf_counter() - t0)
            rows.append({"d": d, "d_human": common.human_count(d),
                         "variant": f"dlion {mode}/{votes}", "backend": stats.backend,
                         "t_ms": 1e3 * common.median(times),
                         "ns_per_element": 1e9 * common.median(times) / d})
    return rows


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(ap)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--sizes", nargs="+", default=["1M", "4M", "16M", "64M"],
                    help="elements per rank (suffixes k, M, G)")
    ap.add_argument("--backend", default=None,
                    help="dlion backend: None = auto (records what auto picked), torch, cpu")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5, help="timed reps for sizes below 16M")
    ap.add_argument("--reps-large", type=int, default=3, help="timed reps for sizes >= 16M")
    ap.add_argument("--budget-s", type=float, default=540.0,
                    help="time budget of the whole run; sizes predicted not to fit are skipped")
    ap.add_argument("--no-plot", action="store_true", help="do not write bench_comm.png")
    args = ap.parse_args(argv)
    if args.backend in ("None", "auto", ""):
        args.backend = None
    if args.smoke:
        args.ranks, args.sizes = [2], ["64k", "256k"]
        args.reps = args.reps_large = 3
        args.budget_s = min(args.budget_s, 50.0)
    sizes = [common.parse_count(s) for s in args.sizes]

    start = time.time()
    out_dir = common.results_dir("bench_comm", args.out)
    print(f"bench_comm: ranks {args.ranks}, sizes {[common.human_count(d) for d in sizes]}, "
          f"budget {args.budget_s:.0f} s -> {out_dir}", flush=True)

    # 10 % of the budget for the single-process compute table, the rest split over n
    compute = compute_only(sizes, args.backend, 3, start + 0.1 * args.budget_s)
    rows, skipped = [], []
    weights = {n: n for n in args.ranks}  # more ranks, more time (CPU contention)
    for i, n in enumerate(args.ranks):
        left = args.budget_s - (time.time() - start)
        share = left * weights[n] / sum(weights[k] for k in args.ranks[i:])
        cfg = {"sizes": sizes, "backend": args.backend, "warmup": args.warmup,
               "reps": args.reps, "reps_large": args.reps_large, "large": 16 << 20,
               "deadline": time.time() + share}
        print(f"n={n}: {share:.0f} s of budget", flush=True)
        result = common.run_ranks(n, _worker, cfg, timeout=share + 300)[0]
        rows += result["rows"]
        skipped += result["skipped"]

    for r in rows:
        fp32 = next(x for x in rows if x["n"] == r["n"] and x["d"] == r["d"]
                    and x["variant"] == "all_reduce fp32")
        r["speedup_vs_fp32_allreduce"] = fp32["t_max_ms"] / r["t_max_ms"]
        r["comm_speedup_vs_fp32_allreduce"] = fp32["comm_max_ms"] / r["comm_max_ms"]

    backends_used = sorted({r["backend"] for r in rows if r["variant"].startswith("dlion")})
    meta = common.metadata({"benchmark": "bench_comm", "transport": "gloo over loopback",
                            "dlion_backend_requested": args.backend or "auto",
                            "dlion_backend_used": backends_used,
                            "threads_per_rank": 1, "args": vars(args)})
    notes = [
        "times: median over reps; t_rank0 = rank 0's time, t_max = the slowest rank's time per "
        "rep, each rep started by a barrier on every rank",
        "bytes_sent: StepStats.bytes_sent (includes the 8-byte step header all-gather per "
        "peer); all_reduce bytes are the ring formula 2(n-1)/n * elem_bytes * d",
        "comm_*: the step's all_to_all_single + all_gather_into_tensor alone, packed sizes",
        "loopback on a 2-core host: n processes share 2 cores, so compute contends with "
        "communication and with each other (see the compute_n1 table)",
    ]
    common.save(out_dir, "bench_comm", rows, meta, skipped=skipped, compute_n1=compute,
                notes=notes)
    common.save(out_dir, "bench_comm_compute_n1", compute, meta)

    md = [f"# bench_comm ({meta['date']}, {meta['cpu_model']}, {meta['cpu_count']} cores, "
          f"backend {backends_used})\n"]
    md.append(common.markdown_table(rows, [
        ("n", "n"), ("d_human", "d"), ("variant", "variant"), ("backend", "backend"),
        ("t_rank0_ms", "step ms (rank 0)", ".2f"), ("t_max_ms", "step ms (max)", ".2f"),
        ("comm_max_ms", "comm-only ms (max)", ".2f"),
        ("speedup_vs_fp32_allreduce", "speedup vs fp32 AR", ".2f"),
        ("comm_speedup_vs_fp32_allreduce", "comm speedup vs fp32 AR", ".2f"),
    ], title="Time per step (gloo, loopback)"))
    md.append(common.markdown_table(rows, [
        ("n", "n"), ("d_human", "d"), ("variant", "variant"),
        ("bytes_sent", "bytes sent (StepStats)"), ("bytes_formula", "wire format formula"),
        ("formula_kind", "formula"), ("padding_bytes", "measured - formula"),
        ("bytes_vs_fp32_allreduce", "fp32 AR bytes / bytes", ".2f"),
    ], title="Bytes sent per rank per step vs the wire format's formulas"))
    md.append(common.markdown_table(compute, [
        ("d_human", "d"), ("variant", "variant"), ("backend", "backend"),
        ("t_ms", "step ms", ".2f"), ("ns_per_element", "ns/element", ".2f"),
    ], title="Compute only: one process, n = 1, 1 thread"))
    if skipped:
        md.append("### Skipped\n\n" + "\n".join(
            f"- n={s['n']} d={common.human_count(s['d'])}: {s['reason']}" for s in skipped) + "\n")
    md.append(f"Total wall time: {time.time() - start:.0f} s. Results: {out_dir}\n")
    text = "\n".join(md)
    common.save_text(out_dir, "bench_comm.md", text)
    print(text)
    common.plot_unless(args.no_plot, lambda: plot(rows, out_dir))
    return 0


def plot(rows: list[dict], out_dir: str) -> str | None:
    """Step time (slowest rank) against d, log-log, one line per variant, one panel per n."""
    plt = common.pyplot()
    if plt is None:
        return None
    from matplotlib.ticker import FuncFormatter

    ns = sorted({r["n"] for r in rows})
    if not ns:
        return None
    fig, axes = plt.subplots(1, len(ns), figsize=(4.5 * len(ns), 3.8), squeeze=False,
                             sharey=True)
    for ax, n in zip(axes[0], ns):
        variants = list(dict.fromkeys(r["variant"] for r in rows if r["n"] == n))
        for v in variants:
            rs = sorted((r for r in rows if r["n"] == n and r["variant"] == v),
                        key=lambda r: r["d"])
            ax.plot([r["d"] for r in rs], [r["t_max_ms"] for r in rs], marker="o",
                    linestyle="--" if v.startswith("all_reduce") else "-", label=v)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: common.human_count(int(v))))
        common.log_ms_axis(ax.yaxis)
        ax.set_title(f"n = {n}")
        ax.set_xlabel("d (fp32 elements per rank)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("step ms (slowest rank, median)")
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.suptitle("bench_comm: time per step, gloo over loopback")
    return common.save_figure(fig, out_dir, "bench_comm")


if __name__ == "__main__":
    sys.exit(main())
