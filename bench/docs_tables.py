"""The results tables of the docs, made from the results folders' JSON (and the runtime model's
``--json``), so that a number in a page cannot drift from the folder it comes from.

    python bench/docs_tables.py            # rewrite every generated table in README.md and docs/
    python bench/docs_tables.py --check    # list the tables that differ from their JSON (exit 1)

A generated table sits in a page between two comment lines naming it:

    <!-- table: heal-momentum -->
    | ... |
    <!-- /table -->

``TABLES`` maps each name to the function that renders it; ``python_tests/test_docs.py`` checks
that every page's tables are what these functions make now.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

BLOCK = re.compile(r"(<!-- table: ([\w-]+) -->\n)(.*?)(<!-- /table -->)", re.S)


def _json(folder, name):
    with open(os.path.join(RESULTS, folder, name)) as f:
        return json.load(f)


def _jsonl(folder, name):
    with open(os.path.join(RESULTS, folder, name)) as f:
        return [json.loads(line) for line in f if line.strip()]


def markdown(header, rows, align=None) -> str:
    align = align or ["---"] * len(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- elastic


def heal_momentum() -> str:
    rel = _json("heal-momentum-20261127-183045", "results.json")["relative"]
    labels = [("none", "no failure (reference)"),
              ("zero", "zero (a fresh process, `\"own\"` or `\"zero\"`)"),
              ("own", "its own, from a checkpoint 20 steps old (`\"own\"`)"),
              ("peer", "a copy of a peer's (`\"peer\"`)")]
    return markdown(["momentum after the restart", "mean loss over 60 steps",
                     "loss over the last 10"],
                    [(label, f"{rel[k]['mean_loss_vs_none']:.3f}",
                      f"{rel[k]['end_loss_vs_none']:.3f}") for k, label in labels])


ELASTIC_VARIANTS = {"torchft-allreduce": "torchft's fp32 all-reduce (AdamW)",
                    "dk-dlion": "`DistributedLion(manager=)`, vote/binary"}


def _elastic(folder) -> str:
    summary = _json(folder, "elastic.json")["summary"]
    ref = next(s for s in summary if s["variant"] == "torchft-allreduce")
    rows = []
    for s in summary:
        rows.append((ELASTIC_VARIANTS.get(s["variant"], s["variant"]), s["runs"],
                     f"{s['ms_per_step_3']:.0f}", f"{s['ms_per_step_2']:.0f}",
                     f"{ref['ms_per_step_3'] / s['ms_per_step_3']:.1f}x / "
                     f"{ref['ms_per_step_2'] / s['ms_per_step_2']:.1f}x",
                     s["steps_lost"], f"{s['heal_s']:.1f}", f"{s['bytes_per_step_3']:,}"))
    return markdown(["variant", "runs", "ms / committed step, 3 replicas", "2 survivors",
                     "all-reduce's time / this (3 / 2)", "steps lost (1 failure)",
                     "time to heal (s)", "bytes / replica / step"], rows)


def elastic_1gbit() -> str:
    return _elastic("elastic-20261128-quiet")


def elastic_100mbit() -> str:
    return _elastic("elastic-100mbit-20261128")


# ----------------------------------------------------------------------------- DiLoCo


DILOCO_LABELS = {"adamw-allreduce": "AdamW + all-reduce", "dlion-vote": "D-Lion vote, per step",
                 "diloco-nesterov": "DiLoCo-Nesterov, H = 8",
                 "diloco-sparseloco": "SparseLoCo, H = 8 (outer lr 1.0, untuned)",
                 "diloco-dlion": "DiLoCo-D-Lion, H = 8",
                 "diloco-dlion-ef-decay": "DiLoCo-D-Lion + EF, decay 0.5, H = 8"}


def diloco_wallclock() -> str:
    rows = _json("diloco-wallclock-20261128", "wallclock.json")["rows"]
    rates = sorted({r["rate_gbps"] for r in rows})
    best = {rate: min(r["reach_s"] for r in rows if r["rate_gbps"] == rate
                      and r["reach_s"] is not None) for rate in rates}
    out = []
    for slug, label in DILOCO_LABELS.items():
        mine = {r["rate_gbps"]: r for r in rows if r["strategy"].split(" (")[0] == slug}
        if not mine:
            continue
        first = mine[rates[0]]
        if first["reach_step"] is None:
            out.append((label, f"not reached ({first['final_loss']:.4f})", "-",
                        *["-"] * len(rates)))
            continue
        cells = []
        for rate in rates:
            t = mine[rate]["reach_s"]
            cells.append(f"**{t:.1f} s**" if t == best[rate] else
                         f"{t:.1f} s ({t / best[rate]:.2f}x)")
        out.append((label, first["reach_step"], f"{first['reach_bytes'] / 1e6:.2f} MB", *cells))
    names = {0.01: "10 Mbit/s", 0.1: "100 Mbit/s", 1.0: "1 Gbit/s"}
    return markdown(["strategy", "inner steps to target", "bytes / rank to target",
                     *[names.get(r, f"{r:g} Gbit/s") for r in rates]], out)


# ----------------------------------------------------------------------------- demos


def chars_demo() -> str:
    table = _json("chars-demo-20261123", "rows.json")["table"]
    fp32 = table[0]["bytes_per_step"] if table[0]["strategy"].startswith("AdamW") else None
    rows = []
    for t in table:
        b = t["bytes_per_step"]
        between = t.get("inter_node_bytes_per_step")
        cell = f"{b:,}" + (f" ({between:,} between nodes)" if between else "")
        ratio = "1" if b == fp32 else f"1/{fp32 / b:.1f}"
        rows.append((t["strategy"], f"{t['val_loss_mean']:.4f} ± {t['val_loss_std']:.4f}",
                     cell, ratio))
    return markdown(["strategy (4 workers, 120 iterations)",
                     "validation loss (mean ± std, 3 seeds)", "bytes / rank / step",
                     "vs fp32 all-reduce"], rows)


# ----------------------------------------------------------------------------- runtime model


def _plan(argv) -> dict:
    from dlion_kernels.plan.__main__ import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main([*argv, "--json"])
    return json.loads(out.getvalue())


PLAN_EXAMPLE = ["--params", "124M", "--ranks", "32", "--ranks-per-node", "8", "--inter-gbps",
                "25", "--intra-gbps", "1600", "--latency-us", "30", "--fwd-ms", "80",
                "--bwd-ms", "160", "--jitter-ms", "10"]


def plan_example() -> str:
    """The table ``python -m dlion_kernels.plan`` prints for the command in docs/plan.md."""
    from dlion_kernels.plan.__main__ import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(PLAN_EXAMPLE)
    lines = out.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| strategy"))
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    rest = [line for line in lines[end:] if line.startswith(("fastest:", "not ranked:",
                                                               "when local steps pay:"))]
    return "\n".join(lines[start:end]) + "\n\n```\n" + "\n".join(rest) + "\n```\n"


# Three clusters for "when not to use the library" (docs/settings.md): GPT-2 1.3B, 8192 tokens
# per GPU and step at 40% of the GPU's dense bf16 peak (bench/bench_plan.py --clusters's inputs)
CHOICE_CLUSTERS = [
    ("4 nodes x 8 H100, NVLink, 8 x 400 Gbit/s InfiniBand",
     ["--ranks", "32", "--ranks-per-node", "8", "--inter-gbps", "3200", "--intra-gbps", "3600",
      "--latency-us", "8", "--fwd-ms", "53.8", "--bwd-ms", "107.7", "--mem-gbs", "3000"]),
    ("4 nodes x 4 A40, PCIe, 25 Gbit/s Ethernet",
     ["--ranks", "16", "--ranks-per-node", "4", "--inter-gbps", "25", "--intra-gbps", "200",
      "--latency-us", "30", "--fwd-ms", "355.0", "--bwd-ms", "710.0", "--mem-gbs", "600"]),
    ("4 nodes x 8 H100, NVLink, 1 Gbit/s Ethernet",
     ["--ranks", "32", "--ranks-per-node", "8", "--inter-gbps", "1", "--intra-gbps", "3600",
      "--latency-us", "50", "--fwd-ms", "53.8", "--bwd-ms", "107.7", "--mem-gbs", "3000"]),
]


def when_not_to_use() -> str:
    rows = []
    for name, argv in CHOICE_CLUSTERS:
        out = _plan(["--params", "1.3B", *argv])
        steps = {r["strategy"]: r["step_ms"] for r in out["rows"]}
        best = out["best"]
        rows.append((name, *(f"{steps[k]:.0f}" for k in ("lion-allreduce", "lion-allreduce-bf16",
                                                         "dlion-vote-overlap",
                                                         "fsdp-dlion-overlap")),
                     f"`{best}` {steps[best]:.0f}",
                     f"{steps['lion-allreduce'] / steps[best]:.2f}x"))
    return markdown(["cluster (GPT-2 1.3B), ms per step", "fp32 all-reduce", "bf16 all-reduce",
                     "D-Lion overlap", "FSDP2 + D-Lion overlap", "fastest",
                     "fastest vs fp32"], rows)


def plan_clusters() -> str:
    rows = _json("plan-clusters", "clusters.json")["rows"]
    fmt = "{:.1f}".format
    return markdown(
        ["cluster", "model", "fwd ms", "bwd ms", "all-reduce fp32", "all-reduce bf16",
         "D-Lion overlap", "hier. D-Lion overlap", "best gossip", "its topology", "fastest",
         "x fp32"],
        [(r["cluster"], r["model"], fmt(r["fwd_ms"]), fmt(r["bwd_ms"]),
          fmt(r["allreduce_fp32_ms"]), fmt(r["allreduce_bf16_ms"]), fmt(r["dlion_overlap_ms"]),
          "-" if r["dlion_hier_overlap_ms"] is None else fmt(r["dlion_hier_overlap_ms"]),
          fmt(r["decentralized_ms"]), r["decentralized_best"], r["fastest"],
          f"{r['speedup_vs_fp32']:.2f}") for r in rows])


# ----------------------------------------------------------------------------- settings


SETTINGS = {"digits": "settings-digits", "chars": "settings-chars"}


def _settings_folder(task):
    names = sorted(d for d in os.listdir(RESULTS) if d.startswith(SETTINGS[task] + "-"))
    return names[-1]


def _settings(task) -> str:
    folder = _settings_folder(task)
    s = _json(folder, "summary.json")
    runs = _jsonl(folder, "runs.jsonl")
    ratios = sorted({r["r"] for r in runs if r["phase"] == "tune" and r["r"] is not None})
    score = "test loss" if task == "digits" else "validation loss"
    rows = [(f"AdamW + fp32 all-reduce, lr {s['adamw_best_lr']:g}, wd {s['adamw_wd']:g}",
             *[""] * len(ratios), f"{s['adamw_tune_loss']:.4f}", "-",
             f"{s['adamw_check_loss']:.4f}", "-")]
    for o in s["optimizers"].values():
        cells = []
        for r in ratios:
            v = o["tune"].get(str(float(r)), o["tune"].get(str(r)))
            if v is None:
                cells.append("")
            else:
                cells.append(f"**{v:.4f}**" if r == o["best_r"] else f"{v:.4f}")
        lo, hi = o["within_r"]
        check = o["check_mean_by_r"].get(str(float(o["best_r"])),
                                         o["check_mean_by_r"].get(str(o["best_r"])))
        rows.append((o["label"], *cells, f"{o['tune_loss']:.4f}",
                     f"{lo:g}" if lo == hi else f"{lo:g}-{hi:g}",
                     "-" if check is None else f"{check:.4f}",
                     "-" if o["check_best_r"] is None else f"{o['check_best_r']:g}"))
    seeds = " and ".join(map(str, s["check_seeds"]))
    return markdown([f"{score} ({task}; r: lr = AdamW's / r, wd = AdamW's x r)",
                     *[f"r = {r:g}" for r in ratios], "best, tuning seed",
                     f"r within {100 * s['within']:g}% of the best",
                     f"seeds {seeds}: at the tuned r (mean)", f"seeds {seeds}: best r"], rows)


def settings_digits() -> str:
    return _settings("digits")


def settings_chars() -> str:
    return _settings("chars")


def chars_elastic() -> str:
    rep = _json("chars-elastic-20261127", "chars_elastic.json")["report"]
    rows = []
    for point in rep["curve"]:
        note = ""
        if point["step"] == rep["kill_at"]:
            note = f" (replica {rep['kill_replica']} killed in step {rep['kill_at']})"
        elif point["step"] == rep["restart_at"]:
            note = f" (replica {rep['kill_replica']} restarted)"
        rows.append((point["step"], f"{point['n']}{note}", f"{point['val_loss']:.4f}"))
    return markdown(["step", "participants", "validation loss (replica 0)"], rows)


def diloco_quality() -> str:
    rows = _json("diloco-chars-20261125-174804", "quality.json")["rows"]
    out = []
    for r in rows:
        out.append((r["label"], f"{r['val_loss_mean']:.4f} ± {r['val_loss_std']:.4f}",
                    f"{r['bytes_per_step']:,.0f}"))
    return markdown(["strategy", "validation loss", "bytes / rank / inner step"], out)


TORCHFT_LABELS = {"dk-nesterov": '`dk.DiLoCo(outer="nesterov")`',
                  "torchft-nesterov": "torchft DiLoCo (SGD nesterov, lr 0.7, mu 0.9)",
                  "dk-dlion-vote": '`dk.DiLoCo(outer="dlion")` (vote/binary, lr 1e-2)'}


def diloco_torchft() -> str:
    rows = _json("diloco-torchft-20261125-150523", "diloco_torchft.json")["summary"]
    return markdown(["variant", "validation loss", "bytes / sync / rank", "inner step (ms)",
                     "sync, extra (ms)"],
                    [(TORCHFT_LABELS.get(r["variant"], r["variant"]), f"{r['val_loss']:.4f}",
                      f"{r['bytes_per_sync']:,.0f}",
                      f"{r['inner_step_ms']:.1f} ({r['inner_step_ms_spread']})",
                      f"{r['sync_ms']:.1f} ({r['sync_ms_spread']})") for r in rows])


def _ms(v):
    return f"{v:.1f} ms" if v < 100 else f"{v:.0f} ms"


def hierarchy_gather() -> str:
    rows = _json("hierarchy-gather-20261123", "hierarchy_gather.json")["rows"]
    keys = sorted({(r["L"], r["d"], r["dtype"]) for r in rows},
                  key=lambda k: (k[0], k[1], k[2] != "fp32"))
    out = []
    for L, d, dtype in keys:
        ms = {r["variant"]: r["ms"] for r in rows if (r["L"], r["d"], r["dtype"]) == (L, d, dtype)}
        out.append((L, f"{d >> 20}M", dtype, _ms(ms["aggregate"]), _ms(ms["params"])))
    return markdown(["L", "d", "dtype", "gather aggregate + apply all",
                     "apply shard + gather params"], out)


def resize() -> str:
    rows = _json("resize-20261123-131311", "resize.json")["rows"]
    rules = [("mean", "mean (the rule)"), ("rank0", "rank 0's state everywhere"),
             ("zero", "no state (momentum 0)")]
    out = []
    for n in sorted({r["n_new"] for r in rows}, key=lambda n: (n != 4, n)):
        cells = []
        for rule, _ in rules:
            r = next((r for r in rows if r["n_new"] == n and r["rule"] == rule), None)
            cells.append("-" if r is None else f"{r['loss_first']:.4f} ({r['loss_first_max']:.3f})"
                         f" -> {r['loss_last']:.4f}")
        out.append((f"{n} (exact resume)" if n == 4 else n, *cells))
    return markdown(["4 -> n", *[label for _, label in rules]], out)


SOAKS = [("`DistributedLion`", "soak-20261123-131151"),
         ("decentralized (ring, AccumAdamW)", "soak-decentralized-20261123")]


def soak() -> str:
    out = []
    for label, folder in SOAKS:
        rows = _json(folder, "soak.json")["rows"]
        growth = [r["rss_kb_growth_pct"] for r in rows]
        fds = {(r["fds_warm"], r["fds_end"]) for r in rows}
        threads = {(r["threads_warm"], r["threads_end"]) for r in rows}
        cell = f"+{min(growth):.2f} to +{max(growth):.2f}%"
        out.append((label, f"`bench/results/{folder}/`",
                     ", ".join(f"{a} -> {b}" for a, b in sorted(fds)),
                     ", ".join(f"{a} -> {b}" for a, b in sorted(threads)), cell,
                     "within 1%" if max(growth) <= 1.0 else "**above 1%**"))
    return markdown(["run", "results", "open fds", "threads", "resident memory growth",
                     "against 1%"], out)


def training_steps() -> str:
    """Whole steps, flat layouts (results.md): the slowest rank's median step, ms."""
    rows = [r for r in _json("training-20261123-2105", "bench_training.json")["rows"]
            if r["layout"] == "flat" and r["sweep"] == "main" and r["jitter_ms"] == 0
            and r["status"] == "ok"]
    out = []
    for rate, n in sorted({(r["rate_gbps"], r["n"]) for r in rows}):
        v = {r["variant"]: r for r in rows if (r["rate_gbps"], r["n"]) == (rate, n)}
        step = {k: r["step_ms_slowest_rank"] for k, r in v.items()}
        ratios = [step["ddp_fp32"] / step[k] for k in ("dlion", "dlion_overlap")]
        lo, hi = min(ratios), max(ratios)
        ratio = f"{lo:.1f}x" if f"{lo:.1f}" == f"{hi:.1f}" else f"{lo:.1f}-{hi:.1f}x"
        out.append((f"{rate:g}", n, f"{step['no_comm']:.0f} / {v['no_comm']['step_ms_median']:.0f}",
                    *(f"{step[k]:.0f}" for k in ("ddp_fp32", "ddp_bf16", "dlion",
                                                 "dlion_overlap", "dlion_ddp_hook")),
                    f"**{ratio}**" if rate == 1 else ratio))
    return markdown(["Gbit/s", "n", "no comm (slowest / median rank)", "DDP fp32", "DDP bf16",
                     "D-Lion", "D-Lion overlap", "D-Lion DDP hook", "DDP fp32 / D-Lion"], out)


OUTER_LRS = ["3e-4", "1e-3", "3e-3", "1e-2", "3e-2", "1e-1"]


def diloco_outer_lr() -> str:
    folder = os.path.join(RESULTS, "diloco-outer-lr-20261125")
    out = []
    for H, steps in ((8, 96), (32, 128)):
        loss = {}
        for lr in OUTER_LRS + ["nest"]:
            path = os.path.join(folder, f"H{H}-lr-{lr}.json")
            if os.path.exists(path):
                with open(path) as f:
                    loss[lr] = json.load(f)["summary"][0]["val_loss"]
        best = min(loss[lr] for lr in OUTER_LRS if lr in loss)
        cells = ["-" if lr not in loss else (f"**{loss[lr]:.3f}**" if loss[lr] == best
                                              else f"{loss[lr]:.3f}") for lr in OUTER_LRS]
        out.append((f"{H} ({steps})", *cells, f"{loss['nest']:.3f}"))
    return markdown(["H (inner steps)", *OUTER_LRS, "Nesterov (lr 0.7)"], out)


TABLES = {
    "heal-momentum": heal_momentum,
    "elastic-1gbit": elastic_1gbit,
    "elastic-100mbit": elastic_100mbit,
    "diloco-wallclock": diloco_wallclock,
    "chars-demo": chars_demo,
    "training-steps": training_steps,
    "chars-elastic": chars_elastic,
    "diloco-quality": diloco_quality,
    "diloco-outer-lr": diloco_outer_lr,
    "diloco-torchft": diloco_torchft,
    "hierarchy-gather": hierarchy_gather,
    "resize": resize,
    "soak": soak,
    "plan-example": plan_example,
    "when-not-to-use": when_not_to_use,
    "plan-clusters": plan_clusters,
    "settings-digits": settings_digits,
    "settings-chars": settings_chars,
}


def pages():
    return [os.path.join(ROOT, "README.md")] + sorted(
        os.path.join(ROOT, "docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
        if f.endswith(".md"))


def render(text: str, cache: dict) -> str:
    def one(m):
        name = m.group(2)
        if name not in TABLES:
            raise KeyError(f"no generator for table {name!r}; known: {', '.join(TABLES)}")
        if name not in cache:
            cache[name] = TABLES[name]()
        return m.group(1) + cache[name] + m.group(4)

    return BLOCK.sub(one, text)


def stale() -> list[str]:
    """'page: table' for every generated table that differs from what its JSON makes now."""
    cache, out = {}, []
    for page in pages():
        text = open(page).read()
        for m in BLOCK.finditer(text):
            if render(m.group(0), cache) != m.group(0):
                out.append(f"{os.path.relpath(page, ROOT)}: {m.group(2)}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only list stale tables")
    args = ap.parse_args(argv)
    if args.check:
        bad = stale()
        print("\n".join(bad) if bad else "every table matches its JSON")
        return 1 if bad else 0
    cache = {}
    for page in pages():
        text = open(page).read()
        new = render(text, cache)
        if new != text:
            with open(page, "w") as f:
                f.write(new)
            print(f"updated {os.path.relpath(page, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
