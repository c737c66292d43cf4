"""The main job: data-parallel training on several workers, D-Lion against all-reduce optimizers.

    python -m dlion_kernels.demo                     # 4 gloo workers on this machine's CPU
    torchrun --nproc-per-node 8 -m dlion_kernels.demo   # one NCCL worker per GPU

Trains a small MLP on scikit-learn's handwritten digits (shipped with the package: nothing is
downloaded), each worker on its own shard of the training set, with four optimizers in turn on the
same split and the same initial weights:

- D-Lion vote:     DistributedLion(mode="vote"), 1 bit up and 1 bit down per parameter
- D-Lion average:  DistributedLion(mode="average")
- Lion + all-reduce:  fp32 gradient all-reduce, then plain Lion
- AdamW + all-reduce: fp32 gradient all-reduce, then AdamW

and prints test accuracy, bytes sent per rank per step and wall time. ``--hierarchy L`` adds
hierarchical D-Lion (vote and average) over nodes of L consecutive workers: exact gradient mean
inside a node, the nodes vote.
Decentralized training (seed 2, SPEC §7) runs beside them with ``--strategy decentralized``:

    python -m dlion_kernels.demo --strategy decentralized --topology ring --optimizer accum-adamw

trains with ``DecentralizedDataParallel`` (gossip on the topology, a full iteration of overlap;
the test accuracy is that of the parameters averaged over all ranks) and compares it with AdamW +
all-reduce and D-Lion vote on the same split and initial weights.
``--strategy auto`` lets the runtime model (``dlion_kernels.plan``) pick: the workers calibrate
their links, collectives and compute (a few seconds), print the predicted step of every strategy
the demo can run, and train the fastest.

``--task chars`` runs the other task instead, a character-level transformer on the standard
library's source (``dlion_kernels/demo/chars.py``; ``--task chars --help`` for its options).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist

from dlion_kernels import topologies
from dlion_kernels.decentralized.topology import local_world_size

from .common import (
    DECENTRALIZED_OPTIMIZERS,
    TASKS,
    Hyper,
    Strategy,
    launch,
    plan_strategy,
    same_on_all_ranks,
    task_of,
)

OPTIMIZERS = ("D-Lion vote", "D-Lion average", "Lion + all-reduce", "AdamW + all-reduce")
STRATEGIES = ("all-reduce", "decentralized", "auto")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m dlion_kernels.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=TASKS, default="digits",
                    help="digits: this MLP (default); chars: the character-level transformer "
                    "(its own options: --task chars --help)")
    ap.add_argument("--workers", type=int, default=4, help="processes to start (ignored under "
                    "torchrun, which starts them)")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=16, help="per worker")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--lion-lr", type=float, default=3e-4)
    ap.add_argument("--adamw-lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=1e-2)
    ap.add_argument("--backend", default=None, help="dlion_kernels backend (default: auto)")
    ap.add_argument("--hierarchy", type=int, metavar="L", default=None,
                    help="also train hierarchical D-Lion over nodes of L workers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", metavar="FILE.png", help="draw the training-loss curves")
    ap.add_argument("--quiet", action="store_true", help="no per-epoch progress lines")
    ap.add_argument("--strategy", choices=STRATEGIES, default="all-reduce",
                    help="all-reduce: the four optimizers above (default); decentralized: "
                    "DecentralizedDataParallel against AdamW + all-reduce and D-Lion vote; "
                    "auto: the runtime model picks one (--hierarchy L lets it consider nodes of "
                    "L workers) and only that one trains")
    ap.add_argument("--topology", default="ring",
                    choices=("complete", "ring", "one-peer-exp", "alternating-exp-ring"),
                    help="gossip topology of --strategy decentralized")
    ap.add_argument("--optimizer", choices=DECENTRALIZED_OPTIMIZERS, default="accum-adamw",
                    help="per-bucket optimizer of --strategy decentralized")
    ap.add_argument("--accum-steps", type=int, default=None,
                    help="K of AccumAdamW / AccumLion (default: the number of workers, as the "
                    "paper scales it)")
    args = ap.parse_args(argv)
    if args.workers < 1 or args.epochs < 1 or args.batch_size < 1:
        ap.error("--workers, --epochs and --batch-size must be >= 1")
    if args.hierarchy is not None and args.hierarchy < 1:
        ap.error("--hierarchy must be >= 1")
    return args


def optimizer_names(args) -> tuple:
    """The rows of the comparison: OPTIMIZERS (with --strategy decentralized: AdamW + all-reduce,
    D-Lion vote and the decentralized run), then the hierarchical variants if asked for."""
    names = OPTIMIZERS
    if args.strategy == "decentralized":
        names = ("AdamW + all-reduce", "D-Lion vote",
                 f"Decentralized {args.topology} {args.optimizer}")
    if args.hierarchy is None:
        return names
    return names + tuple(f"D-Lion {m}, hierarchy {args.hierarchy}"
                              for m in ("vote", "average"))


def choose_auto(args, n, rank) -> str:
    """--strategy auto: the demo strategy the runtime model predicts fastest on these workers.
    Collective (every worker calibrates, rank 0's inputs go to all, all decide alike)."""
    from dlion_kernels import plan
    from dlion_kernels.plan import auto
    from dlion_kernels.plan.__main__ import table

    if n < 2:
        raise SystemExit("--strategy auto needs at least 2 workers (it times the links)")
    L = args.hierarchy or 1
    candidates = ["AdamW + all-reduce"]
    for m in ("vote", "average"):
        candidates += [f"D-Lion {m}", f"D-Lion {m}, overlap"]
        if L > 1:
            candidates.append(f"D-Lion {m}, hierarchy {L}")
    candidates += [f"Decentralized {t} {args.optimizer}" for t in topologies.TOPOLOGIES
                   if topologies.problem(t, n, L) is None]
    names = {plan_strategy(c): c for c in candidates}  # the model's row -> the demo's name
    numel = sum(p.numel() for p in make_model(args.hidden, args.seed).parameters())
    inputs = auto.job_inputs(numel, ranks_per_node=L)
    n_, L_ = inputs.pop("ranks"), inputs.pop("ranks_per_node")
    inputs.update(modes=("vote", "average"), bucket_mb=0.25)  # the demo's gossip buckets
    predicted = [r for r in plan.predict(numel, n_, L_, **inputs) if r.strategy in names]
    chosen = predicted[0]  # fastest first
    if rank == 0:
        print(f"runtime model, {numel:,} parameters on {n} workers (L = {L}):\n"
              f"{table(predicted)}\nchosen: {chosen.strategy} -> {names[chosen.strategy]}",
              flush=True)
    return names[chosen.strategy]


def load_digits(seed: int):
    """scikit-learn's 8x8 digits, standardized, split 80/20 with a fixed seed."""
    from sklearn.datasets import load_digits as sk_digits

    data = sk_digits()
    x = torch.tensor(data.data, dtype=torch.float32)
    y = torch.tensor(data.target, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    cut = int(0.8 * len(x))
    mean, std = x[:cut].mean(0), x[:cut].std(0) + 1e-3
    x = (x - mean) / std
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])


def make_model(hidden: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden), torch.nn.GELU(),
        torch.nn.Linear(hidden, hidden), torch.nn.GELU(),
        torch.nn.Linear(hidden, 10),
    )


def hyper(args, n) -> Hyper:
    return Hyper(lion_lr=args.lion_lr, adamw_lr=args.adamw_lr, weight_decay=args.weight_decay,
                 backend=args.backend, accum_steps=args.accum_steps, bucket_mb=0.25,
                 ranks_per_node=local_world_size(1 if args.topology != "alternating-exp-ring"
                                                 else n))


def train_one(name, args, rank, n, device, solo_group, data):
    (x_train, y_train), (x_test, y_test) = data
    model = make_model(args.hidden, args.seed).to(device)
    strategy = Strategy(name, model, n, hyper(args, n), solo_group)

    losses = []
    start = time.perf_counter()
    for epoch in range(args.epochs):
        # Same permutation on every rank, each rank takes its own shard of it.
        perm = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch))
        mine = perm[rank::n]
        total = torch.zeros(2, device=device)
        for i in range(0, len(mine) - args.batch_size + 1, args.batch_size):
            idx = mine[i : i + args.batch_size]
            xb, yb = x_train[idx].to(device), y_train[idx].to(device)
            loss = torch.nn.functional.cross_entropy(strategy.forward(xb), yb)
            strategy.step(loss)
            total[0] += loss.detach() * len(idx)
            total[1] += len(idx)
        if n > 1:
            dist.all_reduce(total)  # logging only, not part of the bytes
        losses.append((total[0] / total[1]).item())
        if rank == 0 and not args.quiet:
            print(f"  [{name:18s}] epoch {epoch + 1:3d}/{args.epochs}  train loss "
                  f"{losses[-1]:.4f}", flush=True)
    strategy.finish()
    wall = time.perf_counter() - start
    # Decentralized ranks hold different parameters: evaluate (and check) their average.
    with strategy.evaluation(), torch.no_grad():
        acc = (model(x_test.to(device)).argmax(1).cpu() == y_test).float().mean().item()
        in_sync = same_on_all_ranks(model, n)
    return {
        "optimizer": name, "test_accuracy": acc, "bytes_per_step": strategy.bytes_per_step,
        "steps": strategy.steps, "wall_s": wall, "losses": losses, "ranks_in_sync": in_sync,
        "inter_node_bytes_per_step": strategy.inter_node_bytes,
        "numel": sum(p.numel() for p in model.parameters()), "workers": n,
    }


def run(rank, n, args, device):
    """The whole comparison on one rank (process group already set up); rank 0 returns rows."""
    data = load_digits(args.seed)
    solo_groups = [dist.new_group([r]) for r in range(n)] if n > 1 else [None]
    solo = solo_groups[rank] if n > 1 else None
    rows = []
    names = (choose_auto(args, n, rank),) if args.strategy == "auto" else optimizer_names(args)
    for name in names:
        if rank == 0 and not args.quiet:
            print(f"training with {name} on {n} worker(s)", flush=True)
        rows.append(train_one(name, args, rank, n, device, solo, data))
    return rows


def format_table(rows, n) -> str:
    fp32 = next((r["bytes_per_step"] for r in rows if r["optimizer"].endswith("all-reduce")),
                None)
    lines = [
        (f"| optimizer ({n} workers) | test accuracy | bytes sent / rank / step | vs fp32 "
        "all-reduce | wall time (s) |"),
        "|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"1/{fp32 / r['bytes_per_step']:.1f}" if r["bytes_per_step"] and fp32 else "-"
        if r["bytes_per_step"] == fp32:
            ratio = "1"
        lines.append(f"| {r['optimizer']} | {100 * r['test_accuracy']:.1f}% | "
                     f"{r['bytes_per_step']:,} | {ratio} | {r['wall_s']:.1f} |")
    return "\n".join(lines)


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit(f"--plot needs matplotlib (pip install matplotlib): {e}") from e
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["optimizer"])
    ax.set(xlabel="epoch", ylabel="training loss (mean over workers)", yscale="log",
           title="Digits MLP, data-parallel")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report(rows, n, args):
    print()
    print(format_table(rows, n))
    for r in rows:
        if r.get("inter_node_bytes_per_step") is not None:
            print(f"{r['optimizer']}: of which between nodes {r['inter_node_bytes_per_step']:,} "
                  "bytes / rank / step")
    if not all(r["ranks_in_sync"] for r in rows):
        print("WARNING: ranks ended with different parameters", file=sys.stderr)
    if args.plot:
        plot(rows, args.plot)
        print(f"loss curves written to {args.plot}")


def main(argv=None):
    if task_of(argv) not in (None, "digits"):
        from . import chars

        return chars.main(argv)
    args = parse_args(argv)
    rows = launch(run, args.workers, args)
    if rows is not None:  # rank 0 (every rank but 0 returns None under torchrun)
        report(rows, rows[0]["workers"], args)
    return rows


if __name__ == "__main__":
    main()
