"""``python -m dlion_kernels.plan``: which strategy is fastest on this cluster?

    python -m dlion_kernels.plan --params 124M --ranks 32 --ranks-per-node 8 --inter-gbps 25 \\
        --intra-gbps 1600 --latency-us 30 --fwd-ms 80 --bwd-ms 160 [--jitter-ms 10] [--json]
    torchrun --nproc-per-node 4 -m dlion_kernels.plan --measure --params 124M

Prints the predicted step of every strategy (by its slug, ``dlion_kernels/strategies.py``),
fastest first, and names the fastest. The ``diloco-*`` rows (local steps) come last in the table:
their times are per inner step, and they are not ranked against the others. ``--json`` prints
``{"rows": [...], "best": "<strategy>", "inputs": {...}}``: the rows as ``predict`` returns
them (all fastest first), ``best`` the fastest per-step row, as the table's "fastest:" line.
``--measure`` calibrates the links, the collectives and the compute on the running group first
(only that path imports torch).
"""

from __future__ import annotations

import argparse
import json
import sys

from ..accounting import BUCKET_MB
from ..topologies import TOPOLOGIES
from .model import (
    ALGORITHMS,
    JITTER_DISTS,
    MODES,
    DEFAULT_INTRA_GBPS,
    OPT_BYTES_PER_PARAM,
    best,
    parse_size,
    per_inner_step,
    predict,
)

COLUMNS = [  # (header, row field, scale, format)
    ("strategy", "strategy", None, "{}"),
    ("step ms", "step_ms", 1, "{:.1f}"),
    ("compute ms", "compute_ms", 1, "{:.1f}"),
    ("wait ms", "wait_ms", 1, "{:.1f}"),
    ("comm ms", "comm_ms", 1, "{:.1f}"),
    ("exposed ms", "exposed_comm_ms", 1, "{:.1f}"),
    ("MB/rank", "bytes_per_rank", 1e-6, "{:.2f}"),
    ("intra MB", "intra_bytes_per_rank", 1e-6, "{:.2f}"),
    ("inter MB", "inter_bytes_per_rank", 1e-6, "{:.2f}"),
    ("buckets", "buckets", None, "{}"),
    ("mem MB", "memory_bytes_per_rank", 1e-6, "{:.1f}"),
]

LEGEND = """\
step ms: predicted time of one training step (slowest rank); compute ms: fwd + bwd + optimizer
of one rank; wait ms: expected wait for the slowest rank it synchronises with (all n, or the
gossip group); comm ms: all its collectives back to back; exposed ms: the part of comm ms the
step waits for (the rest hides behind backward, or a whole iteration for gossip); MB/rank: bytes
each rank sends per step (10^6), split into intra-node and inter-node links; mem MB: what a rank
holds for parameters, gradients and optimizer state (- where the strategy's optimizer decides).
diloco-* (last, not ranked): per inner step of local-step training, one sync's communication and
outer step divided by the H / P inner steps between syncs."""


def when_local_steps_pay(fastest, local, sync_every: int) -> str:
    """One line: how much faster per step the quickest local-step row is than the fastest
    per-step row, hence how many more steps to a target loss local steps may take and still
    pay."""
    quick = min(local, key=lambda r: r.step_ms)
    ratio = fastest.step_ms / quick.step_ms
    if ratio <= 1.0:
        return (f"when local steps pay: not here ({quick.strategy}, the quickest, takes "
                f"{quick.step_ms:.1f} ms per inner step, no less than {fastest.strategy}'s "
                f"{fastest.step_ms:.1f} ms per step)")
    return (f"when local steps pay: {quick.strategy} takes {ratio:.2f}x less time per inner "
            f"step than {fastest.strategy} per step, so it pays if H = {sync_every} local steps "
            f"reach the target loss in fewer than {ratio:.2f}x as many steps")


def table(rows) -> str:
    """Markdown table of rows (Row objects or dicts)."""
    dicts = [r if isinstance(r, dict) else r.as_dict() for r in rows]
    head = "| " + " | ".join(h for h, *_ in COLUMNS) + " |"
    sep = "|" + "|".join("---" if f == "strategy" else "---:" for _, f, *_ in COLUMNS) + "|"
    lines = [head, sep]
    for d in dicts:
        cells = ["-" if d.get(f) is None else fmt.format(d[f] * s if s else d[f])
                 for _, f, s, fmt in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _size(name):
    def parse(text):
        try:
            return parse_size(text, name)
        except (ValueError, TypeError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


def _list(allowed, name):
    def parse(text):
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{name}: unknown {bad}; allowed: "
                                             f"{', '.join(allowed)}")
        return items
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dlion_kernels.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=_size("--params"), required=True,
                   help="parameter count, suffixes K, M, G (or B), T as powers of ten "
                   "(124M, 1.3B)")
    p.add_argument("--ranks", type=int, help="n, total ranks (with --measure: the world size)")
    p.add_argument("--ranks-per-node", type=int, help="L, ranks per node (default 1; with "
                   "--measure: measured)")
    p.add_argument("--inter-gbps", type=float, help="each node's link to the others, Gbit/s")
    p.add_argument("--intra-gbps", type=float,
                   help="each rank's link inside its node, Gbit/s (default with "
                   f"--ranks-per-node > 1: {DEFAULT_INTRA_GBPS:g}, NVLink-class, 300 GB/s per "
                   "direction as on A100; H100's NVLink is 3600, PCIe 4.0 about 200; --measure "
                   "times it)")
    p.add_argument("--latency-us", type=float, help="inter-node latency per message (30)")
    p.add_argument("--intra-latency-us", type=float,
                   help="intra-node latency per message (default min(5, --latency-us))")
    p.add_argument("--fwd-ms", type=float, help="forward time per step and rank")
    p.add_argument("--bwd-ms", type=float, help="backward time per step and rank")
    p.add_argument("--opt-ms", type=float, help="one optimizer pass over all parameters "
                   f"(default: {OPT_BYTES_PER_PARAM:g} bytes per parameter, one fused D-Lion "
                   "step, at --mem-gbs)")
    p.add_argument("--mem-gbs", type=float, default=1000.0,
                   help="memory bandwidth in GB/s for the default --opt-ms (1000)")
    p.add_argument("--jitter-ms", type=float, help="extra compute delay per rank and step (0)")
    p.add_argument("--jitter-dist", choices=JITTER_DISTS, help="uniform on [0, jitter] "
                   "(default) or normal with sigma = jitter")
    p.add_argument("--cpu-gbs", type=float, help="host processing rate per rank, GB/s, for "
                   "the bytes a collective sends or sums (default: free, as with NCCL/RDMA)")
    p.add_argument("--bucket-mb", type=float, default=BUCKET_MB,
                   help=f"bucket size, MB ({BUCKET_MB:g})")
    p.add_argument("--tensors", type=int, default=1, help="tensor count, for padding (1)")
    p.add_argument("--grad-dtype", default="fp32", help="gradient dtype (fp32)")
    p.add_argument("--param-dtype", default="fp32", help="parameter dtype (fp32)")
    p.add_argument("--gossip-dtype", default="fp32", help="decentralized gossip dtype (fp32)")
    p.add_argument("--algorithm", choices=ALGORITHMS,
                   help="all-reduce algorithm: auto = faster of ring and tree (NCCL); ring "
                        "(gloo). Default auto, ring with --measure on gloo")
    p.add_argument("--modes", type=_list(MODES, "--modes"), default=["vote"],
                   help="D-Lion modes to list, comma separated (vote)")
    p.add_argument("--topologies", type=_list(TOPOLOGIES, "--topologies"),
                   help="decentralized topologies (default: every one that fits)")
    p.add_argument("--sync-every", type=int, default=8,
                   help="diloco-* rows: H, inner steps between two syncs of a fragment (8)")
    p.add_argument("--fragments", type=int, default=1, help="diloco-* rows: P fragments (1)")
    p.add_argument("--overlap-steps", type=int, default=0,
                   help="diloco-* rows: tau, inner steps a sync runs behind (0)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--measure", action="store_true",
                   help="calibrate on the running torchrun group, then predict")
    p.add_argument("--reps", type=int, default=3, help="--measure: repetitions per timing (3)")
    return p


INPUT_NAMES = ["ranks", "ranks_per_node", "inter_gbps", "intra_gbps", "latency_us",
               "intra_latency_us", "fwd_ms", "bwd_ms", "opt_ms", "jitter_ms", "jitter_dist",
               "algorithm"]


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    given = {k: getattr(args, k) for k in INPUT_NAMES if getattr(args, k) is not None}
    measured = {}
    if args.measure:
        import torch.distributed as dist

        from .measure import measure  # torch and the exchange: only here

        try:
            measured = measure(args.params, reps=args.reps,
                               ranks_per_node=given.get("ranks_per_node"))
        except ValueError as e:
            parser.error(str(e))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        if measured is None:  # not rank 0: the table is printed once
            return 0
    inputs = {"ranks_per_node": 1, "latency_us": 30.0, "jitter_ms": 0.0,
              "jitter_dist": "uniform", "algorithm": "auto"}
    inputs.update({k: v for k, v in measured.items() if k in INPUT_NAMES})
    inputs.update(given)  # what the user states wins over what was measured
    missing = [f"--{k.replace('_', '-')}" for k in ("ranks", "inter_gbps", "fwd_ms", "bwd_ms")
               if k not in inputs]
    if missing:
        parser.error(f"the following arguments are required (or use --measure under torchrun): "
                     f"{', '.join(missing)}")
    if "intra_gbps" not in inputs and inputs["ranks_per_node"] > 1:  # stated, as opt_ms
        inputs["intra_gbps"] = DEFAULT_INTRA_GBPS
    if "opt_ms" not in inputs and args.mem_gbs > 0:  # stated, so the output shows it
        inputs["opt_ms"] = args.params * OPT_BYTES_PER_PARAM / (args.mem_gbs * 1e9) * 1e3
    options = dict(mem_gbs=args.mem_gbs, cpu_gbs=args.cpu_gbs, bucket_mb=args.bucket_mb,
                   tensors=args.tensors,
                   grad_dtype=args.grad_dtype, param_dtype=args.param_dtype,
                   gossip_dtype=args.gossip_dtype, modes=args.modes, topologies=args.topologies,
                   calibration=measured.get("calibration"), sync_every=args.sync_every,
                   fragments=args.fragments, overlap_steps=args.overlap_steps)
    try:
        rows = predict(args.params, **inputs, **options)
    except (ValueError, TypeError) as e:
        parser.error(str(e))
    name = best(rows)  # per-step rows only: diloco-* rows are per inner step
    if args.json:
        out = {"rows": [r.as_dict() for r in rows], "best": name,
               "inputs": {"params": args.params, **inputs,
                          **{k: v for k, v in options.items() if k != "calibration"}}}
        if measured:
            out["measured"] = {k: (v.__dict__ if k == "calibration" else v)
                               for k, v in measured.items()}
        print(json.dumps(out, indent=2))
        return 0
    described = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                          for k, v in {"params": args.params, **inputs}.items())
    if measured:
        print("measured on this group: " + ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in measured.items() if k != "calibration"))
        cal = measured["calibration"]
        print("collective scales (latency, bandwidth): " + ", ".join(
            f"{k}=({cal.lat_scale[k]:.2f}, {cal.bw_scale[k]:.2f})" for k in cal.lat_scale))
    print(f"inputs: {described}")
    # local steps last: per inner step, not comparable with the others' training steps
    print(table([r for r in rows if not per_inner_step(r)] + [r for r in rows
                                                              if per_inner_step(r)]))
    fastest = next(r for r in rows if r.strategy == name)
    fp32 = next((r for r in rows if r.strategy == "lion-allreduce"), None)
    line = f"fastest: {name} ({fastest.step_ms:.1f} ms per step"
    if fp32 is not None and name != fp32.strategy:
        line += f"; {fp32.step_ms / fastest.step_ms:.2f}x faster than {fp32.strategy}"
    print(line + ")")
    local = [r for r in rows if per_inner_step(r) and r.strategy != name]
    if local:
        print("not ranked: " + ", ".join(
            f"{r.strategy} {r.step_ms:.1f} ms per inner step" for r in local)
            + f" (local steps, a sync every {args.sync_every} inner steps: a different "
            f"training, compare their loss too)")
        print(when_local_steps_pay(fastest, local, args.sync_every))
    print(LEGEND)
    return 0


if __name__ == "__main__":
    sys.exit(main())
