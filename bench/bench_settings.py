"""Which lr and weight decay D-Lion needs, coming from AdamW or from Lion; vote or average, binary
or ternary votes. The evidence behind ``docs/settings.md``.

    nice -n 19 python bench/bench_settings.py --task digits --out DIR
    nice -n 19 python bench/bench_settings.py --task chars --out DIR
    python bench/bench_settings.py --smoke --out DIR          # every phase on tiny sizes

The two demo tasks (``python -m dlion_kernels.demo``: the digits MLP, 20 epochs; ``--task chars``:
the character-level transformer, 120 iterations), 4 gloo workers, each on its own share of every
batch, the demo's model, data and batch sizes. Every run starts from the same weights per seed.

1. **Tune** on one seed (``--tune-seed``, 0): AdamW over an lr grid, weight decay ``--adamw-wd``;
   its best lr is lr_A. Then Lion (fp32 gradient all-reduce) and D-Lion, each with
   ``lr = lr_A / r`` and ``weight_decay = adamw_wd * r`` (lr x wd kept), for r in ``--ratios``:
   D-Lion vote/binary, average/binary and vote/ternary. D-Lion vote/binary at the best r once
   more with the weight decay not scaled (``adamw_wd``) and with none.
2. **Check** on other seeds (``--check-seeds``, 1 2): AdamW at lr_A, and each of the four others
   at its best r and the two next to it.

Scores: the digits' test cross entropy (and accuracy), the chars task's validation loss (the
demo's 64 fixed windows). Writes ``runs.jsonl`` (one line per run, appended as each ends, so an
interrupted sweep keeps its runs), ``meta.json`` (machine, versions, date, command) and
``summary.json`` (per optimizer: the best r on the tuned seed, the ratios within ``--within`` of
the best loss there, and the check seeds' losses); ``bench/docs_tables.py`` renders the tables of
``docs/settings.md`` from them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import metadata, results_dir, run_ranks  # noqa: E402

BETAS_ADAMW = (0.9, 0.999)
BETAS_LION = (0.9, 0.99)
# the optimizers compared at each ratio r: (key, label, mode, votes); mode None: Lion on the
# fp32 all-reduced gradient
LION_FAMILY = [
    ("lion", "Lion + fp32 all-reduce", None, None),
    ("dlion-vote", "D-Lion vote, binary", "vote", "binary"),
    ("dlion-average", "D-Lion average, binary", "average", "binary"),
    ("dlion-vote-ternary", "D-Lion vote, ternary", "vote", "ternary"),
]
LABELS = {"adamw": "AdamW + fp32 all-reduce", **{k: lab for k, lab, _, _ in LION_FAMILY}}


# ----------------------------------------------------------------------------- one run


def _optimizer(cfg, model):
    import torch

    import dlion_kernels as dk

    params = [p for p in model.parameters() if p.requires_grad]
    if cfg["opt"] == "adamw":
        return torch.optim.AdamW(params, lr=cfg["lr"], betas=BETAS_ADAMW,
                                 weight_decay=cfg["wd"]), True
    if cfg["opt"] == "lion":
        return _Lion(params, cfg["lr"], cfg["wd"]), True
    mode, votes = next((m, v) for k, _, m, v in LION_FAMILY if k == cfg["opt"])
    return dk.DistributedLion(params, lr=cfg["lr"], betas=BETAS_LION, weight_decay=cfg["wd"],
                              mode=mode, votes=votes), False


class _Lion:
    """Lion (Chen et al.) on the gradient every rank holds: c = b1 m + (1 - b1) g,
    x = x - lr (sign(c) + wd x), m = b2 m + (1 - b2) g."""

    def __init__(self, params, lr, wd):
        import torch

        self.params, self.lr, self.wd = params, lr, wd
        self.m = [torch.zeros_like(p) for p in params]

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def step(self):
        import torch

        b1, b2 = BETAS_LION
        with torch.no_grad():
            for p, m in zip(self.params, self.m):
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                c = m * b1 + g * (1 - b1)
                p.mul_(1 - self.lr * self.wd).add_(torch.sign(c), alpha=-self.lr)
                m.mul_(b2).add_(g, alpha=1 - b2)


def _mean_gradients(model, n):
    """The fp32 all-reduce of the baselines: one flat buffer, summed, divided by n."""
    import torch
    import torch.distributed as dist

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= n
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def _train_digits(cfg, rank, n, sizes):
    import torch
    import torch.nn.functional as F

    from dlion_kernels.demo.digits import load_digits, make_model

    (x_train, y_train), (x_test, y_test) = load_digits(cfg["seed"])
    model = make_model(sizes.hidden, cfg["seed"])
    opt, allreduce = _optimizer(cfg, model)
    for epoch in range(sizes.epochs):
        perm = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch))
        mine = perm[rank::n]
        for i in range(0, len(mine) - sizes.batch + 1, sizes.batch):
            idx = mine[i:i + sizes.batch]
            opt.zero_grad()
            F.cross_entropy(model(x_train[idx]), y_train[idx]).backward()
            if allreduce:
                _mean_gradients(model, n)
            opt.step()
    with torch.no_grad():
        logits = model(x_test)
        return {"loss": F.cross_entropy(logits, y_test).item(),
                "accuracy": (logits.argmax(1) == y_test).float().mean().item()}


def _train_chars(cfg, rank, n, sizes):
    import torch

    from dlion_kernels.demo import chars

    train, val = chars.load_text()
    shape = SimpleNamespace(d_model=64, heads=4, layers=2, context=sizes.context)
    model = chars.make_model(shape, cfg["seed"])
    opt, allreduce = _optimizer(cfg, model)
    for it in range(sizes.iters):
        starts = chars.train_starts(len(train), cfg["seed"], it, rank, n, sizes.batch,
                                    shape.context)
        x, y = chars.batch(train, starts, shape.context)
        opt.zero_grad()
        chars._loss(model(x), y).backward()
        if allreduce:
            _mean_gradients(model, n)
        opt.step()
    evals = chars.val_starts(len(val), 64, shape.context)
    return {"loss": chars.val_loss(model, val, evals, shape.context, torch.device("cpu"))}


def _worker(rank, n, task, configs, sizes, path):
    """Every config in turn on this rank; rank 0 appends each run's line to ``path``."""
    import torch.distributed as dist

    train = _train_digits if task == "digits" else _train_chars
    for cfg in configs:
        dist.barrier()
        start = time.perf_counter()
        score = train(cfg, rank, n, sizes)
        if rank == 0:
            line = {**cfg, "task": task, "workers": n, **score,
                    "wall_s": round(time.perf_counter() - start, 2)}
            with open(path, "a") as f:
                f.write(json.dumps(line) + "\n")
            print(f"  {cfg['phase']} seed {cfg['seed']} {cfg['opt']:<18} lr {cfg['lr']:.3g} "
                  f"wd {cfg['wd']:.3g}: loss {score['loss']:.4f}", flush=True)
    return None


# ----------------------------------------------------------------------------- the sweep


def _cfg(phase, seed, opt, lr, wd, r=None, variant="scaled"):
    return {"phase": phase, "seed": seed, "opt": opt, "lr": lr, "wd": wd, "r": r,
            "variant": variant}


def read_runs(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def best_of(runs, **match):
    rows = [r for r in runs if all(r.get(k) == v for k, v in match.items())]
    return min(rows, key=lambda r: r["loss"]) if rows else None


def neighbours(value, grid):
    i = grid.index(value)
    return grid[max(0, i - 1):i + 2]


def summarize(runs, args) -> dict:
    """The chosen values, the working ranges and the check seeds' losses, per optimizer."""
    tune = [r for r in runs if r["phase"] == "tune"]
    adamw = best_of(tune, opt="adamw")
    out = {"task": args.task, "tune_seed": args.tune_seed, "check_seeds": args.check_seeds,
           "within": args.within, "adamw_wd": args.adamw_wd, "adamw_best_lr": adamw["lr"],
           "adamw_tune_loss": adamw["loss"], "optimizers": {}}
    check = [r for r in runs if r["phase"] == "check"]
    a_check = [r["loss"] for r in check if r["opt"] == "adamw"]
    out["adamw_check_loss"] = statistics.mean(a_check) if a_check else None
    lr_a = adamw["lr"]

    def on_grid(r):  # runs at lr = lr_a / r (an earlier AdamW grid may have had another best)
        return r["r"] is not None and math.isclose(r["lr"], lr_a / r["r"], rel_tol=1e-6)

    tune = [r for r in tune if r["opt"] == "adamw" or on_grid(r)]
    check = [r for r in check if r["opt"] == "adamw" and r["lr"] == lr_a or
             r["opt"] != "adamw" and on_grid(r)]
    a_check = [r["loss"] for r in check if r["opt"] == "adamw"]
    out["adamw_check_loss"] = statistics.mean(a_check) if a_check else None
    for key, label, _, _ in LION_FAMILY:
        rows = sorted((r for r in tune if r["opt"] == key and r["variant"] == "scaled"),
                      key=lambda r: r["r"])
        if not rows:
            continue
        best = min(rows, key=lambda r: r["loss"])
        ok = [r["r"] for r in rows if r["loss"] <= best["loss"] * (1 + args.within)]
        per_r = {}
        for r in sorted({c["r"] for c in check if c["opt"] == key}):
            losses = [c["loss"] for c in check if c["opt"] == key and c["r"] == r]
            per_r[str(r)] = statistics.mean(losses)
        check_best = min(per_r, key=per_r.get) if per_r else None
        out["optimizers"][key] = {
            "label": label, "best_r": best["r"], "best_lr": best["lr"], "best_wd": best["wd"],
            "tune_loss": best["loss"], "within_r": [min(ok), max(ok)],
            "tune": {str(r["r"]): r["loss"] for r in rows},
            "check_mean_by_r": per_r, "check_best_r": None if check_best is None
            else float(check_best)}
    extra = [r for r in tune if r["variant"] != "scaled"]
    out["weight_decay_variants"] = {r["variant"]: r["loss"] for r in extra}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=("digits", "chars"), default="digits")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--tune-seed", type=int, default=0)
    ap.add_argument("--check-seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--adamw-lrs", type=float, nargs="+", default=None,
                    help="AdamW's lr grid (digits: 1e-3 3e-3 1e-2 3e-2; chars: 1e-3 3e-3 1e-2)")
    ap.add_argument("--adamw-wd", type=float, default=0.01)
    ap.add_argument("--ratios", type=float, nargs="+", default=[1, 3, 10, 30, 100],
                    help="r: Lion and D-Lion at lr = AdamW's best / r, weight decay x r")
    ap.add_argument("--within", type=float, default=0.02,
                    help="a ratio 'works' when its loss is within this fraction of the best")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, 2 workers, 2 ratios")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.adamw_lrs is None:
        args.adamw_lrs = [1e-3, 3e-3, 1e-2, 3e-2] if args.task == "digits" else \
            [1e-3, 3e-3, 1e-2]
    if args.smoke:
        args.workers, args.ratios, args.adamw_lrs = 2, [1, 10], [3e-3, 1e-2]
        args.check_seeds = args.check_seeds[:1]
        sizes = SimpleNamespace(epochs=1, batch=64, hidden=32, iters=3, context=16)
    else:
        sizes = SimpleNamespace(epochs=20, batch=16, hidden=256, iters=120, context=64)
        if args.task == "chars":
            sizes.batch = 8
    out = results_dir(f"settings-{args.task}", args.out)
    path = os.path.join(out, "runs.jsonl")
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(metadata({"task": args.task, "sizes": vars(sizes), "args": vars(args)}), f,
                  indent=2)
    done = read_runs(path) if os.path.exists(path) else []

    def run(configs):
        todo = [c for c in configs if not any(
            all(d.get(k) == v for k, v in c.items()) for d in done)]
        if todo:
            run_ranks(args.workers, _worker, args.task, todo, sizes, path, timeout=None)
        return read_runs(path)

    wd0, s = args.adamw_wd, args.tune_seed
    runs = run([_cfg("tune", s, "adamw", lr, wd0) for lr in args.adamw_lrs])
    lr_a = best_of(runs, phase="tune", opt="adamw")["lr"]
    print(f"AdamW's best lr on seed {s}: {lr_a:g}", flush=True)
    runs = run([_cfg("tune", s, key, lr_a / r, wd0 * r, r) for r in args.ratios
                for key, *_ in LION_FAMILY])
    best_v = min((r for r in runs if r["phase"] == "tune" and r["opt"] == "dlion-vote" and
                  r["variant"] == "scaled" and r["r"] in args.ratios and
                  math.isclose(r["lr"], lr_a / r["r"], rel_tol=1e-6)), key=lambda r: r["loss"])
    runs = run([_cfg("tune", s, "dlion-vote", best_v["lr"], wd0, best_v["r"], "wd-unscaled"),
                _cfg("tune", s, "dlion-vote", best_v["lr"], 0.0, best_v["r"], "wd-zero")])
    checks = []
    for seed in args.check_seeds:
        checks.append(_cfg("check", seed, "adamw", lr_a, wd0))
        for key, *_ in LION_FAMILY:
            best = min((r for r in runs if r["phase"] == "tune" and r["opt"] == key and
                        r["variant"] == "scaled" and r["r"] in args.ratios and
                        math.isclose(r["lr"], lr_a / r["r"], rel_tol=1e-6)),
                       key=lambda r: r["loss"])
            for r in neighbours(best["r"], sorted(args.ratios)):
                checks.append(_cfg("check", seed, key, lr_a / r, wd0 * r, r))
    runs = run(checks)
    summary = summarize(runs, args)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps({k: (v["best_r"], v["within_r"]) for k, v in
                      summary["optimizers"].items()}), flush=True)
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
