"""Soak: many training steps on gloo ranks, watching for leaks, in two phases.

    python bench/bench_soak.py                    # 4 ranks, 2000 steps of each phase
    python bench/bench_soak.py --strategy decentralized   # one phase only
    python bench/bench_soak.py --smoke --out DIR  # 2 ranks, 120 steps of each (CI, -m bench)

Phases (``--strategy``, default ``all``: one after the other, each on fresh processes):

- ``dlion``: DistributedLion, one exchange per step;
- ``decentralized``: DecentralizedDataParallel with AccumAdamW on the ring topology (gossip
  all-reduces in flight across iterations, one bucket engine, several buckets), synchronize()
  before each save.

Each rank trains a small MLP on random data with its own batches, calls dk.save_state every
--save-every steps (so checkpoint files and descriptors are part of the soak), and samples its
resident memory (VmRSS), open file descriptors (/proc/self/fd) and thread count every
--sample-every steps. After the warm-up (the first --warmup steps) each may grow by at most
--max-growth percent over its value at the end of the warm-up. Writes soak.json (metadata, rows,
samples), soak.csv (the rows: one per phase and rank), soak_samples.csv (one row per sample) and
soak.md, under bench/results/soak-<timestamp>/ or --out; exits 1 if a limit is exceeded.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import common
import torch


def _proc_status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "Threads"):
                out[key] = int(value.split()[0])
    return dict(rss_kb=out["VmRSS"], fds=len(os.listdir("/proc/self/fd")), threads=out["Threads"])


STRATEGIES = ("dlion", "decentralized")


def _rank(rank, n, args, strategy, ckpt_dir):
    """One rank of one phase: train, save, sample; returns its samples and summary."""
    import dlion_kernels as dk

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, args.hidden), torch.nn.GELU(),
                                torch.nn.Linear(args.hidden, 10))
    if strategy == "dlion":
        opt = dk.DistributedLion(model.parameters(), lr=1e-3, weight_decay=1e-2)
        net, saved = model, opt
    else:
        # 4 KiB buckets: two (one per layer), so one bucket's gossip is in flight while the
        # next one steps (the engine's per-bucket path is soaked, not a single flush)
        net = dk.DecentralizedDataParallel(
            model, lambda params: dk.AccumAdamW(params, lr=1e-3, weight_decay=1e-2),
            topology="ring", bucket_mb=1 / 256)
        opt, saved = None, net
    gen = torch.Generator().manual_seed(rank)
    samples, losses = [], []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x = torch.randn(32, 64, generator=gen)
        y = torch.randint(0, 10, (32,), generator=gen)
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()  # decentralized: the buckets' steps and gossip happen here
        if opt is not None:
            opt.step()
        losses.append(loss.item())
        if step % args.save_every == 0:
            if opt is None:
                net.synchronize()  # in-flight gossip is not part of the saved state
            dk.save_state(saved, ckpt_dir)
        if step % args.sample_every == 0 or step == 1:
            samples.append(dict(strategy=strategy, rank=rank, step=step, **_proc_status()))
    wall = time.perf_counter() - start
    if opt is None:
        net.synchronize()
    return dict(strategy=strategy, rank=rank, samples=samples, wall_s=wall,
                first_loss=sum(losses[:50]) / 50, last_loss=sum(losses[-50:]) / 50,
                ckpt_files=len(os.listdir(ckpt_dir)))


def _growth(samples, warmup, key):
    after = [s for s in samples if s["step"] >= warmup]
    base = after[0][key]
    peak = max(s[key] for s in after)
    return base, after[-1][key], peak, 100.0 * (peak - base) / base


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--sample-every", type=int, default=20)
    ap.add_argument("--save-every", type=int, default=250)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--max-growth", type=float, default=1.0, help="percent")
    ap.add_argument("--strategy", choices=("all",) + STRATEGIES, default="all",
                    help="which phase(s) to soak (all: dlion, then decentralized)")
    common.add_common_args(ap)  # --smoke: 2 ranks, 120 steps per phase
    args = ap.parse_args(argv)
    if args.smoke:
        args.ranks, args.steps, args.warmup = 2, 120, 40
        args.sample_every, args.save_every = 10, 30
    out = common.results_dir("soak", args.out)

    strategies = STRATEGIES if args.strategy == "all" else (args.strategy,)
    load_before = os.getloadavg()
    results = []
    for strategy in strategies:  # each phase on fresh processes and a fresh checkpoint folder
        with tempfile.TemporaryDirectory() as ckpt:
            results += common.run_ranks(args.ranks, _rank, args, strategy, ckpt, timeout=3600)

    rows, ok = [], True
    for r in results:
        row = dict(strategy=r["strategy"], rank=r["rank"], wall_s=round(r["wall_s"], 1),
                   first_loss=r["first_loss"], last_loss=r["last_loss"],
                   ckpt_files=r["ckpt_files"])
        for key in ("rss_kb", "fds", "threads"):
            base, end, peak, pct = _growth(r["samples"], args.warmup, key)
            row.update({f"{key}_warm": base, f"{key}_end": end, f"{key}_peak": peak,
                        f"{key}_growth_pct": round(pct, 3)})
            ok &= pct <= args.max_growth
        ok &= r["ckpt_files"] == args.ranks + 1  # rank files of the last save + manifest
        rows.append(row)

    meta = common.metadata(dict(
        benchmark="bench_soak", loadavg_before=load_before, loadavg_after=os.getloadavg(),
        ranks=args.ranks, steps=args.steps, warmup=args.warmup, max_growth_pct=args.max_growth,
        strategies=list(strategies), ok=ok))
    common.save(out, "soak", rows, meta, samples=[r["samples"] for r in results])
    common.save_csv(out, "soak_samples", [s for r in results for s in r["samples"]])
    names = dict(dlion="DistributedLion", decentralized="decentralized (ring, AccumAdamW)")
    table = common.markdown_table(
        [dict(r, rss=f"{r['rss_kb_warm'] / 1024:.1f} -> {r['rss_kb_end'] / 1024:.1f} "
                     f"({r['rss_kb_peak'] / 1024:.1f})",
              fds=f"{r['fds_warm']} -> {r['fds_end']}",
              threads=f"{r['threads_warm']} -> {r['threads_end']}",
              loss=f"{r['first_loss']:.3f} -> {r['last_loss']:.3f}") for r in rows],
        [("strategy", "phase"), "rank", ("rss", "RSS MB warm -> end (peak)"),
         ("rss_kb_growth_pct", "growth %", ".2f"), ("fds", "fds warm -> end"),
         ("threads", "threads warm -> end"), ("loss", "loss first 50 -> last 50"),
         ("wall_s", "wall s")])
    text = (f"Soak: {args.steps} steps of each of "
            f"{', '.join(names[s] for s in strategies)} on {args.ranks} gloo ranks, "
            f"save_state every {args.save_every}; growth measured after step {args.warmup} "
            f"(limit {args.max_growth}%). Load average before/after: "
            f"{load_before[0]:.1f} / {meta['loadavg_after'][0]:.1f} on {os.cpu_count()} CPUs."
            f"\n\n{table}\nresult: {'PASS' if ok else 'FAIL'}\n")
    common.save_text(out, "soak.md", text)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
