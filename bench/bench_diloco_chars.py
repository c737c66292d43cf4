"""DiLoCo on the chars demo's transformer: quality at a fixed inner-step budget, and
loss against wall time and bytes on the emulated network.

Quality (untimed; the demo itself, ``python -m dlion_kernels.demo --task chars``, once per
(H, P), since H and P are one value per demo run):

    python bench/bench_diloco_chars.py quality --iters 320 --seeds 0 1 2 \\
        --dlion-lr 8=1e-2 32=1.4e-2 --nesterov-lr 8=0.5 32=0.7

runs adamw-allreduce and dlion-vote (per step), diloco-nesterov at each H of ``--sync-every``
and diloco-dlion at each H x P of ``--fragments``, 4 workers, the same inner steps, global
batches and initial weights for all, and writes ``quality.json`` (every demo row, per seed),
``quality.md`` (validation loss mean ± std over the seeds, bytes per rank per inner step, the
targets as measured) and each demo's own JSON.

Wall clock (timed: run it under the shared lock):

    flock <lock file> python bench/bench_diloco_chars.py wallclock \\
        --rates 0.01 0.1 1 --iters 320 --extra-iters 320 --h 8

one emulated network per rate (``network.py``: 4 nodes of 1 rank, each node's link shaped to the
rate in Gbit/s; by default 10 Mbit/s, 100 Mbit/s and 1 Gbit/s), 4 rank processes (gloo, 1
thread each) that train every strategy one after the other on the demo's model and data (random
seed 0), after ``--warmup`` dropped steps: per-step AdamW (all-reduce, the target) and D-Lion
(vote), and DiLoCo at one H (``--h``) with the fp32 Nesterov outer step, SparseLoCo's, D-Lion's
vote, and D-Lion's vote with error feedback decayed by 0.5 per sync (``diloco-dlion-ef-decay``);
``--dlion-lr``, ``--nesterov-lr``, ``--sparseloco-lr`` and ``--dlion-ef-decay-lr`` set their
outer lrs (default: each strategy's default). Every
``--eval-every`` inner steps the clock stops, every rank evaluates the validation loss
(``Built.evaluation()``: theta_bar for DiLoCo; the evaluation steps are sync steps, so every
rank holds it), and the clock starts again after a barrier; the per-step strategies get
``--extra-iters`` more steps than all-reduce AdamW so that they can reach its final loss. Writes
``wallclock.json`` (per strategy and rate, at every evaluation: inner step, training wall time of
the slowest rank and of every rank, bytes rank 0 sent, validation loss), ``wallclock.md`` (time
and bytes to reach all-reduce AdamW's final validation loss, the first to reach it and each
strategy's time to it relative to the first's, per rate) and ``wallclock-<rate>.png`` (loss
against wall time and against bytes). Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

PER_STEP = ["adamw-allreduce", "dlion-vote"]


def _load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _lrs(pairs) -> dict[int, float]:
    out = {}
    for item in pairs or []:
        h, _, lr = item.partition("=")
        try:
            out[int(h)] = float(lr)
        except ValueError:
            raise SystemExit(f"--dlion-lr / --nesterov-lr take H=LR pairs (e.g. 8=1e-2), got "
                             f"{item!r}") from None
    return out


# ----------------------------------------------------------------------------- quality


def quality(args) -> None:
    from dlion_kernels.demo import chars

    out = common.results_dir("diloco-chars", args.out)
    lrs, nlrs = _lrs(args.dlion_lr), _lrs(args.nesterov_lr)
    base = ["--task", "chars", "--workers", str(args.workers), "--iters", str(args.iters),
            "--seeds", *map(str, args.seeds), "--quiet"]
    runs = [("per-step", ["--strategy", *PER_STEP])]
    for h in args.sync_every:
        for p in args.fragments:
            names = (["diloco-nesterov"] if p == 1 else []) + ["diloco-dlion"]
            extra = ["--diloco-dlion-lr", str(lrs[h])] if h in lrs else []
            if p == 1 and h in nlrs:
                extra += ["--diloco-nesterov-lr", str(nlrs[h])]
            runs.append((f"H{h}-P{p}", ["--strategy", *names, "--sync-every", str(h),
                                        "--fragments", str(p), *extra]))
    meta = common.metadata({"load_start": _load()})
    rows, commands = [], []
    for name, argv in runs:
        argv = base + argv + ["--json", os.path.join(out, f"demo-{name}.json")]
        commands.append("python -m dlion_kernels.demo " + " ".join(argv))
        print(commands[-1], flush=True)
        rows += chars.main(argv)
    meta["load_end"] = _load()
    _quality_save(out, rows, args, meta, commands)


def _quality_save(out, rows, args, meta, commands) -> None:
    table = _quality_table(rows)
    text = _quality_md(table, rows, args)
    common.save_text(out, "quality.md", text + "\nCommands (each demo's JSON: demo-*.json):\n\n"
                     + "\n".join(f"    {c}" for c in commands) + "\n")
    common.save(out, "quality", table, meta, runs=rows, commands=commands)
    print(text)
    print(f"results in {out}")


def summarize(args) -> None:
    """quality.md / quality.json again from a folder's demo-*.json (a run that was cut short:
    the (H, P) groups it finished)."""
    import glob

    rows, commands = [], []
    for path in sorted(glob.glob(os.path.join(args.dir, "demo-*.json")),
                       key=lambda p: (p.count("H32"), p.count("P4"))):
        with open(path) as f:
            doc = json.load(f)
        rows += doc["runs"]
        commands.append(f"(from {os.path.basename(path)}) config: {json.dumps(doc['config'])}")
    args.seeds = sorted({r["seed"] for r in rows})
    args.sync_every = sorted({r["sync_every"] for r in rows if r["sync_every"]})
    args.fragments = sorted({r["fragments"] for r in rows if r["fragments"]})
    meta = common.metadata({"summarized_from": args.dir, "load_now": _load()})
    _quality_save(args.dir, rows, args, meta, commands)


def _quality_table(rows) -> list[dict]:
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["strategy"], r["sync_every"], r["fragments"]), []).append(r)
    table = []
    for (slug, h, p), runs in groups.items():
        losses = [r["val_loss"] for r in runs]
        table.append({"strategy": slug, "label": runs[0]["label"], "H": h, "P": p,
                      "seeds": len(runs), "val_loss_mean": statistics.fmean(losses),
                      "val_loss_std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
                      "bytes_per_step": statistics.fmean(r["bytes_per_step"] for r in runs),
                      "steps": runs[0]["steps"]})
    return table


def _quality_md(table, rows, args) -> str:
    lines = [f"| strategy | validation loss (mean ± std, {len(args.seeds)} seeds) | bytes / rank "
             "/ inner step |", "|---|---|---|"]
    for t in table:
        lines.append(f"| {t['label']} | {t['val_loss_mean']:.4f} ± {t['val_loss_std']:.4f} | "
                     f"{t['bytes_per_step']:,.0f} |")
    by = {(t["strategy"], t["H"], t["P"]): t for t in table}
    adamw = by[("adamw-allreduce", None, None)]
    lines += ["", f"{rows[0]['workers']} workers, {rows[0]['steps']} inner steps each, "
              f"{rows[0]['numel']:,} parameters.", "", "Targets as measured:", ""]
    for h in args.sync_every:
        nest = by.get(("diloco-nesterov", h, 1))
        for p in args.fragments:
            dl = by.get(("diloco-dlion", h, p))
            if nest is None or dl is None:
                continue
            gap = dl["val_loss_mean"] / nest["val_loss_mean"] - 1
            ratio = nest["bytes_per_step"] / dl["bytes_per_step"]
            lines.append(f"- H = {h}, P = {p}: DiLoCo-D-Lion {gap:+.2%} against DiLoCo-Nesterov"
                         f" (target within 2%: {'met' if gap <= 0.02 else 'missed'}), with "
                         f"1/{ratio:.1f} of its bytes")
            if h == 8:
                gap = dl["val_loss_mean"] / adamw["val_loss_mean"] - 1
                lines.append(f"- H = 8, P = {p}: DiLoCo-D-Lion {gap:+.2%} against all-reduce "
                             f"AdamW (target within 5%: {'met' if gap <= 0.05 else 'missed'})")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- wall clock


def _worker(cfg_path: str) -> None:
    """One rank inside its node's namespace: every strategy of the configuration in turn."""
    import torch
    import torch.distributed as dist

    from dlion_kernels import recipes as b
    from dlion_kernels.demo import chars

    with open(cfg_path) as f:
        cfg = json.load(f)
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{cfg['master']}:{cfg['port']}",
                            rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=cfg["timeout"]))
    a = types.SimpleNamespace(**cfg["model"])
    train, val = chars.load_text()
    evals = chars.val_starts(len(val), a.eval_windows, a.context)
    results = []
    # a fresh process runs its first steps slower (bench_training.py saw 3-6x): a warm-up run
    # of the first case, dropped
    warmup = dict(cfg["cases"][0], iters=cfg["warmup"], warmup=True)
    for case in [warmup] + cfg["cases"]:
        model = chars.make_model(a, cfg["seed"])
        settings = b.Settings(lion_lr=a.lion_lr, adamw_lr=a.adamw_lr,
                              weight_decay=a.weight_decay, bucket_mb=chars.BUCKET_MB,
                              sync_every=case["sync_every"], fragments=1,
                              diloco_dlion_lr=case.get("dlion_lr"),
                              diloco_nesterov_lr=case.get("nesterov_lr"),
                              diloco_sparseloco_lr=case.get("sparseloco_lr"))
        built = b.build(case["strategy"], model, settings)
        curve = [(0, 0.0, 0, chars.val_loss(model, val, evals, a.context, "cpu"))]
        wall = 0.0
        dist.barrier()
        start = time.perf_counter()
        for it in range(case["iters"]):
            x, y = chars.batch(train, chars.train_starts(len(train), cfg["seed"], it, rank, n,
                                                         a.batch_size, a.context), a.context)
            built.zero_grad()
            chars._loss(built(x), y).backward()
            built.step()
            if (it + 1) % cfg["eval_every"] == 0 or it + 1 == case["iters"]:
                wall += time.perf_counter() - start  # the clock stops for the evaluation
                with built.evaluation():
                    loss = chars.val_loss(model, val, evals, a.context, "cpu")
                curve.append((it + 1, wall, built.bytes_total, loss))
                dist.barrier()
                start = time.perf_counter()
        mine = torch.tensor([c[1] for c in curve], dtype=torch.float64)
        walls = [torch.empty_like(mine) for _ in range(n)]
        dist.all_gather(walls, mine)  # every rank's training time at every evaluation
        if case.get("warmup"):
            continue
        ranks = torch.stack(walls).T.tolist()
        results.append(dict(case, curve=[
            dict(step=c[0], wall_s=max(w), wall_s_ranks=w, bytes=c[2], val_loss=c[3])
            for c, w in zip(curve, ranks)]))
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        with open(cfg["result"], "w") as f:
            json.dump(results, f)


# the measured strategies after all-reduce AdamW, and which option sets each one's outer lr
# (the case's key, read as the Settings field of that outer step; diloco-dlion-ef-decay's outer
# lr is Settings.diloco_dlion_lr, set per case)
WALLCLOCK = {"dlion-vote": None, "diloco-nesterov": ("nesterov_lr", "nesterov_lr_value"),
             "diloco-sparseloco": ("sparseloco_lr", "sparseloco_lr_value"),
             "diloco-dlion": ("dlion_lr", "dlion_lr_value"),
             "diloco-dlion-ef-decay": ("dlion_lr", "dlion_ef_decay_lr_value")}


def _cases(args) -> list[dict]:
    cases = [{"strategy": "adamw-allreduce", "iters": args.iters, "sync_every": args.h}]
    for slug, lr in WALLCLOCK.items():
        case = {"strategy": slug, "iters": args.iters + args.extra_iters, "sync_every": args.h}
        if lr is not None and getattr(args, lr[1]) is not None:
            case[lr[0]] = getattr(args, lr[1])
        cases.append(case)
    return cases


def wallclock(args) -> None:
    import network

    from dlion_kernels.demo import chars

    network.check_privileges("dldc")
    network.install_signal_handlers()
    out = common.results_dir("diloco-wallclock", args.out)
    d = chars.parse_args(["--seeds", "0"])  # the demo's defaults: model, data, lrs
    model = {k: getattr(d, k) for k in ("context", "d_model", "heads", "layers", "batch_size",
                                        "eval_windows", "lion_lr", "adamw_lr", "weight_decay")}
    meta = common.metadata({"load_start": _load()})
    env = dict(os.environ, PYTHONPATH=common.REPO_ROOT + os.pathsep
               + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               **common.CACHING_MALLOC_ENV)
    results = []
    for rate in args.rates:
        with tempfile.TemporaryDirectory() as tmp, \
                network.Topology(args.workers, rate * 1000, ranks_per_node=1,
                                 prefix="dldc") as topo:
            cfg = {"master": topo.addrs[0],
                   "port": 20000 + int.from_bytes(os.urandom(2), "little") % 30000,
                   "timeout": 600, "seed": 0, "model": model, "eval_every": args.eval_every,
                   "warmup": args.warmup,
                   "cases": _cases(args), "result": os.path.join(tmp, "result.json")}
            cfg_path = os.path.join(tmp, "cfg.json")
            with open(cfg_path, "w") as f:
                json.dump(cfg, f)
            print(f"{rate:g} Gbit/s: {', '.join(c['strategy'] for c in cfg['cases'])}",
                  flush=True)
            topo.launch(lambda r: [sys.executable, os.path.abspath(__file__), "--worker",
                                   cfg_path], env, tmp, args.timeout, label=f"-{rate:g}")
            with open(cfg["result"]) as f:
                for r in json.load(f):
                    results.append(dict(r, rate_gbps=rate, shaper=topo.shaper))
    meta["load_end"] = _load()
    rows = _reach(results)
    text = _wallclock_md(rows, args)
    common.save_text(out, "wallclock.md", text)
    common.save(out, "wallclock", rows, meta, curves=results, args=vars(args))
    for rate in args.rates:
        _plot(out, rate, [r for r in results if r["rate_gbps"] == rate])
    print(text)
    print(f"results in {out}")


def _label(r) -> str:
    return r["strategy"] + (f" (H = {r['sync_every']})" if r["strategy"].startswith("diloco")
                            else "")


def _reach(results) -> list[dict]:
    """Per strategy and rate: the first evaluation at or below all-reduce AdamW's final loss."""
    rows = []
    for rate in dict.fromkeys(r["rate_gbps"] for r in results):
        here = [r for r in results if r["rate_gbps"] == rate]
        target = next(r for r in here if r["strategy"] == "adamw-allreduce")["curve"][-1]
        for r in here:
            hit = next((c for c in r["curve"] if c["val_loss"] <= target["val_loss"]), None)
            last = r["curve"][-1]
            rows.append({"rate_gbps": rate, "strategy": _label(r),
                         "target_loss": target["val_loss"], "final_loss": last["val_loss"],
                         "steps": last["step"], "wall_s": last["wall_s"],
                         "ms_per_step": 1e3 * last["wall_s"] / last["step"],
                         "bytes_per_step": last["bytes"] / last["step"],
                         "reach_step": hit and hit["step"], "reach_s": hit and hit["wall_s"],
                         "reach_bytes": hit and hit["bytes"]})
    return rows


def _wallclock_md(rows, args) -> str:
    lines = []
    for rate in args.rates:
        here = [r for r in rows if r["rate_gbps"] == rate]
        lines += [f"### {rate:g} Gbit/s per node, {args.workers} ranks; target: all-reduce AdamW's"
                  f" final validation loss {here[0]['target_loss']:.4f}", "",
                  "| strategy | time to target (s) | inner steps to target | bytes / rank to "
                  "target | final loss (steps) | ms / inner step | bytes / rank / inner step |",
                  "|---|---|---|---|---|---|---|"]
        for r in here:
            reach = ("not reached", "-", "-") if r["reach_s"] is None else (
                f"{r['reach_s']:.1f}", str(r["reach_step"]), f"{r['reach_bytes']:,}")
            lines.append(f"| {r['strategy']} | {reach[0]} | {reach[1]} | {reach[2]} | "
                         f"{r['final_loss']:.4f} ({r['steps']}) | {r['ms_per_step']:.1f} | "
                         f"{r['bytes_per_step']:,.0f} |")
        reached = [r for r in here if r["reach_s"] is not None]
        first = min(reached, key=lambda r: r["reach_s"]) if reached else None
        lines += ["", f"First to the target: {first['strategy'] if first else 'none'}."]
        if first is not None:
            lines.append("Time to the target relative to the first: " + ", ".join(
                f"{r['strategy']} " + ("not reached" if r["reach_s"] is None else
                                       f"{r['reach_s'] / first['reach_s']:.2f}x")
                for r in sorted(here, key=lambda r: (r["reach_s"] is None, r["reach_s"] or 0)))
                + ".")
        lines.append("")
    return "\n".join(lines)


def _plot(out, rate, results) -> None:
    plt = common.pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    target = next(r for r in results if r["strategy"] == "adamw-allreduce")["curve"][-1]
    for r in results:
        c = [p for p in r["curve"] if p["step"] > 0]
        left.plot([p["wall_s"] for p in c], [p["val_loss"] for p in c], label=_label(r))
        right.plot([max(p["bytes"], 1) for p in c], [p["val_loss"] for p in c], label=_label(r))
    for ax, xlabel in ((left, "training wall time (s, slowest rank)"),
                       (right, "bytes sent per rank (log)")):
        ax.axhline(target["val_loss"], color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss")
        ax.grid(alpha=0.3)
    right.set_xscale("log")
    left.legend(fontsize=8)
    fig.suptitle(f"chars transformer, 4 ranks, {rate:g} Gbit/s per node (emulated)")
    common.save_figure(fig, out, f"wallclock-{rate:g}gbps")


# ----------------------------------------------------------------------------- main


def main(argv=None) -> None:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--worker"]:
        _worker(argv[1])
        return
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    q = sub.add_parser("quality", help="validation loss at a fixed inner-step budget (untimed)")
    q.add_argument("--iters", type=int, default=320)
    q.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    q.add_argument("--sync-every", type=int, nargs="+", default=[8, 32])
    q.add_argument("--fragments", type=int, nargs="+", default=[1, 4])
    q.add_argument("--dlion-lr", nargs="*", metavar="H=LR",
                   help="diloco-dlion's outer lr per H (default: DiLoCo's, 1e-2)")
    q.add_argument("--nesterov-lr", nargs="*", metavar="H=LR",
                   help="diloco-nesterov's outer lr per H (default: DiLoCo's, 0.7)")
    r = sub.add_parser("summarize", help="quality.md again from a folder's demo-*.json")
    r.add_argument("dir")
    w = sub.add_parser("wallclock", help="loss against wall time and bytes (emulated network)")
    w.add_argument("--rates", type=float, nargs="+", default=[0.01, 0.1, 1.0],
                   help="Gbit/s per node (default: 10 Mbit/s, 100 Mbit/s, 1 Gbit/s)")
    w.add_argument("--iters", type=int, default=320, help="all-reduce AdamW's inner steps")
    w.add_argument("--extra-iters", type=int, default=160,
                   help="more inner steps for the other strategies")
    w.add_argument("--h", type=int, default=8, help="DiLoCo's H (P = 1)")
    w.add_argument("--dlion-lr", dest="dlion_lr_value", type=float, default=None,
                   help="diloco-dlion's outer lr (default: DiLoCo's, 1e-2)")
    w.add_argument("--nesterov-lr", dest="nesterov_lr_value", type=float, default=None,
                   help="diloco-nesterov's outer lr (default: DiLoCo's, 0.7)")
    w.add_argument("--sparseloco-lr", dest="sparseloco_lr_value", type=float, default=None,
                   help="diloco-sparseloco's outer lr (default: DiLoCo's, 1.0)")
    w.add_argument("--dlion-ef-decay-lr", dest="dlion_ef_decay_lr_value", type=float,
                   default=None, help="diloco-dlion-ef-decay's outer lr (default: DiLoCo's, 1e-2)")
    w.add_argument("--eval-every", type=int, default=8, help="a multiple of H")
    w.add_argument("--warmup", type=int, default=16,
                   help="inner steps of the first strategy run first and dropped")
    w.add_argument("--timeout", type=float, default=1200)
    for p in (q, w):
        p.add_argument("--workers", type=int, default=4)
        p.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.mode == "quality":
        quality(args)
    elif args.mode == "summarize":
        summarize(args)
    else:
        if args.eval_every % args.h:
            ap.error("--eval-every must be a multiple of --h (DiLoCo evaluates at its syncs)")
        wallclock(args)


if __name__ == "__main__":
    main()
