"""Validation of the runtime model: predicted against measured step times.

    python bench/bench_plan.py --measured FILE.json [FILE2.json ...] [--calibrate FILE.json]
        [--compute no-comm|own-forward] [--out DIR] [--no-plot]
    python bench/bench_plan.py --clusters [--out DIR]     # the README's cluster predictions

Reads measured step times, predicts each with ``dlion_kernels.plan.predict`` from the inputs
the measurement states, and writes ``bench/results/plan-<timestamp>/`` (or ``--out``):
``bench_plan.{json,csv,md,png}``: one row per (configuration, strategy) with predicted, measured
and the relative error; per configuration the predicted-fastest and the measured-fastest; the
summary (median and worst absolute error, how often the predicted-fastest is the measured-fastest
or within 5% of it) against the model's targets (15%, 35%, 90%); a predicted-against-measured
scatter plot.

Input formats (detected from the file):

1. The generic schema (write this from any harness)::

       {"rows": [{"config": "1gbit-n4",            # rows with the same config are compared
                  "strategy": "dlion-vote",         # a row of predict(): a strategy slug
                  "measured_ms": 129.1,             # slowest rank, median over steps
                  "role": "validate",               # or "calibrate" (see below); optional
                  "inputs": {"params": 26214400, "ranks": 4, "ranks_per_node": 1,
                             "inter_gbps": 0.958, "intra_gbps": 0.958, "latency_us": 50,
                             "fwd_ms": 0, "bwd_ms": 0, "opt_ms": 72.8, "jitter_ms": 0,
                             "bucket_mb": 25, "algorithm": "ring", "modes": ["vote"],
                             "cpu_gbs": null}}]}

   ``inputs`` are predict()'s keyword arguments. ``"cpu_gbs": "fit"`` asks for the host
   processing rate to be fitted per rank count, and the network's latency with it, on the rows
   whose role is ``calibrate`` (the collectives alone, as ``--measure`` times them on the
   running group), never on the rows they are then judged on.

2. ``bench/bench_network.py``'s JSON (the optimizer phase of a step over the emulated
   network, no forward/backward): per (rate, n), the measured link rate, the local Lion time
   (opt_ms, all ranks computing at once), the collectives alone (calibration rows) and the
   whole phase for Lion + fp32 all-reduce, D-Lion vote and average (validation rows).

3. ``bench/bench_training.py``'s JSON (whole training steps; validation rows, see
   ``from_training``). It has no collectives-alone rows: pass a bench_network JSON of the same
   machine too, whose collectives calibrate the latency and the host rate per rank count.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from dlion_kernels import strategies  # noqa: E402
from dlion_kernels.plan import model  # noqa: E402

TARGET_MEDIAN, TARGET_WORST, TARGET_FASTEST, WITHIN = 0.15, 0.35, 0.90, 0.05
SHAPER_EFFICIENCY = 0.957  # what tbf carried of its rate (bench_network's probes: 0.95-0.96)
VETH_LATENCY_US = 50.0  # one message across a veth pair and a bridge, gloo over TCP (approx.)


# ----------------------------------------------------------------------------- adapters


def from_network(doc: dict) -> list[dict]:
    """bench_network.json -> generic rows."""
    links = {(lk["rate_gbit"], lk["n"]): lk["measured_gbit"] for lk in doc["links"]}
    by = {(r["rate_gbit"], r["n"], r["key"]): r for r in doc["rows"]}
    rows = []
    for (rate, n), gbit in sorted(links.items()):
        local = by.get((rate, n, "lion_local"))
        if local is None:
            continue
        base = {"params": by[(rate, n, "lion_allreduce_fp32")]["numel"], "ranks": n,
                "ranks_per_node": 1, "inter_gbps": gbit, "intra_gbps": gbit,
                "latency_us": "fit", "fwd_ms": 0.0, "bwd_ms": 0.0,
                "bucket_mb": 1e9, "algorithm": "ring", "modes": ["vote", "average"],
                "cpu_gbs": "fit"}
        config = f"{rate:g}gbit-n{n}"
        for key, strategy, role, opt in [
            ("allreduce_fp32_comm", "lion-allreduce", "calibrate", 0.0),
            ("dlion_vote_binary_comm", "dlion-vote", "calibrate", 0.0),
            ("lion_allreduce_fp32", "lion-allreduce", "validate", local["t_max_ms"]),
            ("dlion_vote_binary", "dlion-vote", "validate", local["t_max_ms"]),
            ("dlion_average_binary", "dlion-average", "validate", local["t_max_ms"]),
        ]:
            if (rate, n, key) in by:
                rows.append({"config": config + ("-comm" if role == "calibrate" else ""),
                             "strategy": strategy, "measured_ms": by[(rate, n, key)]["t_max_ms"],
                             "role": role, "inputs": {**base, "opt_ms": opt}})
    return rows


LOOPBACK_GBPS = 40.0  # intra-node (a namespace's loopback); the host rate bounds it anyway


def from_training(doc: dict, compute: str = "no-comm") -> list[dict]:
    """bench_training.json (ROW_SCHEMA there) -> generic rows, one per modelled variant.

    Variants are strategy slugs, or the variant keys of older files (``ddp_fp32``,
    ``dec_ring``, ...: ``strategies.resolve``); each is validated against its strategy's
    runtime-model row. Compute comes from the same configuration's ``dlion-no-comm`` variant
    (``no_comm`` before; the step with a local tally instead of the exchange): its median fwd,
    bwd and opt phases, and its median rank's step time, whose excess over the phases and the
    modelled jitter wait (zeroing gradients, the loop) is added to fwd. The link rate is the
    configuration's tbf rate; the measured shaper rate of bench_network (~0.96 of it) is
    applied when given.

    ``compute="own-forward"``: the same phases scaled by the variant's own forward time over
    no_comm's (the forward communicates in no variant), for a machine whose load changes
    between variants."""
    rows = []
    ok = [r for r in doc["rows"] if r.get("status") == "ok"]
    # A decentralized topology changes its gossip groups from step to step (alternating-exp-ring
    # at n = 2: a pair every other step, alone in between), so its steps are not alike and
    # the median step is not its rate: use the mean over the reps of the slowest rank's step,
    # which the model predicts. The other strategies' steps are alike: the median, robust to a
    # rank's slow step, stays.
    mean_step = {}
    for c in doc.get("raw", []):
        times = c.get("times_s_rank_rep_step_fwd_bwd_opt")
        if strategies.resolve(c["variant"]).family == "decentralized" and times:
            slowest = [max(rank[k][0] for rank in times) for k in range(len(times[0]))]
            mean_step[(c["n"], c["ranks_per_node"], c["rate_gbps"], c["variant"], c["batch"],
                       c["bucket_mb"])] = 1e3 * statistics.fmean(slowest)

    def key(r):
        return (r["n"], r["ranks_per_node"], r["rate_gbps"], r["batch"], r["jitter_ms"],
                r["bucket_mb"], r["sweep"])
    no_comm = {key(r): r for r in ok if strategies.resolve(r["variant"]).slug == "dlion-no-comm"}
    for r in ok:
        strategy = strategies.resolve(r["variant"]).row  # None: not modelled
        nc = no_comm.get(key(r)) or next(
            (x for k, x in no_comm.items() if k[:5] == key(r)[:5]), None)
        if strategy is None or nc is None:
            continue
        n, L, jitter = r["n"], r["ranks_per_node"], r["jitter_ms"] or 0.0
        fwd, bwd, opt = nc["own_fwd_ms"], nc["own_bwd_ms"], nc["own_opt_ms"]
        # no_comm's ranks never wait for each other, so its slowest rank is one rank's bad
        # luck, not a step anyone waits for (one rank's slow steps in a launch's first case
        # made it 2-2.5x the median rank at n >= 4): the spread is taken at the median rank.
        spread = nc["step_ms_median"] - (fwd + bwd + opt) - model.expected_max(n, jitter)
        if compute == "own-forward":
            # The forward has no communication in any variant: its own forward time says how
            # fast this machine computed while the variant ran; scale no_comm's phases by it.
            scale = r["own_fwd_ms"] / fwd
            fwd, bwd, opt, spread = fwd * scale, bwd * scale, opt * scale, spread * scale
        gbit = r["rate_gbps"] * doc.get("shaper_efficiency", SHAPER_EFFICIENCY)
        inputs = {"params": r["params"], "ranks": n, "ranks_per_node": L, "inter_gbps": gbit,
                  "intra_gbps": LOOPBACK_GBPS if L > 1 else gbit, "latency_us": "fit",
                  "fwd_ms": fwd + max(0.0, spread), "bwd_ms": bwd, "opt_ms": opt,
                  "jitter_ms": jitter, "jitter_dist": "uniform", "bucket_mb": r["bucket_mb"],
                  "algorithm": "ring", "modes": ["vote"], "cpu_gbs": "fit"}
        config = f"{r['rate_gbps']:g}gbit-{r['layout']}-n{n}" + (
            f"-jitter{jitter:g}" if jitter else "") + (
            f"-{r['sweep']}-b{r['batch']}-mb{r['bucket_mb']:g}" if r["sweep"] != "main" else "")
        measured = mean_step.get((n, L, r["rate_gbps"], r["variant"], r["batch"],
                                  r["bucket_mb"]), r["step_ms_slowest_rank"])
        rows.append({"config": config, "strategy": strategy,
                     "measured_ms": measured, "role": "validate",
                     "inputs": inputs})
    return rows


def load(path: str, compute: str = "no-comm") -> list[dict]:
    with open(path) as f:
        doc = json.load(f)
    if "links" in doc and "compute_n1" in doc:
        return from_network(doc)
    if doc.get("metadata", {}).get("benchmark") == "bench_training" or "row_schema" in doc:
        return from_training(doc, compute)
    return doc["rows"]


# ----------------------------------------------------------------------------- predict


def _predict(row: dict, fit: dict, only: bool = False) -> dict:
    """predict() for the row's inputs; ``fit``: fitted latency_us and cpu_gbs per rank count;
    ``only``: just the row's strategy (faster, for fitting)."""
    inputs = dict(row["inputs"])
    inputs.pop("cores", None)
    params, n = inputs.pop("params"), inputs.pop("ranks")
    L = inputs.pop("ranks_per_node", 1)
    if inputs.get("cpu_gbs") == "fit":
        inputs["cpu_gbs"] = fit.get("cpu_gbs", {}).get(n)
    if inputs.get("latency_us") == "fit":
        inputs["latency_us"] = fit.get("latency_us", VETH_LATENCY_US)
    extra = {"strategies": [row["strategy"]], "topologies": []} if only else {}
    return {r.strategy: r for r in model.predict(params, n, L, **inputs, **extra)}


def _fit_error(rows, fit):
    """Mean squared log error: over- and under-prediction alike, no row ignored."""
    errs = [math.log(_predict(r, fit, True)[r["strategy"]].step_ms / r["measured_ms"]) ** 2
            for r in rows]
    return sum(errs) / len(errs) if errs else 0.0


def fit_network(rows: list[dict]) -> dict:
    """Fit on the calibration rows only (the collectives alone), as ``--measure`` does on the
    running group: one latency for the network and one host rate (cpu_gbs) per rank count,
    for the rows that ask for it (``"cpu_gbs": "fit"``). The validation rows are never used."""
    cal = [r for r in rows if r.get("role") == "calibrate"]
    if not cal:
        return {}
    counts = sorted({r["inputs"]["ranks"] for r in cal if r["inputs"].get("cpu_gbs") == "fit"})
    c_grid = [None] + [10 ** (k / 20) for k in range(-40, 61)]  # 0.01 .. 1000 GB/s
    best = None
    for lat in (10, 20, 50, 100, 200, 300, 500, 700, 1000):
        fit = {"latency_us": float(lat), "cpu_gbs": {}}
        for n in counts:
            group = [r for r in cal if r["inputs"]["ranks"] == n]
            fit["cpu_gbs"][n] = min(c_grid, key=lambda c, g=group: _fit_error(
                g, {**fit, "cpu_gbs": {n: c}}))
        score = _fit_error(cal, fit)
        if best is None or score < best[0]:
            best = (score, fit)
    return best[1]


def validate(rows: list[dict]) -> dict:
    fit = fit_network(rows)
    table, configs = [], {}
    for r in rows:
        pred = _predict(r, fit)
        p = pred[r["strategy"]]
        err = p.step_ms / r["measured_ms"] - 1
        table.append({"config": r["config"], "strategy": r["strategy"],
                      "role": r.get("role", "validate"), "predicted_ms": p.step_ms,
                      "measured_ms": r["measured_ms"], "error_pct": 100 * err,
                      "exposed_comm_ms": p.exposed_comm_ms, "bytes_per_rank": p.bytes_per_rank})
        if r.get("role", "validate") == "validate":
            configs.setdefault(r["config"], []).append(table[-1])
    verdicts = []
    for config, entries in configs.items():
        if len(entries) < 2:
            continue
        pf = min(entries, key=lambda e: e["predicted_ms"])
        mf = min(entries, key=lambda e: e["measured_ms"])
        within = pf["measured_ms"] <= (1 + WITHIN) * mf["measured_ms"]
        verdicts.append({"config": config, "predicted_fastest": pf["strategy"],
                         "measured_fastest": mf["strategy"],
                         "predicted_fastest_measured_ms": pf["measured_ms"],
                         "measured_fastest_ms": mf["measured_ms"], "ok": within})
    val = [abs(t["error_pct"]) / 100 for t in table if t["role"] == "validate"]
    summary = {
        "validation_rows": len(val),
        "configurations": len(configs),
        "median_abs_error": statistics.median(val) if val else math.nan,
        "worst_abs_error": max(val) if val else math.nan,
        "fastest_agreement": (sum(v["ok"] for v in verdicts) / len(verdicts)) if verdicts
        else math.nan,
        "fitted": fit,
    }
    return {"rows": table, "fastest": verdicts, "summary": summary}


# ----------------------------------------------------------------------------- clusters

# Clusters we cannot run here (README, "Which strategy? The runtime model"). Links per
# direction: NVLink 900 GB/s is both directions together, 450 GB/s = 3600 Gbit/s each way.
CLUSTERS = {
    "4 x 8 H100": dict(ranks=32, ranks_per_node=8, intra_gbps=3600, inter_gbps=3200,
                       intra_latency_us=3, latency_us=8, tflops=989, mem_gbs=3000),
    "8 x 8 H100": dict(ranks=64, ranks_per_node=8, intra_gbps=3600, inter_gbps=3200,
                       intra_latency_us=3, latency_us=8, tflops=989, mem_gbs=3000),
    "16 x 8 H100": dict(ranks=128, ranks_per_node=8, intra_gbps=3600, inter_gbps=3200,
                        intra_latency_us=3, latency_us=8, tflops=989, mem_gbs=3000),
    "4 x 4 A40, 25 GbE": dict(ranks=16, ranks_per_node=4, intra_gbps=200, inter_gbps=25,
                              intra_latency_us=10, latency_us=30, tflops=150, mem_gbs=600),
    "32 x 1 A100, 10 GbE": dict(ranks=32, ranks_per_node=1, intra_gbps=10, inter_gbps=10,
                                intra_latency_us=50, latency_us=50, tflops=312, mem_gbs=1400),
}
MODELS = {"GPT-2 124M": 124e6, "GPT-2 1.3B": 1.3e9, "7B": 7e9}
TOKENS_PER_RANK = 8192  # tokens per GPU per step (8 x 1024)
MFU = 0.40  # fraction of the GPU's dense bf16 peak that training reaches
JITTER_FRACTION = 0.05  # uniform extra delay up to 5% of fwd + bwd per rank and step


def cluster_inputs(cluster: dict, params: float) -> dict:
    """predict() inputs: compute = 6 P T FLOPs per step at MFU of the peak (fwd 1/3, bwd 2/3);
    optimizer 28.5 bytes per parameter at the memory bandwidth (one fused D-Lion step); bf16
    gradients on the wire for the bf16 all-reduce only (fp32 gradients and parameters
    otherwise)."""
    c = dict(cluster)
    flops = 6 * params * TOKENS_PER_RANK
    compute_ms = flops / (c.pop("tflops") * 1e12 * MFU) * 1e3
    return {**c, "fwd_ms": compute_ms / 3, "bwd_ms": 2 * compute_ms / 3,
            "jitter_ms": JITTER_FRACTION * compute_ms, "jitter_dist": "uniform"}


def clusters_table() -> tuple[list[dict], str]:
    out = []
    for cname, cluster in CLUSTERS.items():
        for mname, params in MODELS.items():
            inputs = cluster_inputs(cluster, params)
            rows = {r.strategy: r for r in model.predict(
                params, inputs.pop("ranks"), inputs.pop("ranks_per_node"), **inputs)}
            best_name = model.best(list(rows.values()))
            dec = min((r for r in rows.values() if r.options.get("kind") == "decentralized"),
                      key=lambda r: r.step_ms)
            hier = rows.get("dlion-vote-hier-overlap")
            out.append({
                "cluster": cname, "model": mname, "fwd_ms": inputs["fwd_ms"],
                "bwd_ms": inputs["bwd_ms"], "fastest": best_name,
                "fastest_ms": rows[best_name].step_ms,
                "allreduce_fp32_ms": rows["lion-allreduce"].step_ms,
                "allreduce_bf16_ms": rows["lion-allreduce-bf16"].step_ms,
                "dlion_overlap_ms": rows["dlion-vote-overlap"].step_ms,
                "dlion_hier_overlap_ms": hier.step_ms if hier else None,
                "decentralized_best": dec.options["topology"],
                "decentralized_ms": dec.step_ms,
                "speedup_vs_fp32": rows["lion-allreduce"].step_ms / rows[best_name].step_ms})
    text = common.markdown_table(out, [
        ("cluster", "cluster"), ("model", "model"), ("fwd_ms", "fwd ms", ".1f"),
        ("bwd_ms", "bwd ms", ".1f"), ("allreduce_fp32_ms", "all-reduce fp32", ".1f"),
        ("allreduce_bf16_ms", "all-reduce bf16", ".1f"),
        ("dlion_overlap_ms", "D-Lion overlap", ".1f"),
        ("dlion_hier_overlap_ms", "hier. D-Lion overlap", ".1f"),
        ("decentralized_ms", "best gossip", ".1f"), ("decentralized_best", "its topology"),
        ("fastest", "fastest"), ("speedup_vs_fp32", "x fp32", ".2f")])
    return out, text


# ----------------------------------------------------------------------------- output


def report(result: dict) -> str:
    s = result["summary"]
    lines = ["## Predicted against measured step times", ""]
    lines.append(common.markdown_table(result["rows"], [
        ("config", "configuration"), ("strategy", "strategy"), ("role", "role"),
        ("predicted_ms", "predicted ms", ".1f"), ("measured_ms", "measured ms", ".1f"),
        ("error_pct", "error %", "+.1f")]))
    lines += ["", "## Fastest strategy per configuration", ""]
    lines.append(common.markdown_table(result["fastest"], [
        ("config", "configuration"), ("predicted_fastest", "predicted fastest"),
        ("measured_fastest", "measured fastest"),
        ("predicted_fastest_measured_ms", "its measured ms", ".1f"),
        ("measured_fastest_ms", "fastest measured ms", ".1f"), ("ok", "within 5%")]))
    fit = s["fitted"]
    lines += ["", "## Targets", "",
              f"- validation rows: {s['validation_rows']} in {s['configurations']} "
              f"configurations" + (
                  f"; fitted on the calibration rows (collectives alone) only: latency "
                  f"{fit['latency_us']:g} us, host rate per rank count (GB/s) "
                  + ", ".join(f"n={k}: {v:.3g}" if v else f"n={k}: none"
                              for k, v in fit["cpu_gbs"].items()) if fit else ""),
              _target("median absolute error", s["median_abs_error"], TARGET_MEDIAN, "<="),
              _target("worst absolute error", s["worst_abs_error"], TARGET_WORST, "<="),
              _target("predicted-fastest is measured-fastest or within 5%",
                      s["fastest_agreement"], TARGET_FASTEST, ">=")]
    return "\n".join(lines) + "\n"


def _target(what, value, bound, op) -> str:
    if value != value:  # NaN: nothing to judge
        return f"- {what}: not measured"
    ok = value <= bound if op == "<=" else value >= bound
    return f"- {what}: {100 * value:.1f}% (target {op} {100 * bound:.0f}%): " \
           f"{'PASS' if ok else 'FAIL'}"


def plot(result: dict, out_dir: str):
    plt = common.pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 6))
    rows = result["rows"]
    families = sorted({r["strategy"] for r in rows})
    markers = "os^vD<>pP*hX"
    for k, fam in enumerate(families):
        for role, fill in (("validate", True), ("calibrate", False)):
            pts = [r for r in rows if r["strategy"] == fam and r["role"] == role]
            if not pts:
                continue
            ax.scatter([r["measured_ms"] for r in pts], [r["predicted_ms"] for r in pts],
                       marker=markers[k % len(markers)], s=40,
                       facecolors=f"C{k}" if fill else "none", edgecolors=f"C{k}",
                       label=fam + ("" if fill else " (calibration)"), zorder=3)
    lo = min(min(r["measured_ms"], r["predicted_ms"]) for r in rows) * 0.7
    hi = max(max(r["measured_ms"], r["predicted_ms"]) for r in rows) * 1.4
    xs = [lo, hi]
    ax.plot(xs, xs, "k-", lw=1)
    ax.fill_between(xs, [x * (1 - TARGET_MEDIAN) for x in xs],
                    [x * (1 + TARGET_MEDIAN) for x in xs], color="0.88", label="±15%", zorder=0)
    ax.set_xscale("log")
    ax.set_yscale("log")
    common.log_ms_axis(ax.xaxis)
    common.log_ms_axis(ax.yaxis)
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured step ms (slowest rank, median)")
    ax.set_ylabel("predicted step ms (dlion_kernels.plan)")
    s = result["summary"]
    ax.set_title(f"runtime model: median |error| {100 * s['median_abs_error']:.1f}%, "
                 f"worst {100 * s['worst_abs_error']:.1f}%", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    return common.save_figure(fig, out_dir, "bench_plan")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measured", nargs="+",
                        help="JSON files of measured steps (formats in the docstring)")
    parser.add_argument("--calibrate", nargs="+", default=[],
                        help="JSON files whose calibration rows only are used (e.g. a "
                             "bench_network.json for a bench_training.json)")
    parser.add_argument("--clusters", action="store_true",
                        help="print the predictions for the README's clusters instead")
    parser.add_argument("--out", default=None, help="results folder")
    parser.add_argument("--compute", choices=["no-comm", "own-forward"], default="no-comm",
                        help="bench_training: compute from no_comm's phases, or scaled by each "
                             "variant's own forward time (load that changes between variants)")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    if args.clusters:
        rows, text = clusters_table()
        print(text)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            common.save(args.out, "clusters", rows, common.metadata({
                "benchmark": "bench_plan --clusters", "clusters": CLUSTERS,
                "tokens_per_rank": TOKENS_PER_RANK, "mfu": MFU,
                "jitter_fraction": JITTER_FRACTION}))
            common.save_text(args.out, "clusters.md", text)
        return 0
    if not args.measured:
        parser.error("--measured FILE.json is required (or --clusters)")
    rows = [r for path in args.measured for r in load(path, args.compute)]
    rows += [r for path in args.calibrate for r in load(path) if r.get("role") == "calibrate"]
    if not rows:
        parser.error("no measured rows found in " + ", ".join(args.measured))
    result = validate(rows)
    out = common.results_dir("plan", args.out)
    meta = common.metadata({"benchmark": "bench_plan", "sources": args.measured,
                            "calibration_sources": args.calibrate,
                            "compute": args.compute})
    common.save(out, "bench_plan", result["rows"], meta, fastest=result["fastest"],
                summary=result["summary"])
    text = report(result)
    common.save_text(out, "bench_plan.md", text)
    common.plot_unless(args.no_plot, lambda: plot(result, out))
    print(text)
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
