"""Outer steps of DiLoCo side by side over long runs: loss against bytes sent.

    python bench/bench_outer_study.py [--steps 2048] [--sync-every 8 32 64] [--seeds 0 1 2]
        [--tune-seed 100] [--methods ...] [--workers 4] [--smoke] [--out DIR]
    python bench/bench_outer_study.py summarize DIR

Four gloo workers (one process and one thread each, started once for the whole study) train a
small character-level MLP (the 8 previous characters, embedded in 16 dimensions, two hidden
layers of 128 GELU units, 47,234 parameters) on the chars demo's text (``demo/chars.py``: the
standard library's source, the last 10% of each file held out), each worker on its own share of
every global batch (32 windows per worker). Every run takes the same number of inner steps
(``--steps``), so every method does the same compute, and the loss is the validation loss of the
synced parameters (theta_bar for DiLoCo) on 8,192 fixed held-out windows, measured every
max(H) steps and at the end; the bytes are what each rank sent (DiLoCo's and DistributedLion's
own counts; the fp32 all-reduce by the ring formula 2 (n-1)/n * 4d per step).

Methods (``--methods``):

- adamw:           per-step AdamW on the fp32 gradient mean (all-reduce every step)
- dlion-step:      per-step D-Lion, ``DistributedLion(mode="vote")``
- nesterov:        ``DiLoCo(outer="nesterov")``, momentum 0.9
- sparseloco:      ``DiLoCo(outer="sparseloco")`` at its default settings (C = 4096, k = 64,
                   beta = 0.95)
- dlion:           ``DiLoCo(outer="dlion")``, the plain vote/binary outer step
- dlion-ef:        + error feedback (``DLionOuterOptions(error_feedback=True)``)
- dlion-scale:     + a per-tensor scale
- dlion-ef-scale:  + both
- dlion-ef-tern:   error feedback, ternary votes with threshold 0.5 (2 bits each way)
- dlion-ef-decay:  error feedback, the residual decayed by 0.9 per sync (``ef_decay=0.9``)
- dlion-ef-decay-0.5: the same, decayed by 0.5 (the decay picked on the held-out seed at H = 32)

DiLoCo runs use AdamW inner steps (lr 3e-3, weight decay 0.01) for every outer step. Tuning:
every method's lr (the outer lr for DiLoCo, the lr for the per-step methods) is picked per H
from the same number of trials (``LR_GRIDS``: 3 each) on a held-out seed (``--tune-seed``),
by the final validation loss; then every method runs at its picked lr on ``--seeds``. The
D-Lion steps' grids (a sign step moves every element by the lr) are multiples of the inner
lr * sqrt(H), the others fixed. Every run is a line of ``runs.jsonl`` in the output folder, as
it ends; a rerun with the same ``--out`` skips the runs already there (so an interrupted study
resumes). At the end (or with ``summarize DIR``): ``study.md`` (tuning table, final table),
``study.json``, ``loss_vs_bytes.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import common
import torch

WORKERS = 4
CONTEXT, EMBED, HIDDEN, BATCH = 8, 16, 128, 32
INNER_LR, WEIGHT_DECAY = 3e-3, 1e-2
EVAL_WINDOWS = 8192

PER_STEP = ("adamw", "dlion-step")
DLION_MULTIPLIERS = (0.5, 1.0, 2.0)  # x INNER_LR * sqrt(H)
LR_GRIDS = {  # 3 trials each, factors of about 2 apart
    "adamw": (2e-3, 4e-3, 8e-3),
    "dlion-step": (3e-4, 6e-4, 1.2e-3),
    "nesterov": (0.5, 0.7, 1.0),
    "sparseloco": (0.7, 1.4, 2.8),
    "dlion": None, "dlion-ef": None, "dlion-ef-tern": None,  # DLION_MULTIPLIERS
    "dlion-ef-decay": None, "dlion-ef-decay-0.5": None,
    "dlion-scale": (0.25, 0.5, 1.0),
    "dlion-ef-scale": (0.25, 0.5, 1.0),
}
DEFAULT_METHODS = ("adamw", "dlion-step", "nesterov", "sparseloco", "dlion", "dlion-ef",
                   "dlion-ef-scale")
METHODS = tuple(LR_GRIDS)
LABELS = {
    "adamw": "per-step AdamW (fp32 all-reduce)",
    "dlion-step": "per-step D-Lion (vote)",
    "nesterov": "DiLoCo-Nesterov (fp32)",
    "sparseloco": "SparseLoCo (top-k 1/64, 2-bit, EF)",
    "dlion": "DiLoCo-D-Lion, plain",
    "dlion-ef": "DiLoCo-D-Lion + EF",
    "dlion-scale": "DiLoCo-D-Lion + scale",
    "dlion-ef-scale": "DiLoCo-D-Lion + EF + scale",
    "dlion-ef-tern": "DiLoCo-D-Lion + EF, ternary tau 0.5",
    "dlion-ef-decay": "DiLoCo-D-Lion + EF decayed by 0.9 per sync",
    "dlion-ef-decay-0.5": "DiLoCo-D-Lion + EF decayed by 0.5 per sync",
}
OPTIONS = {
    "dlion-ef": dict(error_feedback=True),
    "dlion-scale": dict(scale=True),
    "dlion-ef-scale": dict(error_feedback=True, scale=True),
    "dlion-ef-tern": dict(error_feedback=True, threshold=0.5),
    "dlion-ef-decay": dict(error_feedback=True, ef_decay=0.9),
    "dlion-ef-decay-0.5": dict(error_feedback=True, ef_decay=0.5),
}


def lr_grid(method: str, H: int, smoke: bool) -> tuple:
    grid = LR_GRIDS[method]
    if grid is None:
        base = INNER_LR * math.sqrt(H)
        grid = tuple(float(f"{m * base:.3g}") for m in DLION_MULTIPLIERS)
    return grid[:2] if smoke else grid


# ----------------------------------------------------------------------------- model and data


class CharMLP(torch.nn.Module):
    """Next character from the CONTEXT previous ones: embeddings, concatenated, two hidden
    layers."""

    def __init__(self, vocab: int):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, EMBED)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(CONTEXT * EMBED, HIDDEN), torch.nn.GELU(),
            torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, vocab))

    def forward(self, x):
        return self.net(self.emb(x).flatten(1))


def windows(ids: torch.Tensor, starts: torch.Tensor):
    w = ids[starts[:, None] + torch.arange(CONTEXT + 1)].long()
    return w[:, :-1], w[:, -1]


def make_model(seed: int):
    from dlion_kernels.demo import chars

    torch.manual_seed(seed)
    return CharMLP(chars.VOCAB)


def numel_of_model() -> int:
    return sum(p.numel() for p in make_model(0).parameters())


# ----------------------------------------------------------------------------- one run


def _build(method, model, H, lr, n):
    """(optimizer, before_step(), after_step(), bytes sent so far (), the DiLoCo or None)."""
    import torch.distributed as dist

    import dlion_kernels as dk
    from dlion_kernels.accounting import ring_all_reduce_bytes

    params = list(model.parameters())
    if method == "adamw":
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=WEIGHT_DECAY)
        per_step = round(ring_all_reduce_bytes(n, 4 * sum(p.numel() for p in params)))
        sent = [0]

        def before_step():  # the gradient mean, one fp32 all-reduce of the flat gradients
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            if n > 1:
                dist.all_reduce(flat)
            flat /= n
            parts = flat.split([p.numel() for p in params])
            torch._foreach_copy_([p.grad for p in params],
                                 [f.view_as(p) for f, p in zip(parts, params)])
            sent[0] += per_step
        return opt, before_step, lambda: None, lambda: sent[0], None
    if method == "dlion-step":
        opt = dk.DistributedLion(params, lr=lr, weight_decay=WEIGHT_DECAY, mode="vote")
        sent = [0]

        def after():
            sent[0] += opt.last_stats.bytes_sent
        return opt, lambda: None, after, lambda: sent[0], None
    inner = torch.optim.AdamW(params, lr=INNER_LR, weight_decay=WEIGHT_DECAY)
    if method == "nesterov":
        diloco = dk.DiLoCo(model, inner, H, "nesterov", outer_lr=lr, outer_momentum=0.9)
    elif method == "sparseloco":
        diloco = dk.DiLoCo(model, inner, H, "sparseloco", outer_lr=lr)
    else:
        opts = OPTIONS.get(method)
        votes = "ternary" if opts and opts.get("threshold") else "binary"
        diloco = dk.DiLoCo(model, inner, H, "dlion", outer_lr=lr, mode="vote", votes=votes,
                           outer_options=opts)
    return inner, lambda: None, diloco.step, lambda: diloco.bytes_sent, diloco


def run_one(rank, n, cfg, data, steps, eval_every):
    """One run on this rank (collective); rank 0's dict of results (others: the same keys with
    the curve empty)."""
    import torch.distributed as dist

    from dlion_kernels.demo.common import same_on_all_ranks
    from dlion_kernels.exchange.pipeline import NonFiniteGradientError

    train, val = data
    method, H, lr, seed = cfg["method"], cfg["H"], cfg["lr"], cfg["seed"]
    model = make_model(seed)
    opt, before_step, after_step, sent, diloco = _build(method, model, H, lr, n)
    gen = torch.Generator().manual_seed(1_000_003 * seed + 17)
    starts = torch.randint(0, len(train) - CONTEXT - 1, (steps, n * BATCH), generator=gen)
    mine = train[starts[:, rank * BATCH:(rank + 1) * BATCH, None]
                 + torch.arange(CONTEXT + 1)].long()  # this rank's windows, every step
    evals = torch.linspace(0, len(val) - CONTEXT - 2, EVAL_WINDOWS).round().long()
    vx, vy = windows(val, evals)
    curve, times, diverged = [], [], False
    start = time.perf_counter()
    for it in range(steps):
        tic = time.perf_counter()
        x, y = mine[it, :, :-1], mine[it, :, -1]
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        before_step()
        opt.step()
        try:
            after_step()
        except NonFiniteGradientError:  # raised on every rank alike (the step header agrees)
            diverged = True
            break
        times.append(time.perf_counter() - tic)
        if (it + 1) % eval_every == 0 and rank == 0:
            with torch.no_grad():
                v = torch.nn.functional.cross_entropy(model(vx), vy).item()
            curve.append((it + 1, sent(), v))
    wall = time.perf_counter() - start
    ok = torch.tensor([0.0 if diverged else 1.0])
    if n > 1:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    diverged = ok.item() == 0.0
    final = float("inf")
    if not diverged and rank == 0:
        with torch.no_grad():
            final = torch.nn.functional.cross_entropy(model(vx), vy).item()
    if not math.isfinite(final) and rank == 0:
        diverged = True
    agree = True if diverged else same_on_all_ranks(model, n)
    result = torch.tensor([final if math.isfinite(final) else float("inf")], dtype=torch.float64)
    if n > 1:
        dist.broadcast(result, 0)  # every rank decides the tuning alike
    syncs = steps // H if diloco is not None else steps
    # inner steps without a sync (DiLoCo) or every step: the compute step, median
    plain = [t for i, t in enumerate(times) if diloco is None or (i + 1) % H]
    return dict(cfg, val_loss=result.item(), diverged=diverged, bytes_total=sent(),
                bytes_per_sync=sent() / syncs if not diverged else None, syncs=syncs,
                steps=steps, curve=curve, wall_s=wall, ranks_agree=agree,
                step_ms_median=1e3 * statistics.median(plain) if plain else None,
                step_ms_all_mean=1e3 * sum(times) / max(1, len(times)))


def _key(cfg) -> tuple:
    return (cfg["phase"], cfg["method"], cfg["H"], repr(cfg["lr"]), cfg["seed"])


def _worker(rank, n, args, done_lines):
    """Every run of the study on this rank; rank 0 appends each result to runs.jsonl."""
    from dlion_kernels.demo import chars

    data = chars.load_text()
    results = [json.loads(line) for line in done_lines]
    done = {_key(r): r for r in results}
    path = os.path.join(args.out, "runs.jsonl")
    eval_every = max(args.sync_every)

    def run(cfg):
        if _key(cfg) in done:
            return done[_key(cfg)]
        r = run_one(rank, n, cfg, data, args.steps, eval_every)
        done[_key(r)] = r
        if rank == 0:
            with open(path, "a") as f:
                f.write(json.dumps(r) + "\n")
            print(f"[{time.strftime('%H:%M:%S')}] {r['phase']} {r['method']} H={r['H']} "
                  f"lr={r['lr']:g} seed={r['seed']}: val {r['val_loss']:.4f} "
                  f"({r['wall_s']:.1f} s)", flush=True)
        return r

    for method, H in plan_of(args):  # tuning on the held-out seed, then the seeds at its best lr
        for lr in lr_grid(method, H, args.smoke):
            run(dict(phase="tune", method=method, H=H, lr=lr, seed=args.tune_seed))
        lr = best_lr([r for r in done.values() if r["phase"] == "tune"
                      and r["method"] == method and r["H"] == H])
        for seed in args.seeds:
            run(dict(phase="eval", method=method, H=H, lr=lr, seed=seed))
    return None


def plan_of(args) -> list:
    """(method, H) pairs, in the order they run: the DiLoCo methods at the largest H, the
    per-step methods (once, H 0), then the DiLoCo methods at the other H, largest first (an
    interrupted study has its longest-H comparison and references first)."""
    Hs = sorted(args.sync_every, reverse=True)
    local = [m for m in args.methods if m not in PER_STEP]
    out = [(m, Hs[0]) for m in local] + [(m, 0) for m in args.methods if m in PER_STEP]
    for H in sorted(Hs[1:]):
        out += [(m, H) for m in local]
    return out


def best_lr(trials: list):
    ok = [t for t in trials if math.isfinite(t["val_loss"])]
    if not ok:
        return min(t["lr"] for t in trials)
    return min(ok, key=lambda t: t["val_loss"])["lr"]


# ----------------------------------------------------------------------------- summary


def summarize(out_dir: str, meta: dict | None = None) -> str:
    runs = []
    for name in sorted(os.listdir(out_dir)):  # runs.jsonl, and runs-*.jsonl of other launches
        if name.startswith("runs") and name.endswith(".jsonl"):
            with open(os.path.join(out_dir, name)) as f:
                runs += [json.loads(line) for line in f if line.strip()]
    tune = [r for r in runs if r["phase"] == "tune"]
    ev = [r for r in runs if r["phase"] == "eval"]
    Hs = sorted({r["H"] for r in ev if r["H"]})
    methods = [m for m in METHODS if any(r["method"] == m for r in ev)]
    rows = []
    for H in [0] + Hs:
        for m in methods:
            rs = [r for r in ev if r["method"] == m and r["H"] == H]
            if not rs:
                continue
            losses = [r["val_loss"] for r in rs]
            finite = all(math.isfinite(v) for v in losses)
            rows.append(dict(
                method=m, label=LABELS[m], H=H or None, lr=rs[0]["lr"], seeds=len(rs),
                loss_mean=statistics.fmean(losses) if finite else float("inf"),
                loss_std=statistics.stdev(losses) if finite and len(rs) > 1 else 0.0,
                bytes_per_sync=rs[0]["bytes_per_sync"], syncs=rs[0]["syncs"],
                bytes_total=rs[0]["bytes_total"], ranks_agree=all(r["ranks_agree"] for r in rs),
                step_ms=statistics.median([r["step_ms_median"] for r in rs
                                           if r["step_ms_median"]] or [float("nan")]),
                losses=losses))
    ref = {r["H"]: r for r in rows if r["method"] == "nesterov"}
    for r in rows:
        nes = ref.get(r["H"])
        if nes and math.isfinite(r["loss_mean"]):
            r["vs_nesterov_pct"] = 100 * (r["loss_mean"] / nes["loss_mean"] - 1)
            r["bytes_vs_nesterov"] = (r["bytes_total"] / nes["bytes_total"]
                                      if nes["bytes_total"] else None)
    lines = ["# Outer steps over long runs: loss against bytes", ""]
    if meta:
        lines += [f"Command: `{meta.get('command', '')}`", ""]
    steps = ev[0]["steps"] if ev else 0
    workers = (meta or {}).get("workers", WORKERS)
    lines += [f"{steps} inner steps per run, {workers} workers; validation loss of the synced "
              f"parameters after the last step, mean (std) over {rows[0]['seeds'] if rows else 0} "
              "seeds at the lr picked on the held-out seed; bytes sent per rank.", "",
              "| H | method | lr | val loss | vs Nesterov | bytes / sync | bytes / rank, run | "
              "vs Nesterov bytes | compute step (ms) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        vs, bv, bps = r.get("vs_nesterov_pct"), r.get("bytes_vs_nesterov"), r["bytes_per_sync"]
        vs_text = "-" if vs is None else f"{vs:+.2f}%"
        bps_text = "-" if bps is None else f"{bps:,.0f}"
        bv_text = "-" if not bv else f"1/{1 / bv:.1f}"
        lines.append(
            f"| {r['H'] or 'every step'} | {r['label']} | {r['lr']:g} | "
            f"{r['loss_mean']:.4f} ({r['loss_std']:.4f}) | {vs_text} | {bps_text} | "
            f"{r['bytes_total']:,} | {bv_text} | {r['step_ms']:.2f} |")
    lines += ["", "## Tuning (held-out seed, final validation loss per lr)", "",
              "| H | method | lr: loss |", "|---|---|---|"]
    for H in [0] + Hs:
        for m in methods:
            ts = sorted((t for t in tune if t["method"] == m and t["H"] == H),
                        key=lambda t: t["lr"])
            if ts:
                cells = ", ".join(f"{t['lr']:g}: {t['val_loss']:.4f}" for t in ts)
                lines.append(f"| {H or 'every step'} | {LABELS[m]} | {cells} |")
    lines += time_to_target(rows, ev)
    text = "\n".join(lines) + "\n"
    common.save_text(out_dir, "study.md", text)
    with open(os.path.join(out_dir, "study.json"), "w") as f:
        json.dump(dict(metadata=meta or {}, rows=rows), f, indent=1)
    _plot(out_dir, ev, Hs, methods)
    return text


LINK_RATES = (("1 Gbit/s", 1e9), ("100 Mbit/s", 1e8), ("10 Mbit/s", 1e7))
# a loss most methods reach in the study's runs (chosen after seeing them: plain D-Lion and
# D-Lion + EF + scale end above it), so that their times to one target can be compared
COMMON_TARGET = 1.65


def _mean_curve(ev, method, H):
    """[(step, bytes sent per rank, mean validation loss over the seeds)] of the runs."""
    rs = [r for r in ev if r["method"] == method and r["H"] == H and r["curve"]
          and not r["diverged"]]
    if not rs:
        return []
    points = min(len(r["curve"]) for r in rs)
    return [(rs[0]["curve"][i][0], rs[0]["curve"][i][1],
             statistics.fmean(r["curve"][i][2] for r in rs)) for i in range(points)]


def time_to_target(rows, ev) -> list:
    """Markdown lines: the COMPUTED time each method takes to reach a target loss at a link
    rate, from its mean curve: steps x the measured compute step + bytes sent / link rate (no
    latency, no overlap), at the first curve point at or below the target."""
    adamw = next((r for r in rows if r["method"] == "adamw"), None)
    compute = [r["step_ms"] for r in rows if r["H"] and math.isfinite(r["step_ms"])]
    if adamw is None or not compute:
        return []
    t_c = statistics.median(compute) / 1e3
    out = ["", "## Time to target over link rates (computed, not measured)", "",
           f"Time = steps x {1e3 * t_c:.2f} ms (the median compute step of the DiLoCo runs "
           "on this machine, the same model for every method) + bytes sent per rank / link "
           "rate (no latency, no overlap), at the first validation point (every max(H) steps) "
           "whose mean over the seeds reaches the target: per-step AdamW's final loss "
           f"({adamw['loss_mean']:.4f}), a common {COMMON_TARGET}, and, per H, "
           "DiLoCo-Nesterov's final loss. '-': not reached in the run.", "",
           "| H | method | target | steps | " + " | ".join(n for n, _ in LINK_RATES) + " |",
           "|---|---|---|---|" + "---|" * len(LINK_RATES)]
    for r in rows:
        curve = _mean_curve(ev, r["method"], r["H"] or 0)
        targets = [("AdamW", adamw["loss_mean"]), (f"{COMMON_TARGET}", COMMON_TARGET)]
        nes = next((x for x in rows if x["method"] == "nesterov" and x["H"] == r["H"]), None)
        if nes is not None:
            targets.append(("Nesterov", nes["loss_mean"]))
        for tname, target in targets:
            hit = next((p for p in curve if p[2] <= target), None)
            cells = ["-"] * len(LINK_RATES) if hit is None else [
                f"{hit[0] * t_c + 8 * hit[1] / rate:.1f} s" for _, rate in LINK_RATES]
            out.append(f"| {r['H'] or 'every step'} | {r['label']} | {tname} | "
                       f"{'-' if hit is None else hit[0]} | " + " | ".join(cells) + " |")
    return out


def _plot(out_dir, ev, Hs, methods):
    plt = common.pyplot()
    if plt is None or not Hs:  # no DiLoCo run: nothing to set the per-step ones against
        return
    fig, axes = plt.subplots(1, len(Hs), figsize=(5 * len(Hs), 4.2), squeeze=False,
                             sharey=True)
    for ax, H in zip(axes[0], Hs):
        for m in methods:
            rs = [r for r in ev if r["method"] == m and r["H"] in (H, 0) and r["curve"]
                  and not r["diverged"]]
            rs = [r for r in rs if r["H"] == (0 if m in PER_STEP else H)]
            if not rs:
                continue
            points = min(len(r["curve"]) for r in rs)
            xs = [rs[0]["curve"][i][1] for i in range(points)]
            ys = [statistics.fmean(r["curve"][i][2] for r in rs) for i in range(points)]
            style = "--" if m in PER_STEP else "-"
            ax.plot(xs, ys, style, marker="." if m not in PER_STEP else None, label=LABELS[m])
        ax.set(xscale="log", xlabel="bytes sent per rank", title=f"H = {H}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("validation loss (mean over seeds)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "loss_vs_bytes.png"), dpi=110)


# ----------------------------------------------------------------------------- main


def parse_args(argv=None):
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["summarize"]:
        if len(argv) != 2:
            raise SystemExit("usage: bench_outer_study.py summarize DIR")
        return argparse.Namespace(summarize=argv[1])
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2048)
    ap.add_argument("--sync-every", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--tune-seed", type=int, default=100)
    ap.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=METHODS)
    ap.add_argument("--workers", type=int, default=WORKERS)
    ap.add_argument("--smoke", action="store_true",
                    help="2 workers, 16 steps, H 8, 2 lrs, 1 seed, every method: runs every "
                    "path fast")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.summarize = None
    if args.smoke:
        args.workers, args.steps, args.sync_every, args.seeds = 2, 16, [8], [0]
        args.methods = list(METHODS)
    if args.workers < 2 or args.steps < 1 or any(h < 1 for h in args.sync_every):
        ap.error("--workers must be >= 2, --steps and --sync-every >= 1")
    if args.steps % max(args.sync_every) or args.tune_seed in args.seeds:
        ap.error("--steps must be a multiple of every --sync-every, and --tune-seed not one of "
                 "--seeds (it is held out)")
    if any(args.steps % h for h in args.sync_every):
        ap.error("--steps must be a multiple of every --sync-every")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.summarize:
        meta_path = os.path.join(args.summarize, "meta.json")
        meta = json.load(open(meta_path)) if os.path.exists(meta_path) else None
        print(summarize(args.summarize, meta))
        return
    args.out = common.results_dir("outer-study", args.out)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "runs.jsonl")
    done = open(path).read().splitlines() if os.path.exists(path) else []
    meta = common.metadata(dict(workers=args.workers, steps=args.steps, numel=numel_of_model()))
    with open(os.path.join(args.out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(f"outer study: {len(plan_of(args))} (method, H) pairs, {args.workers} workers, "
          f"{args.steps} steps, {meta['numel']:,} parameters -> {args.out}", flush=True)
    common.run_ranks(args.workers, _worker, args, [d for d in done if d.strip()],
                     timeout=None, threads=1)
    print(summarize(args.out, meta))


if __name__ == "__main__":
    main()
