"""Does the exchange hide behind backward? Whole training steps of the overlap variants against
the same step without communication, each variant in its own launch, repeated.

Variants (the model, batch and step loop of ``bench_training.py``: ``--depth`` x (Linear(width,
width) + GELU), 24 x 1024 = 25.2M fp32 parameters, MSE on one fixed batch per rank):

======================  ======================================================================
``no_comm``             ``DistributedLion`` on a one-rank group: local Lion, no communication
``dlion``               ``DistributedLion(overlap=False)``: the whole exchange in ``step()``
``dlion_overlap``       ``DistributedLion(overlap=True, bucket_mb=...)``
``dlion_ddp_hook``      DDP(bucket_cap_mb=...) + ``dk.register_ddp_comm_hook``
``dlion_hier``          ``DistributedLion(hierarchy=L)`` (layouts with L > 1)
``dlion_hier_overlap``  the same with ``overlap=True``
======================  ======================================================================

Every (layout, rate) runs ``--rounds`` rounds; a round launches every variant once, in its own
fresh processes (one network of ``network.py`` per launch), the order rotated by one each round
so that every variant takes every position. A launch warms up ``--warmup`` steps (barrier before
each), then times ``--reps`` steps back to back (a step lasts from its start to the next one's);
its step time is the median over steps of the slowest rank. Each variant's ratio to no_comm is
taken within a round (the launches closest in time), then the median and the spread (min..max)
over rounds are reported, with ``overlap / ddp_hook`` and ``overlap / dlion``.

``--timeline``: instead, one launch per network runs ``dlion_overlap`` and ``dlion_ddp_hook``
alternately (A B A B) with ``overlap_trace.Tracer`` on every rank, and plots one step of each
path (``timeline-<network>.png``, every rank: the backward's progress, the exchange's work on the
main thread, host waits, and each collective from issue to completion), with per-bucket tables.

Output: ``bench/results/overlap-<stamp>/`` or ``--timeline``: ``overlap-timeline-<stamp>/`` (or
``--out``): ``bench_overlap.json`` / ``.csv`` / ``.md`` (rows: one per launch; ``ratios``: one
per variant and configuration; ``rank_times``: one per launch, every rank's timed steps
[cycle, fwd, bwd, opt] in ms), or ``timeline.json`` / ``timeline.md`` and the PNGs.

    sudo python bench/bench_overlap.py                    # 1, 10 Gbit/s; 4x1 and 2x2; 3 rounds
    sudo python bench/bench_overlap.py --timeline         # 1 Gbit/s 4x1, and loopback
    sudo python bench/bench_overlap.py --smoke            # tiny model, 2 ranks, 1 round
"""

from __future__ import annotations

import argparse
import datetime
import gc
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from dlion_kernels.accounting import BUCKET_MB  # noqa: E402
import network  # noqa: E402

LABELS = {
    "no_comm": "no communication (local Lion)",
    "dlion": "DistributedLion overlap=False",
    "dlion_overlap": "DistributedLion overlap=True",
    "dlion_ddp_hook": "register_ddp_comm_hook",
    "dlion_hier": "hierarchy overlap=False",
    "dlion_hier_overlap": "hierarchy overlap=True",
}
FLAT = ["no_comm", "dlion", "dlion_overlap", "dlion_ddp_hook"]
HIER = ["no_comm", "dlion_hier", "dlion_hier_overlap"]
TRACED = ["dlion_overlap", "dlion_ddp_hook"]


# ----------------------------------------------------------------------------- worker


def worker(cfg_path: str) -> None:
    """One rank, inside its node's namespace (RANK etc. from the environment): every case of
    the config in order; rank 0 writes the step times, every rank its trace (``--timeline``)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import dlion_kernels as dk

    with open(cfg_path) as f:
        cfg = json.load(f)
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    L = int(os.environ["LOCAL_WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{cfg['master']}:{cfg['port']}",
                            rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=cfg["timeout"]))
    solo = [dist.new_group([r]) for r in range(n)][rank]  # every rank creates every group
    tracer = None
    if cfg["trace"]:
        import overlap_trace

        tracer = overlap_trace.Tracer()
        tracer.install()
    width, depth, lr = cfg["width"], cfg["depth"], 1e-4
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def build(variant, bucket_mb):
        torch.manual_seed(0)  # identical initial parameters on every rank
        layers = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
        model = torch.nn.Sequential(*layers)
        params = list(model.parameters())
        if variant == "no_comm":
            return model, dk.DistributedLion(params, lr=lr, group=solo)
        if variant == "dlion":
            return model, dk.DistributedLion(params, lr=lr)
        if variant == "dlion_overlap":
            return model, dk.DistributedLion(params, lr=lr, overlap=True, bucket_mb=bucket_mb)
        if variant == "dlion_ddp_hook":
            ddp = DDP(model, bucket_cap_mb=bucket_mb)
            opt = dk.DistributedLion(ddp.parameters(), lr=lr)
            dk.register_ddp_comm_hook(ddp, opt)
            return ddp, opt
        if variant in ("dlion_hier", "dlion_hier_overlap"):
            kw = {"overlap": True, "bucket_mb": bucket_mb} if variant.endswith("overlap") else {}
            return model, dk.DistributedLion(params, lr=lr, hierarchy=L, **kw)
        raise ValueError(f"unknown variant {variant!r}")

    results = []
    for index, case in enumerate(cfg["cases"]):
        model, opt = build(case["variant"], cfg["bucket_mb"])
        handles = tracer.watch_grads(list(model.parameters())) if tracer else []
        gen = torch.Generator().manual_seed(1000 + rank)
        x = torch.randn(cfg["batch"], width, generator=gen)
        y = torch.randn(cfg["batch"], width, generator=gen)
        warmup, reps = cfg["warmup"], cfg["reps"]
        times = []  # per timed step: start, fwd, bwd, opt (s); the start becomes the cycle
        for i in range(warmup + reps):
            if i <= warmup:
                dist.barrier()  # warm-up steps and the first timed one start together
            if tracer:
                if i <= warmup:
                    tracer.events.clear()  # keep the timed steps only
                tracer.start_step(i - warmup)
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x), y)
            t1 = time.perf_counter()
            if tracer:
                tracer.mark("fwd_end")
            loss.backward()
            t2 = time.perf_counter()
            if tracer:
                tracer.mark("bwd_end")
            opt.step()
            t3 = time.perf_counter()
            if tracer:
                tracer.mark("step_end")
            if i >= warmup:
                times.append([t0, t1 - t0, t2 - t1, t3 - t2])
        dist.barrier()
        t_end = time.perf_counter()
        starts = [t[0] for t in times] + [t_end]
        for k, t in enumerate(times):
            t[0] = starts[k + 1] - starts[k]
        everyone = torch.empty(n * reps * 4, dtype=torch.float64)
        gather(everyone, torch.tensor(sum(times, []), dtype=torch.float64))
        stats = opt.last_stats
        results.append({"index": index, "variant": case["variant"],
                        "times": everyone.view(n, reps, 4).tolist(),
                        "bytes_sent": stats.bytes_sent, "buckets": stats.buckets})
        if tracer:
            with open(os.path.join(cfg["dir"], f"trace-{index}-r{rank}.json"), "w") as f:
                json.dump(tracer.dump(), f)
            tracer.events.clear()
        for h in handles:
            h.remove()
        del model, opt
        gc.collect()  # DDP and its comm hook hold the optimizer in cycles
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        with open(os.path.join(cfg["dir"], "result.json"), "w") as f:
            json.dump(results, f)


# ----------------------------------------------------------------------------- driver


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True,
                              timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        with open("/proc/loadavg") as f:
            return "load average " + " ".join(f.read().split()[:3])


def launch(net: dict, cases: list[str], args, tmp: str, trace: bool = False) -> tuple[list, str]:
    """Run ``cases`` (variant names) in one launch on the network ``net`` (nodes, L, rate in
    Gbit/s or None for unshaped); returns the rank-0 results and the launch's folder."""
    label = f"{net['nodes']}x{net['L']}-{net['rate'] or 'lo'}-{os.urandom(3).hex()}"
    run_dir = os.path.join(tmp, label)
    os.makedirs(run_dir)
    rate = net["rate"] * 1000 if net["rate"] else None
    timeout = args.launch_timeout_s
    with network.Topology(net["nodes"], rate, ranks_per_node=net["L"], prefix="dlbo") as topo:
        cfg = {"master": topo.addrs[0],
               "port": 20000 + int.from_bytes(os.urandom(2), "little") % 30000,
               "width": args.width, "depth": args.depth, "batch": args.batch,
               "bucket_mb": args.bucket_mb, "warmup": args.warmup, "reps": args.reps,
               "timeout": max(120, int(timeout)), "trace": trace, "dir": run_dir,
               "cases": [{"variant": v} for v in cases]}
        cfg_path = os.path.join(run_dir, "cfg.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        env = dict(os.environ, PYTHONPATH=common.REPO_ROOT + os.pathsep + common.BENCH_DIR
                   + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
                   **common.CACHING_MALLOC_ENV)
        topo.launch(lambda r: [sys.executable, os.path.abspath(__file__), "--worker", cfg_path],
                    env, run_dir, timeout, label=f"-{label}")
    with open(os.path.join(run_dir, "result.json")) as f:
        return json.load(f), run_dir


def step_ms(times) -> dict:
    """times [rank][rep][step, fwd, bwd, opt] (s) -> the launch's figures in ms."""
    n, reps = len(times), len(times[0])
    slowest = [max(times[r][k][0] for r in range(n)) for k in range(reps)]
    phase = lambda j: 1e3 * common.median([times[r][k][j] for r in range(n)  # noqa: E731
                                           for k in range(reps)])
    return {"step_ms": 1e3 * common.median(slowest), "fwd_ms": phase(1), "bwd_ms": phase(2),
            "opt_ms": phase(3)}


def net_name(net: dict) -> str:
    rate = f"{net['rate']:g} Gbit/s" if net["rate"] else "loopback"
    return f"{net['nodes']}x{net['L']} {rate}"


def networks(args) -> list[dict]:
    out = []
    for rate in args.rates_gbit:
        for item in args.layouts.split(","):
            nodes, L = (int(v) for v in item.lower().split("x"))
            out.append({"nodes": nodes, "L": L, "rate": rate or None})
    return out


def ratios(rows: list[dict]) -> list[dict]:
    """Per configuration and variant: the ratio to the same round's no_comm, median and spread
    over rounds; plus overlap / ddp_hook, overlap / dlion (flat) and hier overlap / hier."""
    out = []
    configs = sorted({r["network"] for r in rows}, key=lambda k: [r["network"] for r in
                                                                  rows].index(k))
    pairs = {"vs_no_comm": None, "overlap_vs_ddp_hook": ("dlion_overlap", "dlion_ddp_hook"),
             "overlap_vs_dlion": ("dlion_overlap", "dlion"),
             "hier_overlap_vs_hier": ("dlion_hier_overlap", "dlion_hier")}
    for config in configs:
        here = [r for r in rows if r["network"] == config]
        rounds = sorted({r["round"] for r in here})
        by = {(r["round"], r["variant"]): r["step_ms"] for r in here}
        for variant in dict.fromkeys(r["variant"] for r in here):
            vs = [by[k, variant] / by[k, "no_comm"] for k in rounds
                  if (k, variant) in by and (k, "no_comm") in by]
            if vs:
                out.append(_spread(config, variant, "vs_no_comm", vs,
                                   [by[k, variant] for k in rounds if (k, variant) in by]))
        for name, pair in pairs.items():
            if pair is None:
                continue
            vs = [by[k, pair[0]] / by[k, pair[1]] for k in rounds
                  if (k, pair[0]) in by and (k, pair[1]) in by]
            if vs:
                out.append(_spread(config, pair[0], name, vs, None))
    return out


def _spread(config, variant, what, values, steps) -> dict:
    row = {"network": config, "variant": variant, "ratio": what, "rounds": len(values),
           "median": common.median(values), "min": min(values), "max": max(values),
           "values": [round(v, 4) for v in values]}
    if steps:
        row["step_ms_median"] = common.median(steps)
    return row


def targets(rat: list[dict]) -> list[str]:
    """The overlap targets, PASS / FAIL as measured."""
    lines = []
    get = {(r["network"], r["variant"], r["ratio"]): r for r in rat}
    for config in dict.fromkeys(r["network"] for r in rat):
        hook = get.get((config, "dlion_overlap", "overlap_vs_ddp_hook"))
        if hook:
            ok = hook["median"] <= 1.03
            lines.append(f"{'PASS' if ok else 'FAIL'} {config}: overlap=True / DDP hook = "
                         f"{hook['median']:.3f} (spread {hook['min']:.3f}..{hook['max']:.3f};"
                         " target <= 1.03)")
        nc = get.get((config, "dlion_overlap", "vs_no_comm"))
        if nc and config.endswith(" 1 Gbit/s"):
            ok = nc["median"] <= 1.05
            lines.append(f"{'PASS' if ok else 'FAIL'} {config}: overlap=True / no comm = "
                         f"{nc['median']:.3f} (spread {nc['min']:.3f}..{nc['max']:.3f}; "
                         "target <= 1.05)")
        for variant, pair in (("dlion_overlap", "overlap_vs_dlion"),
                              ("dlion_hier_overlap", "hier_overlap_vs_hier")):
            r = get.get((config, variant, pair))
            if r:
                spread = r["max"] - r["min"]
                ok = r["median"] <= 1 + spread
                lines.append(f"{'PASS' if ok else 'FAIL'} {config}: {LABELS[variant]} / "
                             f"overlap=False = {r['median']:.3f} (spread {r['min']:.3f}.."
                             f"{r['max']:.3f}; target <= 1 + spread)")
    return lines


def run_bench(args) -> int:
    start = time.time()
    out_dir = common.results_dir("overlap", args.out)
    before = uptime()
    nets = networks(args)
    print(f"bench_overlap: {len(nets)} networks x {args.rounds} rounds -> {out_dir}\n{before}",
          flush=True)
    rows, failed, per_rank = [], [], []
    with tempfile.TemporaryDirectory(prefix="bench_overlap-") as tmp:
        for net in nets:
            variants = FLAT if net["L"] == 1 else HIER
            variants = [v for v in variants if v in args.variants]
            for k in range(args.rounds):
                order = variants[k % len(variants):] + variants[:k % len(variants)]
                for pos, variant in enumerate(order):
                    t0 = time.time()
                    try:
                        (res,), _ = launch(net, [variant], args, tmp)
                    except RuntimeError as e:  # a rank died: record it, go on
                        failed.append({"network": net_name(net), "round": k,
                                       "variant": variant, "error": str(e)[:2000]})
                        print(f"  {net_name(net)} round {k} {variant}: FAILED "
                              f"{str(e).splitlines()[0][:200]}", flush=True)
                        continue
                    with open("/proc/loadavg") as f:
                        load = float(f.read().split()[0])
                    row = {"network": net_name(net), "nodes": net["nodes"], "L": net["L"],
                           "rate_gbps": net["rate"], "round": k, "position": pos,
                           "variant": variant, "label": LABELS[variant],
                           **step_ms(res["times"]), "bytes_sent": res["bytes_sent"],
                           "buckets": res["buckets"], "load_1min": load,
                           "launch_s": time.time() - t0}
                    rows.append(row)
                    per_rank.append({"network": row["network"], "round": k, "variant": variant,
                                     "times_ms": [[[round(1e3 * t, 3) for t in step]
                                                   for step in rank] for rank in res["times"]]})
                    print(f"  {net_name(net)} round {k} {variant:<20} {row['step_ms']:7.1f} ms"
                          f" (launch {row['launch_s']:.0f} s, load {load:.1f})", flush=True)
    rat = ratios(rows)
    lines = targets(rat)
    after = uptime()
    meta = common.metadata({
        "benchmark": "bench_overlap", "uptime_before": before, "uptime_after": after,
        "model": f"{args.depth} x (Linear({args.width}, {args.width}) + GELU), MSE, fp32",
        "params": args.depth * (args.width * args.width + args.width),
        "rank_env": common.CACHING_MALLOC_ENV, "args": vars(args),
        "wall_s": round(time.time() - start)})
    notes = [f"{os.cpu_count()} cores shared by all ranks (1 thread each) and by whatever else "
             "runs on the host: compare ratios, not milliseconds",
             "step_ms: median over the timed steps of the slowest rank; ratios are taken within "
             "a round (launches adjacent in time), then median and min..max over rounds",
             f"uptime before: {before}; after: {after}"]
    common.save(out_dir, "bench_overlap", rows, meta, ratios=rat, targets=lines, failed=failed,
                notes=notes, rank_times=per_rank)
    md = [f"# bench_overlap ({meta['date']}, {meta['cpu_model']}, {meta['cpu_count']} cores, "
          f"{meta['model']}, {meta['params'] / 1e6:.1f}M params, torch {meta['torch']}, "
          f"commit {meta['git_commit']})\n", f"Command: `{meta['command']}`\n",
          common.markdown_table(rat, [
              ("network", "network"), ("variant", "variant"), ("ratio", "ratio"),
              ("median", "median", ".3f"), ("min", "min", ".3f"), ("max", "max", ".3f"),
              ("rounds", "rounds"), ("step_ms_median", "step ms (median)", ".1f")],
              title="Ratios (median and spread over rounds)"),
          common.markdown_table(rows, [
              ("network", "network"), ("round", "round"), ("position", "pos"),
              ("variant", "variant"), ("step_ms", "step ms", ".1f"), ("fwd_ms", "fwd", ".1f"),
              ("bwd_ms", "bwd", ".1f"), ("opt_ms", "opt", ".1f"), ("buckets", "buckets"),
              ("bytes_sent", "bytes/rank"), ("load_1min", "load", ".1f")],
              title="Launches"),
          "### Targets\n\n" + "\n".join(f"- {x}" for x in lines) + "\n",
          "### Notes\n\n" + "\n".join(f"- {x}" for x in notes) + "\n"]
    if failed:
        md.append("### Failed launches\n\n" + "\n".join(
            f"- {f['network']} round {f['round']} {f['variant']}: "
            f"{f['error'].splitlines()[0][:300]}" for f in failed) + "\n")
    md.append(f"Total wall time: {time.time() - start:.0f} s. Results: {out_dir}\n")
    text = "\n".join(md)
    common.save_text(out_dir, "bench_overlap.md", text)
    print(text)
    return 1 if failed else 0


def run_timeline(args) -> int:
    """Both paths alternately in one launch per network, traced; plots and tables."""
    start = time.time()
    out_dir = common.results_dir("overlap-timeline", args.out)
    before = uptime()
    cases = [v for _ in range(args.rounds) for v in TRACED]
    md, report = [], {}
    with tempfile.TemporaryDirectory(prefix="bench_overlap-") as tmp:
        for net in networks(args):
            name = net_name(net)
            results, run_dir = launch(net, cases, args, tmp, trace=True)
            n = net["nodes"] * net["L"]
            traced = []
            for res in results:
                ranks = []
                for r in range(n):
                    with open(os.path.join(run_dir, f"trace-{res['index']}-r{r}.json")) as f:
                        ranks.append(json.load(f))
                traced.append({"variant": res["variant"], "times": res["times"],
                               "buckets": res["buckets"], "ranks": ranks})
            with gzip.open(os.path.join(out_dir, f"traces-{slug(name)}.json.gz"), "wt") as f:
                json.dump(traced, f)
            title = (f"{name}, n = {n}, {args.depth} x Linear({args.width}), batch {args.batch},"
                     f" bucket_mb {args.bucket_mb:g}; commit {common._git_commit()}")
            report[name], text = timeline_report(name, traced, out_dir, title)
            md.append(text)
            print(text, flush=True)
    meta = common.metadata({"benchmark": "bench_overlap --timeline", "uptime_before": before,
                            "uptime_after": uptime(), "args": vars(args),
                            "wall_s": round(time.time() - start)})
    with open(os.path.join(out_dir, "timeline.json"), "w") as f:
        json.dump({"metadata": meta, "networks": report}, f, indent=1, default=str)
    head = (f"# Overlap timelines ({meta['date']}, commit {meta['git_commit']})\n\n"
            f"Command: `{meta['command']}`\n\nLoad: before `{before}`; after "
            f"`{meta['uptime_after']}`\n\n")
    common.save_text(out_dir, "timeline.md", head + "\n".join(md))
    print(f"-> {out_dir}")
    return 0


def slug(name: str) -> str:
    return name.replace(" ", "-").replace("/", "")


def timeline_report(name: str, traced: list[dict], out_dir: str, title: str) -> tuple:
    """From one network's traced launches (``traces-*.json.gz``): the plot of each path's
    median step (slowest rank) and the tables; returns (report, markdown)."""
    import overlap_trace as ot

    n = len(traced[0]["ranks"])
    panels, rows, summaries, report = [], [], [], {}
    for variant in TRACED:
        mine = [case for case in traced if case["variant"] == variant]
        # every timed step of every launch of this variant: (step s, launch, step)
        steps = sorted((max(case["times"][r][k][0] for r in range(n)), i, k)
                       for i, case in enumerate(mine) for k in range(len(case["times"][0])))
        s, i, k = steps[len(steps) // 2]  # the median step (slowest rank)
        events = [ot.step_events(tr, k) for tr in mine[i]["ranks"]]
        panels.append((f"{LABELS[variant]}: median step, {1e3 * s:.0f} ms (slowest rank), "
                       f"{mine[i]['buckets']} buckets", events))
        for r, ev in enumerate(events):
            for b in ot.bucket_table(ev):
                rows.append(dict(network=name, variant=variant, rank=r, **b))
        for case in mine:
            for kk in range(len(case["times"][0])):
                for r in range(n):
                    summaries.append(dict(variant=variant, rank=r, step=kk, **ot.summary(
                        ot.step_events(case["ranks"][r], kk))))
        report[variant] = {"step_ms_all": [round(1e3 * x[0], 2) for x in steps],
                           "step_ms_median": 1e3 * s}
    png = ot.plot(panels, os.path.join(out_dir, f"timeline-{slug(name)}.png"), title)
    med = _median_summaries(summaries)
    report["buckets"], report["summary"] = rows, med
    text = (f"## {name}\n\n" + (f"Plot: `{os.path.basename(png)}`\n\n" if png else "")
            + common.markdown_table(med, [
                ("variant", "variant"), ("fwd_ms", "fwd", ".1f"),
                ("bwd_ms", "bwd", ".1f"), ("opt_ms", "opt", ".1f"),
                ("bwd_hook_ms", "in hooks", ".1f"), ("bwd_local_step_ms", "local step", ".1f"),
                ("bwd_tally_ms", "tally (bwd)", ".1f"),
                ("bwd_wait_ms", "host wait (bwd)", ".1f"),
                ("opt_wait_ms", "host wait (step)", ".1f"),
                ("opt_tally_ms", "tally (step)", ".1f"), ("opt_apply_ms", "apply", ".1f"),
                ("first_a2a_issued_ms", "1st a2a at", ".1f"),
                ("last_grad_ms", "last grad at", ".1f")],
                title="Median over steps and ranks (ms; 'at': from the backward's start)")
            + common.markdown_table([r for r in rows if r["rank"] == 0], [
                ("variant", "variant"), ("bucket", "bucket"),
                ("a2a_issued_ms", "a2a issued", ".1f"), ("a2a_done_ms", "a2a done", ".1f"),
                ("a2a_wait_start_ms", "a2a wait at", ".1f"),
                ("a2a_wait_ms", "a2a wait", ".1f"),
                ("gather_issued_ms", "gather issued", ".1f"),
                ("gather_done_ms", "gather done", ".1f"),
                ("gather_wait_ms", "gather wait", ".1f")],
                title="Rank 0, the plotted step, per bucket (ms from the backward's start)"))
    return report, text


def replot(folder: str) -> int:
    """Draw a --timeline folder's plots again from its stored traces (same steps, tables)."""
    with open(os.path.join(folder, "timeline.json")) as f:
        saved = json.load(f)
    meta, names = saved["metadata"], list(saved["networks"])
    a = meta["args"]
    for name in names:
        with gzip.open(os.path.join(folder, f"traces-{slug(name)}.json.gz"), "rt") as f:
            traced = json.load(f)
        n = len(traced[0]["ranks"])
        title = (f"{name}, n = {n}, {a['depth']} x Linear({a['width']}), batch {a['batch']}, "
                 f"bucket_mb {a['bucket_mb']:g}; commit {meta['git_commit']}")
        timeline_report(name, traced, folder, title)
        print(f"replotted {name} in {folder}")
    return 0


def _median_summaries(summaries: list[dict]) -> list[dict]:
    out = []
    for variant in TRACED:
        here = [s for s in summaries if s["variant"] == variant]
        keys = [k for k in here[0] if k.endswith("_ms")]
        row = {"variant": variant}
        for k in keys:
            vals = [s[k] for s in here if k in s]
            row[k] = common.median(vals) if vals else None
        out.append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(ap)
    ap.add_argument("--timeline", action="store_true",
                    help="trace dlion_overlap and dlion_ddp_hook in one launch and plot")
    ap.add_argument("--layouts", default=None,
                    help="NODESxRANKS_PER_NODE list (default 4x1,2x2; --timeline: 4x1)")
    ap.add_argument("--rates-gbit", type=float, nargs="+", default=None,
                    help="0 = unshaped (loopback); default 1 10 (--timeline: 1 0)")
    ap.add_argument("--variants", default=",".join(LABELS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=24)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--bucket-mb", type=float, default=BUCKET_MB)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--launch-timeout-s", type=float, default=600.0)
    ap.add_argument("--replot", metavar="DIR",
                    help="draw a --timeline folder's plots again from its traces")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    if args.replot:
        return replot(args.replot)
    if args.layouts is None:
        args.layouts = "4x1" if args.timeline else "4x1,2x2"
    if args.rates_gbit is None:
        args.rates_gbit = [1.0, 0.0] if args.timeline else [1.0, 10.0]
    if args.smoke:
        args.layouts, args.rates_gbit = "2x1", [1.0]
        args.width, args.depth, args.batch, args.bucket_mb = 256, 4, 8, 0.3
        args.warmup, args.reps, args.rounds = 2, 3, 1
    args.variants = [v for v in args.variants.split(",") if v]
    for v in args.variants:
        if v not in LABELS:
            raise SystemExit(f"unknown variant {v!r}; known: {', '.join(LABELS)}")
    try:
        network.check_privileges("dlbo")
    except network.Skip as e:
        print(f"bench_overlap skipped: {e}")
        return 0
    network.install_signal_handlers()
    return run_timeline(args) if args.timeline else run_bench(args)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt as e:
        print(f"bench_overlap interrupted ({e or 'SIGINT'}); namespaces removed",
              file=sys.stderr)
        sys.exit(130)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        sys.exit(1)
