"""Scaling studies of D-Lion on k simulated workers (``dlion_kernels/simulate.py``): the vote at
4 to 64 workers, DiLoCo's outer steps at long and short H, the budget, and the default outer lr.

    python bench/bench_sim_study.py sweep     [--out DIR] [--smoke]
    python bench/bench_sim_study.py per-step  [--tasks chars stdlib] [--workers 4 16 64]
    python bench/bench_sim_study.py local     [--tasks chars stdlib] [--workers 4 16 64]
                                              [--sync-every 8 64] [--dlion METHOD]
    python bench/bench_sim_study.py budgets   [--workers 4 16 64] [--sync-every 8 64]
                                              [--dlion METHOD]
    python bench/bench_sim_study.py summarize DIR [--inputs DIR1 DIR2 ...]

Every run is one process, one thread, the k workers simulated (``sim_runs.py``), on the tasks of
``sim_tasks.py`` (the outer study's character MLP, and a byte-level GPT on the standard library).
A run is a line of ``runs.jsonl`` in the output folder, keyed by (task, method, k, H, lr, seed,
steps): a rerun skips what is there, and the studies share runs (the sweep's k = 4 runs serve
the local-steps study, its full-budget runs the budgets study).

Tuning, the same for every method: lrs on a grid (``GRIDS``: factors of 2 around a centre; the
sweep: factors of sqrt 2), three to start, on the held-out seed (``--tune-seed``, 100, never
reported); while the best is at an edge of what ran, the next lr beyond it runs (at most
``MAX_EXTEND`` times). Then every reported seed (``--seeds``, 0 1 2) runs at the best lr.
The sweep runs every lr the held-out seed ran on the reported seeds too, so each setting's best
lr on them is known, and checks the default chosen on the held-out seed against it.

- ``sweep``: the default outer lr of ``DiLoCo(outer="dlion")``. The chars task at k = 4 (the
  outer study's settings), H in {8, 32, 64}, budgets of 512 and 2048 steps (a quarter of the
  outer study's and all of it), the candidate outer steps ``--candidates``. Picks, on the
  held-out seed, the candidate and the rule (one lr, or c x inner lr x H, or c x inner lr x
  sqrt H) whose worst loss over the six settings is least above the best of every candidate
  there, with c refined by factors of 2^(1/4) and 2^(1/8) on that seed; checks it on the
  reported seeds; the plain step's own best rule beside it. Writes ``sweep.md`` /
  ``sweep.json``.
- ``per-step``: AdamW and Lion on the mean gradient (k does not change their math; their bytes
  are the all-reduce's at each k), D-Lion vote/average x binary/ternary at each k.
- ``local``: DiLoCo-Nesterov, ``--dlion`` (the best 1-bit outer step) and SparseLoCo at each k
  and H.
- ``budgets``: the local study's methods on the chars task at a quarter of its budget, tuned
  at that budget, beside the full budget's runs.

``summarize`` (also run at the end of every study) writes ``study.md``, ``study.json`` and the
plots ``loss_vs_bytes-<study>-<task>.png`` (one panel per k, a line per method).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import common  # noqa: F401  (puts the repository on sys.path)
import torch

import sim_runs
import sim_tasks
from dlion_kernels.accounting import ring_all_reduce_bytes
from dlion_kernels.simulate import dlion_step_bytes

TUNE_SEED, SEEDS = 100, (0, 1, 2)
MAX_EXTEND = 3
START = (-1, 0, 1)  # the grid points tried first (multiples of the ratio around the centre)
SWEEP_CANDIDATES = ("dlion", "dlion-ef-decay-0.5", "dlion-ef-decay-0.7")
SWEEP_H = (8, 32, 64)
SWEEP_K = 4
REFINE = (0.25, 0.125)  # the sweep's rule: c refined by factors 2^(1/4), then 2^(1/8)
# grid centres (factors of 2 around them); D-Lion's outer steps: the sweep's rule (``--dlion-lr``)
CENTRES = {
    "chars": {"adamw": 2e-3, "lion": 6e-4, "dlion-vote-binary": 6e-4, "dlion-vote-ternary": 6e-4,
              "dlion-average-binary": 1.2e-3, "dlion-average-ternary": 1.2e-3,
              "nesterov": 0.5, "sparseloco": 2.8},
    "stdlib": {"adamw": 3e-3, "lion": 5e-4, "dlion-vote-binary": 5e-4,
               "dlion-vote-ternary": 5e-4, "dlion-average-binary": 1e-3,
               "dlion-average-ternary": 1e-3, "nesterov": 0.5, "sparseloco": 2.8},
    "stdlib-30m": {"adamw": 1e-3, "lion": 2e-4, "dlion-vote-binary": 2e-4,
                   "dlion-vote-ternary": 2e-4, "dlion-average-binary": 4e-4,
                   "dlion-average-ternary": 4e-4, "nesterov": 0.5, "sparseloco": 2.8},
}
LABELS = {
    "adamw": "AdamW, all-reduce", "lion": "Lion, all-reduce",
    "dlion-vote-binary": "D-Lion vote/binary", "dlion-vote-ternary": "D-Lion vote/ternary",
    "dlion-average-binary": "D-Lion average/binary",
    "dlion-average-ternary": "D-Lion average/ternary",
    "nesterov": "DiLoCo-Nesterov (fp32)", "sparseloco": "SparseLoCo (top 64/4096, 2-bit, EF)",
    "dlion": "DiLoCo-D-Lion, plain", "dlion-ef": "DiLoCo-D-Lion + EF",
}
K_FREE = ("adamw", "lion")  # their math does not depend on k: one run serves every k


def label(method: str) -> str:
    if method in LABELS:
        return LABELS[method]
    g = method.rsplit("-", 1)[-1]
    avg = " (average)" if method.startswith("dlion-avg") else ""
    return f"DiLoCo-D-Lion + EF, decay {g}{avg}"


# ----------------------------------------------------------------------------- the store


def key(cfg) -> tuple:
    return (cfg["task"], cfg["method"], cfg["k"], cfg["H"], repr(float(cfg["lr"])),
            cfg["seed"], cfg["steps"])


class Store:
    """runs.jsonl of the output folder: every run once."""

    def __init__(self, out: str, device: str):
        self.path = os.path.join(out, "runs.jsonl")
        self.device = device
        self.runs = {}
        if os.path.exists(self.path):
            with open(self.path) as f:
                for line in f:
                    if line.strip():
                        r = json.loads(line)
                        self.runs[key(r)] = r

    def get(self, cfg) -> dict:
        k = key(cfg)
        if k not in self.runs:
            r = sim_runs.run(cfg, self.device)
            self.runs[k] = r
            with open(self.path, "a") as f:
                f.write(json.dumps(r) + "\n")
            print(f"[{time.strftime('%H:%M:%S')}] {r['task']} {r['method']} k={r['k']} "
                  f"H={r['H']} lr={r['lr']:.4g} seed={r['seed']} steps={r['steps']}: val "
                  f"{r['val_loss']:.4f} ({r['wall_s']:.0f} s)", flush=True)
        return self.runs[k]


def eval_every(task: str, steps: int, H: int) -> int:
    every = 64 if task == "chars" else 32
    every = max(every, H)
    return every if steps % every == 0 else steps


def config(task, method, k, H, lr, seed, steps) -> dict:
    return dict(task=task, method=method, k=1 if method in K_FREE else k, H=H, lr=float(lr),
                seed=seed, steps=steps, eval_every=eval_every(task, steps, H))


def grid_lr(centre: float, j: int, ratio: float) -> float:
    return float(f"{centre * ratio ** j:.4g}")


def tune(store, task, method, k, H, steps, centre, ratio=2.0, seed=TUNE_SEED,
         need_neighbours=1, start=None):
    """The best lr on the held-out seed, and the trials {j: run}: lrs ``centre * ratio**j``,
    ``start`` first, then beyond the edge while the best has fewer than ``need_neighbours``
    tried neighbours on a side (at most ``MAX_EXTEND`` beyond the start on each side)."""
    trials = {}
    start = START if start is None else start

    def go(j):
        if j not in trials:
            trials[j] = store.get(config(task, method, k, H, grid_lr(centre, j, ratio), seed,
                                         steps))

    for j in start:
        go(j)
    lo, hi = min(start) - MAX_EXTEND, max(start) + MAX_EXTEND
    while True:
        best = min(trials, key=lambda j: trials[j]["val_loss"])
        below = [j for j in trials if j < best]
        above = [j for j in trials if j > best]
        if len(below) < need_neighbours and min(trials) - 1 >= lo:
            go(min(trials) - 1)
        elif len(above) < need_neighbours and max(trials) + 1 <= hi:
            go(max(trials) + 1)
        else:
            break
    best = min(trials, key=lambda j: trials[j]["val_loss"])
    return trials[best]["lr"], trials


def evaluate(store, task, method, k, H, steps, lr, seeds) -> list:
    return [store.get(config(task, method, k, H, lr, s, steps)) for s in seeds]


# ----------------------------------------------------------------------------- sweep


def dlion_centre(method: str, H: int, rule: dict | None) -> float:
    """Where a D-Lion outer step's grid starts: the sweep's rule, or a first guess."""
    if rule:
        return rule_lr(rule, H)
    if method == "dlion":
        return 3e-3 * math.sqrt(H) * 0.7
    return 0.017


def run_sweep(store, args):
    """Every candidate on the held-out seed (``tune``, sqrt 2 apart, two tried lrs on each side
    of the best); the candidate and rule chosen there (``sweep_choices``), its c refined by
    factors of 2^(1/4), then 2^(1/8) (``REFINE``); then, for the chosen candidate and the plain
    step, the reported seeds at each setting's best lr, its two neighbours and the rule's
    lr."""
    budgets = (args.steps // 4, args.steps)
    tuned = {}
    for method in args.candidates:
        for H in args.sync_every:
            for steps in budgets:
                tuned[method, H, steps] = tune(
                    store, "chars", method, args.k, H, steps, dlion_centre(method, H, None),
                    ratio=math.sqrt(2), need_neighbours=2)
    for step in REFINE:  # finer steps of c around the picks, on the held-out seed
        choices = sweep_choices(store, args)
        chosen = _ranked(choices, "all")[0]
        plain = next(iter(_ranked([c for c in choices if c["method"] == "dlion"], "own")),
                     None)
        for pick in [chosen] + ([plain] if plain else []):
            for f in (2 ** -step, 2 ** step):
                rule = dict(pick["rule"], c=pick["rule"]["c"] * f)
                for H in args.sync_every:
                    for steps in budgets:
                        store.get(config("chars", pick["method"], args.k, H,
                                         rule_lr(rule, H), args.tune_seed, steps))
    choices = sweep_choices(store, args)
    picks = [_ranked(choices, "all")[0]]
    plain = next(iter(_ranked([c for c in choices if c["method"] == "dlion"], "own")), None)
    if plain and plain["method"] != picks[0]["method"]:
        picks.append(plain)
    for pick in picks:
        for H in args.sync_every:
            for steps in budgets:
                best, trials = tuned[pick["method"], H, steps]
                j = next(j for j, t in trials.items() if t["lr"] == best)
                lrs = {trials[i]["lr"] for i in (j - 1, j, j + 1) if i in trials}
                lrs.add(rule_lr(pick["rule"], H))
                for lr in sorted(lrs):
                    evaluate(store, "chars", pick["method"], args.k, H, steps, lr, args.seeds)
    report = sweep_report(store, args)
    common.save_text(args.out, "sweep.md", report["text"])
    with open(os.path.join(args.out, "sweep.json"), "w") as f:
        json.dump({k: v for k, v in report.items() if k != "text"}, f, indent=1)
    print(report["text"])


def rule_lr(rule: dict, H: int) -> float:
    """The lr a rule gives at H: one number, or c x inner lr x H^power."""
    return float(f"{rule['c'] * sim_tasks.TASKS['chars'].inner_lr * H ** rule['power']:.4g}")


def _losses(store, method, k, H, steps, seeds) -> dict:
    """{lr: [loss per seed]} of the runs there are (every seed present)."""
    out = {}
    for r in store.runs.values():
        if (r["task"], r["method"], r["k"], r["H"], r["steps"]) == ("chars", method, k, H,
                                                                      steps) \
                and r["seed"] in seeds:
            out.setdefault(r["lr"], {})[r["seed"]] = r["val_loss"]
    return {lr: [v[s] for s in seeds] for lr, v in out.items() if all(s in v for s in seeds)}


RULES = ((0.0, "one lr"), (1.0, "c x inner lr x H"), (0.5, "c x inner lr x sqrt(H)"))


def _settings(args):
    budgets = (args.steps // 4, args.steps)
    return [(H, s) for H in args.sync_every for s in budgets]


def _at(losses: dict, lr: float):
    return next((v for x, v in losses.items() if math.isclose(x, lr, rel_tol=1e-3)), None)


def sweep_choices(store, args, seeds=None) -> list:
    """Every (candidate, rule) whose lr ran in every setting on ``seeds`` (default: the
    held-out seed; several: their mean): its excess over the candidate's own best lr in the
    worst setting (``own``) and over the best of every candidate there (``all``)."""
    seeds = (args.tune_seed,) if seeds is None else tuple(seeds)
    inner = sim_tasks.TASKS["chars"].inner_lr
    settings = _settings(args)
    table = {m: {st: {lr: statistics.fmean(v) for lr, v in _losses(
        store, m, args.k, *st, seeds).items()} for st in settings} for m in args.candidates}
    table = {m: t for m, t in table.items() if all(t.values())}
    best_all = {st: min(min(t[st].values()) for t in table.values()) for st in settings}
    out = []
    for m, t in table.items():
        for power, name in RULES:
            cs = sorted({round(lr / (inner * H ** power), 10) for (H, _), ls in t.items()
                         for lr in ls})
            for c in cs:
                rule = dict(c=c, power=power, name=name)
                own, every = [], []
                for st, ls in t.items():
                    v = _at(ls, rule_lr(rule, st[0]))
                    own.append(math.inf if v is None else v / min(ls.values()) - 1)
                    every.append(math.inf if v is None else v / best_all[st] - 1)
                if math.isfinite(max(own)):
                    out.append(dict(method=m, rule=rule, own=max(own), all=max(every)))
    return out


def _ranked(choices, by: str) -> list:
    other = "own" if by == "all" else "all"
    return sorted(choices, key=lambda c: (round(c[by], 4), c[other]))


def sweep_report(store, args) -> dict:
    settings = _settings(args)
    budgets = (args.steps // 4, args.steps)
    inner = sim_tasks.TASKS["chars"].inner_lr
    tune_choices = sweep_choices(store, args)
    chosen = _ranked(tune_choices, "all")[0] if tune_choices else None
    plain = next(iter(_ranked([c for c in tune_choices if c["method"] == "dlion"], "own")),
                 None)
    rows = []
    for method in args.candidates:
        for st in settings:
            tl = {lr: v[0] for lr, v in _losses(store, method, args.k, *st,
                                                 (args.tune_seed,)).items()}
            per_seed = _losses(store, method, args.k, *st, tuple(args.seeds))
            el = {lr: statistics.fmean(v) for lr, v in per_seed.items()}
            if not tl:
                continue
            row = dict(method=method, H=st[0], steps=st[1], best_tune=min(tl, key=tl.get),
                       best_tune_loss=min(tl.values()),
                       best_eval=min(el, key=el.get) if el else None,
                       best_eval_loss=min(el.values()) if el else None,
                       tune=tl, eval=el, per_seed=per_seed)
            pick = chosen if chosen and method == chosen["method"] else \
                plain if plain and method == "dlion" else None
            if pick is not None:
                lr = rule_lr(pick["rule"], st[0])
                row["rule_lr"] = lr
                hit = next((x for x in per_seed if math.isclose(x, lr, rel_tol=1e-3)), None)
                if hit is not None and el:
                    row["rule_loss"] = el[hit]
                    row["rule_excess"] = el[hit] / row["best_eval_loss"] - 1
                    row["rule_worst_seed"] = max(
                        v / min(ls[i] for ls in per_seed.values()) - 1
                        for i, v in enumerate(per_seed[hit]))
            rows.append(row)
    lines = ["# The default outer lr of DiLoCo(outer=\"dlion\"): the sweep", "",
             f"Chars task (the outer study's MLP and inner settings: AdamW lr {inner:g}, weight "
             f"decay 0.01, 128 windows per step), k = {args.k} simulated workers, H in "
             f"{list(args.sync_every)}, budgets of {budgets[0]} and {budgets[1]} steps "
             f"({budgets[0] * 128:,} and {budgets[1] * 128:,} predicted characters). Outer lrs "
             "sqrt 2 apart, two tried on each side of the best; the held-out seed "
             f"{args.tune_seed} picks the candidate and the rule; seeds {list(args.seeds)} "
             "check it.", ""]
    for title, pick in (("The default (candidate and rule)", chosen),
                        ("The plain step's rule", plain)):
        if pick is None:
            continue
        lines += [f"**{title}, chosen on the held-out seed:** `{pick['method']}` with outer_lr"
                  f" = {_rule_text(pick['rule'])}: on that seed, worst excess over the "
                  f"candidate's own best lr of a setting {100 * pick['own']:.2f}%, over the "
                  f"best of all candidates {100 * pick['all']:.2f}%.", ""]
        lines += ["| H | steps | best lr (held-out) | best lr (seeds' mean) | loss at best | "
                  "rule lr | loss at rule lr | excess (mean) | worst seed |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for row in rows:
            if row["method"] != pick["method"]:
                continue
            if "rule_excess" not in row:
                lines.append(f"| {row['H']} | {row['steps']} | {row['best_tune']:g} | - | - | "
                             f"{row.get('rule_lr', 0):g} | not run | - | - |")
                continue
            lines.append(f"| {row['H']} | {row['steps']} | {row['best_tune']:g} | "
                         f"{row['best_eval']:g} | {row['best_eval_loss']:.4f} | "
                         f"{row['rule_lr']:g} | {row['rule_loss']:.4f} | "
                         f"{100 * row['rule_excess']:+.2f}% | "
                         f"{100 * row['rule_worst_seed']:+.2f}% |")
        lines.append("")
    lines += ["Excess: the rule's loss (mean of the reported seeds) over the best lr's of that "
              "setting among those run on them; worst seed: the largest excess of one seed over "
              "that seed's own best.", "",
              "## Every candidate and rule on the held-out seed (best 25 by the worst excess "
              "over the best of all candidates)", "",
              "| candidate | rule | worst excess over its own best | over the best of all |",
              "|---|---|---|---|"]
    shown = set()
    for c in _ranked(tune_choices, "all"):
        tag = (c["method"], _rule_text(c["rule"]))
        if tag in shown or len(shown) == 25:
            continue
        shown.add(tag)
        lines.append(f"| {c['method']} | {_rule_text(c['rule'])} | {100 * c['own']:.2f}% | "
                     f"{100 * c['all']:.2f}% |")
    lines += ["", "## Loss against outer lr (held-out seed / mean of the reported seeds)", ""]
    for row in rows:
        cells = ", ".join(f"{lr:g}: {v:.4f}" + (f" / {row['eval'][lr]:.4f}" if lr in row["eval"]
                                                 else "")
                          for lr, v in sorted(row["tune"].items()))
        lines.append(f"- {row['method']}, H = {row['H']}, {row['steps']} steps: {cells}")
    return dict(text="\n".join(lines) + "\n", chosen=chosen, plain=plain, rows=rows,
                choices=_ranked(tune_choices, "all")[:40])


def _rule_text(rule: dict) -> str:
    if rule["power"] == 0:
        return f"{rule['c'] * sim_tasks.TASKS['chars'].inner_lr:g}"
    h = "H" if rule["power"] == 1 else "sqrt(H)"
    return f"{rule['c']:.4g} x inner lr x {h}"


# ----------------------------------------------------------------------------- studies


def study_per_step(store, args):
    for task in args.tasks:
        steps = args.steps or sim_tasks.TASKS[task].steps
        for method in ("adamw", "lion"):
            lr, _ = tune(store, task, method, 1, 0, steps, CENTRES[task][method])
            evaluate(store, task, method, 1, 0, steps, lr, args.seeds)
        for k in args.workers:
            for method in args.methods:
                lr, _ = tune(store, task, method, k, 0, steps, CENTRES[task][method])
                evaluate(store, task, method, k, 0, steps, lr, args.seeds)


def _outer_centre(task, method, H, args) -> float:
    if method.startswith("dlion"):
        return dlion_centre(method, H, args.dlion_rule)
    return CENTRES[task][method]


def study_local(store, args, tasks, steps_of):
    for task in tasks:
        for steps in steps_of(task):
            for k in args.workers:
                for H in args.sync_every:
                    for method in ("nesterov", args.dlion, "sparseloco"):
                        lr, _ = tune(store, task, method, k, H, steps,
                                     _outer_centre(task, method, H, args))
                        evaluate(store, task, method, k, H, steps, lr, args.seeds)


# ----------------------------------------------------------------------------- summary


class _Recorded:
    """The runs there are, to replay a study's tuning without running anything (KeyError
    where the tuning would have needed a run that is not there)."""

    def __init__(self, runs):
        self.runs = {key(r): r for r in runs}

    def get(self, cfg) -> dict:
        return self.runs[key(cfg)]


def _picked(runs, tune_seed, rules=None):
    """{(task, method, k, H, steps): (lr picked on the held-out seed, [eval runs], [trials])}:
    the lr the studies' tuning picks, replayed on the runs (``tune`` from the same centre, so
    runs of other grids in the same folder, the sweep's, do not count); where it cannot be
    replayed, the best of every run on the held-out seed."""
    tuned, out = {}, {}
    recorded = _Recorded(runs)
    for r in runs:
        c = (r["task"], r["method"], r["k"], r["H"], r["steps"])
        if r["seed"] == tune_seed:
            tuned.setdefault(c, []).append(r)
    for c, trials in tuned.items():
        task, method, k, H, steps = c
        centre = dlion_centre(method, H, (rules or {}).get(method)) \
            if method.startswith("dlion") and H else CENTRES.get(task, {}).get(method)
        try:
            lr, tried = tune(recorded, task, method, k, H, steps, centre, seed=tune_seed)
            trials = list(tried.values())
        except (KeyError, TypeError):
            ok = [t for t in trials if math.isfinite(t["val_loss"])] or trials
            lr = min(ok, key=lambda t: t["val_loss"])["lr"]
        ev = [r for r in runs if (r["task"], r["method"], r["k"], r["H"], r["steps"]) == c
              and r["lr"] == lr and r["seed"] != tune_seed]
        out[c] = (lr, sorted(ev, key=lambda r: r["seed"]), sorted(trials, key=lambda t: t["lr"]))
    return out


def study_rules(inputs) -> dict:
    """{1-bit outer step: its lr rule} of the local and budgets studies of these folders (their
    meta-local*.json and meta-budgets*.json)."""
    out = {}
    for folder in inputs:
        for name in sorted(os.listdir(folder)):
            if name.startswith(("meta-local", "meta-budgets")) and name.endswith(".json"):
                a = json.load(open(os.path.join(folder, name)))["args"]
                out[a["dlion"]] = a.get("dlion_rule")
    return out


def _bytes(method, k, numel, tensors, r):
    """Bytes per rank per step (per step) or per sync (DiLoCo), at k workers."""
    if method in K_FREE:
        return round(ring_all_reduce_bytes(k, 4 * numel))
    return r["bytes_per_sync"]


def summarize(out_dir: str, tune_seed: int = TUNE_SEED, seeds=SEEDS, inputs=None,
              dlion: str = "dlion-ef-decay-0.5") -> str:
    """study.md, study.json and the plots of the runs in ``out_dir`` (or in the folders
    ``inputs``: one study over several folders' runs.jsonl, each run once): the per-step
    methods, DiLoCo-Nesterov, SparseLoCo and the 1-bit outer steps the local and budgets
    studies ran (their meta files; else ``dlion``); the sweep's other candidates are in its
    own report."""
    runs = {}
    for folder in inputs or [out_dir]:
        with open(os.path.join(folder, "runs.jsonl")) as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    runs[key(r)] = r
    runs = list(runs.values())
    rules = study_rules(inputs or [out_dir]) or {dlion: None}
    picked = _picked(runs, tune_seed, rules)
    rows = []
    shown = set(sim_runs.PER_STEP) | {"nesterov", "sparseloco"} | set(rules)
    for (task, method, k, H, steps), (lr, ev, trials) in sorted(picked.items()):
        if method not in shown:
            continue
        ev = [r for r in ev if r["seed"] in seeds]
        if not ev:
            continue
        losses = [r["val_loss"] for r in ev]
        finite = all(math.isfinite(v) for v in losses)
        ks = [k] if method not in K_FREE else sorted({r["k"] for r in runs
                                                       if r["method"] not in K_FREE} or {4})
        for kk in ks:
            rows.append(dict(
                task=task, method=method, label=label(method), k=kk, H=H, steps=steps, lr=lr,
                seeds=[r["seed"] for r in ev], losses=losses,
                loss_mean=statistics.fmean(losses) if finite else math.inf,
                loss_std=statistics.stdev(losses) if finite and len(losses) > 1 else 0.0,
                bytes_per_sync=_bytes(method, kk, ev[0]["numel"], ev[0]["tensors"], ev[0]),
                syncs=ev[0]["syncs"], tokens=ev[0]["tokens"], numel=ev[0]["numel"],
                trials={t["lr"]: t["val_loss"] for t in trials},
                step_ms=statistics.median(r["step_ms"] for r in ev),
                edge=lr in (min(t["lr"] for t in trials), max(t["lr"] for t in trials))))
    for r in rows:  # the references: AdamW per step; Nesterov at the same k, H and budget
        ref = next((x for x in rows if x["task"] == r["task"] and x["method"] == "adamw"
                    and x["k"] == r["k"] and x["steps"] == r["steps"]), None)
        if ref and r["H"] == 0:
            r["vs_adamw_pct"] = 100 * (r["loss_mean"] / ref["loss_mean"] - 1)
            r["bytes_vs_adamw"] = r["bytes_per_sync"] / ref["bytes_per_sync"] \
                if ref["bytes_per_sync"] else None
        nes = next((x for x in rows if x["task"] == r["task"] and x["method"] == "nesterov"
                    and (x["k"], x["H"], x["steps"]) == (r["k"], r["H"], r["steps"])), None)
        if nes and r["H"]:
            r["vs_nesterov_pct"] = 100 * (r["loss_mean"] / nes["loss_mean"] - 1)
            r["bytes_vs_nesterov"] = r["bytes_per_sync"] / nes["bytes_per_sync"]
    lines = ["# Scaling studies on simulated workers", ""]
    for task in sorted({r["task"] for r in rows}):
        t = sim_tasks.TASKS[task]
        for title, per in (("Per step", True), ("Local steps (DiLoCo)", False)):
            sub = [r for r in rows if r["task"] == task and (r["H"] == 0) == per]
            if not sub:
                continue
            lines += [f"## {title}: {task}", ""]
            lines += [f"{sub[0]['numel']:,} parameters; the global batch of every step: "
                      f"{t.batch} windows ({t.batch * t.tokens_per_window:,} predicted tokens), "
                      "cut into k equal shares. Validation loss (nats per token) after the "
                      "budget, mean (std) over the reported seeds at the lr picked on the "
                      "held-out seed; bytes each rank sends (and receives) per step or per "
                      "sync. *: the picked lr is at an edge of the lrs tried.", ""]
            if per:
                lines += ["| budget (tokens) | k | method | lr | val loss | vs AdamW | "
                          "bytes / rank / step | vs AdamW's bytes |",
                          "|---|---|---|---|---|---|---|---|"]
            else:
                lines += ["| budget (tokens) | k | H | method | lr | val loss | vs Nesterov | "
                          "bytes / rank / sync | vs Nesterov's bytes |",
                          "|---|---|---|---|---|---|---|---|---|"]
            for r in sorted(sub, key=lambda r: (r["steps"], r["k"], r["H"], _order(r))):
                loss = f"{r['loss_mean']:.4f} ({r['loss_std']:.4f})"
                lr = f"{r['lr']:g}{'*' if r['edge'] else ''}"
                ref = "adamw" if per else "nesterov"
                vs, bv = r.get(f"vs_{ref}_pct"), r.get(f"bytes_vs_{ref}")
                where = f"{r['k']} |" if per else f"{r['k']} | {r['H']} |"
                lines.append(f"| {r['tokens']:,} | {where} {r['label']} | {lr} | {loss} "
                             f"| {'-' if vs is None else f'{vs:+.2f}%'} | "
                             f"{r['bytes_per_sync']:,} | "
                             f"{'-' if not bv else f'1/{1 / bv:.1f}'} |")
            lines.append("")
    lines += targets(rows)
    lines += ["", "## Tuning (held-out seed: lr: final validation loss)", ""]
    for r in sorted(rows, key=lambda r: (r["task"], r["steps"], r["k"], r["H"], _order(r))):
        if r["method"] in K_FREE and r["k"] != min(x["k"] for x in rows
                                                    if x["method"] == r["method"]):
            continue
        cells = ", ".join(f"{lr:g}: {v:.4f}" for lr, v in sorted(r["trials"].items()))
        lines.append(f"- {r['task']}, {r['steps']} steps, k = "
                     f"{'any' if r['method'] in K_FREE else r['k']}, H = {r['H'] or '-'}, "
                     f"{r['label']}: {cells}")
    text = "\n".join(lines) + "\n"
    common.save_text(out_dir, "study.md", text)
    with open(os.path.join(out_dir, "study.json"), "w") as f:
        json.dump(dict(rows=rows), f, indent=1)
    _plots(out_dir, rows, runs)
    return text


def _order(r) -> int:
    order = ("adamw", "lion", "dlion-vote-binary", "dlion-vote-ternary", "dlion-average-binary",
             "dlion-average-ternary", "nesterov", "sparseloco")
    return order.index(r["method"]) if r["method"] in order else len(order)


def targets(rows) -> list:
    """The three targets, met or not, from the rows there are."""
    out = ["## Targets", "", "| task | target | measured | met |", "|---|---|---|---|"]
    for task in sorted({r["task"] for r in rows}):
        full = max((r["steps"] for r in rows if r["task"] == task), default=0)
        # 1. per step at k = 64: the best D-Lion mode within 1/32 of AdamW's bytes
        per = [r for r in rows if r["task"] == task and r["H"] == 0 and r["k"] == 64
               and r["steps"] == full]
        adamw = next((r for r in per if r["method"] == "adamw"), None)
        # 1/32 of the fp32 all-reduce: one bit each way, plus the wire's padding (a header and
        # shard rounding per peer, at most 31 bits per tensor: 5% here)
        cands = [r for r in per if r["method"].startswith("dlion") and adamw
                 and r["bytes_per_sync"] * 32 <= 1.05 * adamw["bytes_per_sync"]]
        if adamw and cands:
            best = min(cands, key=lambda r: r["loss_mean"])
            ok = best["loss_mean"] <= 1.02 * adamw["loss_mean"]
            out.append(f"| {task} | D-Lion per step (best mode with 1/32 of AdamW's bytes) "
                       f"within 2% of AdamW all-reduce at k = 64 | {best['label']}: "
                       f"{best['vs_adamw_pct']:+.2f}%, 1/{1 / best['bytes_vs_adamw']:.1f} of "
                       f"the bytes | {'met' if ok else 'not met'} |")
        # 2. the best outer step within 1% of Nesterov at every k and H
        local = [r for r in rows if r["task"] == task and r["H"] and r["method"].startswith(
            "dlion") and "vs_nesterov_pct" in r]
        for steps, method in sorted({(r["steps"], r["method"]) for r in local}):
            sub = [r for r in local if r["steps"] == steps and r["method"] == method]
            worst = max(sub, key=lambda r: r["vs_nesterov_pct"])
            ok = all(r["vs_nesterov_pct"] <= 1.0 for r in sub)
            cells = ", ".join(f"k={r['k']} H={r['H']}: {r['vs_nesterov_pct']:+.2f}%"
                              for r in sorted(sub, key=lambda r: (r["k"], r["H"])))
            out.append(f"| {task} ({steps} steps) | {worst['label']} within 1% of "
                       f"DiLoCo-Nesterov at every k and H | {cells} | "
                       f"{'met' if ok else 'not met'} |")
        # 3. at k = 64: fewer bytes per sync than SparseLoCo at equal or better loss
        for steps in sorted({r["steps"] for r in rows if r["task"] == task and r["H"]}):
            for H in sorted({r["H"] for r in rows if r["task"] == task and r["H"]}):
                sp = next((r for r in rows if (r["task"], r["method"], r["k"], r["H"],
                                               r["steps"]) == (task, "sparseloco", 64, H, steps)),
                          None)
                dl = [r for r in rows if (r["task"], r["k"], r["H"], r["steps"]) == (
                    task, 64, H, steps) and r["method"].startswith("dlion")]
                if sp is None or not dl:
                    continue
                d = min(dl, key=lambda r: r["loss_mean"])
                ok = d["bytes_per_sync"] < sp["bytes_per_sync"] and \
                    d["loss_mean"] <= sp["loss_mean"]
                out.append(f"| {task} ({steps} steps) | k = 64, H = {H}: the vote sends fewer "
                           f"bytes per sync than SparseLoCo at equal or better loss | "
                           f"{d['label']}: "
                           f"{d['bytes_per_sync']:,} vs {sp['bytes_per_sync']:,} bytes; loss "
                           f"{d['loss_mean']:.4f} vs {sp['loss_mean']:.4f} | "
                           f"{'met' if ok else 'not met'} |")
    return out


def _plots(out_dir, rows, runs):
    plt = common.pyplot()
    if plt is None or not rows:
        return
    by_cfg = {}
    for r in runs:
        by_cfg.setdefault((r["task"], r["method"], r["k"], r["H"], r["steps"], r["lr"]),
                          []).append(r)
    for task in sorted({r["task"] for r in rows}):
        for study, per in (("per-step", True), ("local", False)):
            for steps in sorted({r["steps"] for r in rows if r["task"] == task}):
                sub = [r for r in rows if r["task"] == task and (r["H"] == 0) == per
                       and r["steps"] == steps]
                ks = sorted({r["k"] for r in sub})
                if not sub:
                    continue
                fig, axes = plt.subplots(1, len(ks), figsize=(4.6 * len(ks), 4), squeeze=False,
                                         sharey=True)
                for ax, k in zip(axes[0], ks):
                    for r in sorted((x for x in sub if x["k"] == k), key=_order):
                        kk = 1 if r["method"] in K_FREE else k
                        ev = [x for x in by_cfg.get((task, r["method"], kk, r["H"], steps,
                                                     r["lr"]), []) if x["seed"] in r["seeds"]
                              and x["curve"]]
                        if not ev:
                            continue
                        n = min(len(x["curve"]) for x in ev)
                        if r["method"] in K_FREE:
                            xs = [ev[0]["curve"][i][0] * r["bytes_per_sync"] for i in range(n)]
                        else:
                            xs = [ev[0]["curve"][i][1] for i in range(n)]
                        ys = [statistics.fmean(x["curve"][i][2] for x in ev) for i in range(n)]
                        name = r["label"] + (f", H = {r['H']}" if r["H"] else "")
                        methods = sorted({x["method"] for x in sub}, key=lambda m: _order(
                            dict(method=m)))
                        Hs = sorted({x["H"] for x in sub})
                        style = "--" if r["method"] in K_FREE or Hs.index(r["H"]) % 2 else "-"
                        ax.plot(xs, ys, style, marker=".", markersize=3, label=name,
                                color=f"C{methods.index(r['method']) % 10}")
                    ax.set(xscale="log", xlabel="bytes sent per rank", title=f"k = {k}")
                    ax.grid(alpha=0.3)
                axes[0][0].set_ylabel("validation loss (mean over seeds)")
                axes[0][-1].legend(fontsize=6)
                fig.suptitle(f"{task}, {study}, {steps} steps")
                fig.tight_layout()
                fig.savefig(os.path.join(out_dir, f"loss_vs_bytes-{study}-{task}-{steps}.png"),
                            dpi=100)
                plt.close(fig)


# ----------------------------------------------------------------------------- main


def parse_args(argv=None):
    if argv is None:
        argv = sys.argv[1:]
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("study", choices=("sweep", "per-step", "local", "budgets", "summarize"))
    ap.add_argument("dir", nargs="?", help="summarize: the results folder")
    ap.add_argument("--out", default=None)
    ap.add_argument("--inputs", nargs="+", default=None,
                    help="summarize: the folders whose runs.jsonl to read (default: DIR)")
    ap.add_argument("--tasks", nargs="+", default=["chars", "stdlib"],
                    choices=sorted(sim_tasks.TASKS))
    ap.add_argument("--workers", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--sync-every", type=int, nargs="+", default=None)
    ap.add_argument("--methods", nargs="+", default=[
        "dlion-vote-binary", "dlion-vote-ternary", "dlion-average-binary",
        "dlion-average-ternary"], help="per-step: the D-Lion modes")
    ap.add_argument("--dlion", default="dlion-ef-decay-0.5",
                    help="local, budgets: the 1-bit outer step (the sweep's choice)")
    ap.add_argument("--dlion-lr", default=None,
                    help="the D-Lion outer lr rule's grid centre: 'c' (one lr) or 'c*H' or "
                    "'c*sqrtH' (times the inner lr); default: a first guess")
    ap.add_argument("--candidates", nargs="+", default=list(SWEEP_CANDIDATES))
    ap.add_argument("--k", type=int, default=SWEEP_K, help="sweep: simulated workers")
    ap.add_argument("--steps", type=int, default=None,
                    help="the budget in steps (default: the task's; sweep: the chars task's)")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    ap.add_argument("--tune-seed", type=int, default=TUNE_SEED)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--smoke", action="store_true",
                    help="4 steps, k = 2, H = 1, one lr, one seed, two D-Lion modes: every "
                    "path of the study, fast")
    args = ap.parse_args(argv)
    if args.tune_seed in args.seeds:
        ap.error("--tune-seed must not be one of --seeds (it is held out)")
    if args.sync_every is None:
        args.sync_every = list(SWEEP_H) if args.study == "sweep" else [8, 64]
    args.dlion_rule = None
    if args.dlion_lr:
        text = args.dlion_lr.replace(" ", "")
        power = 1.0 if text.endswith("*H") else 0.5 if text.endswith("*sqrtH") else 0.0
        c = float(text.split("*")[0])
        inner = sim_tasks.TASKS["chars"].inner_lr
        args.dlion_rule = dict(c=c if power else c / inner, power=power)
    if args.smoke:
        args.workers, args.seeds, args.k = [2], [0], 2
        args.sync_every = [1]
        args.steps = 4
        args.candidates = args.candidates[:2]
        args.methods = ["dlion-vote-binary", "dlion-average-ternary"]
        global MAX_EXTEND, START
        MAX_EXTEND, START = 0, (0,)
        _smoke_tasks()
    if args.study == "sweep" and args.steps is None:
        args.steps = sim_tasks.TASKS["chars"].steps
    if any(s % h for h in args.sync_every for s in ((args.steps or 2048) // 4,
                                                    args.steps or 2048)):
        ap.error("every budget (and its quarter) must be a multiple of every --sync-every")
    return args


def _smoke_tasks():
    """Tiny budgets and batches for --smoke (the same code paths)."""
    for t in sim_tasks.TASKS.values():
        t.batch = 4
    sim_tasks.GPT_EVAL_WINDOWS = 4


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.study == "summarize":
        os.makedirs(args.dir, exist_ok=True)
        print(summarize(args.dir, args.tune_seed, tuple(args.seeds), args.inputs, args.dlion))
        return
    args.out = common.results_dir(f"sim-{args.study}", args.out)
    os.makedirs(args.out, exist_ok=True)
    store = Store(args.out, args.device)
    meta = common.metadata(dict(study=args.study, args={k: v for k, v in vars(args).items()
                                                        if k != "out"}))
    name = f"meta-{args.study}" + (f"-{args.dlion}" if args.study in ("local", "budgets")
                                   else "")
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(meta, f, indent=1)
    if args.study == "sweep":
        run_sweep(store, args)
        return
    if args.study == "per-step":
        study_per_step(store, args)
    elif args.study == "local":
        study_local(store, args, args.tasks,
                    lambda t: [args.steps or sim_tasks.TASKS[t].steps])
    else:  # budgets: chars, a quarter and all of the study's budget
        full = args.steps or sim_tasks.TASKS["chars"].steps
        study_local(store, args, ["chars"], lambda t: [full // 4, full])
    print(summarize(args.out, args.tune_seed, tuple(args.seeds), dlion=args.dlion))


if __name__ == "__main__":
    main()
