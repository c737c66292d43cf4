"""The main job: data-parallel training on several workers, D-Lion against all-reduce optimizers.

    python -m dlion_kernels.demo                     # 4 gloo workers on this machine's CPU
    torchrun --nproc-per-node 8 -m dlion_kernels.demo   # one NCCL worker per GPU

Trains a small MLP on scikit-learn's handwritten digits (shipped with the package: nothing is
downloaded), each worker on its own shard of the training set, with each strategy in turn on the
same split and the same initial weights (``--strategy``, slugs of ``dlion_kernels/strategies.py``;
by default these four):

- dlion-vote:      DistributedLion(mode="vote"), 1 bit up and 1 bit down per parameter
- dlion-average:   DistributedLion(mode="average")
- lion-allreduce:  fp32 gradient all-reduce (DDP), then plain Lion
- adamw-allreduce: fp32 gradient all-reduce (DDP), then AdamW

and prints test accuracy, bytes sent per rank per step and wall time. Any other strategy runs
the same way, for example hierarchical D-Lion over nodes of L consecutive workers (exact gradient
mean inside a node, the nodes vote) or decentralized training (gossip on a topology, a full
iteration of overlap; the test accuracy is that of the parameters averaged over all ranks):

    python -m dlion_kernels.demo --strategy dlion-vote dlion-vote-hier --ranks-per-node 2
    python -m dlion_kernels.demo --strategy adamw-allreduce decentralized-ring-accum-adamw

``--strategy auto`` lets the runtime model (``dlion_kernels.plan``) pick: the workers calibrate
their links, collectives and compute (a few seconds), print the predicted step of every strategy
the model predicts that can run here, and train the fastest.

``--task chars`` runs the other task instead, a character-level transformer on the standard
library's source (``dlion_kernels/demo/chars.py``; ``--task chars --help`` for its options).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist

from dlion_kernels import strategies
from dlion_kernels.recipes import build

from .common import (
    AUTO,
    add_common_args,
    allreduce_fp32_bytes,
    check_common_args,
    choose_auto,
    launch,
    ranks_per_node,
    same_on_all_ranks,
    settings,
    strategy_names,
)

DEFAULT_STRATEGIES = ("dlion-vote", "dlion-average", "lion-allreduce", "adamw-allreduce")
BUCKET_MB = 0.25  # DDP's, D-Lion overlap's and the gossip's buckets: several for this MLP


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m dlion_kernels.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, "digits", DEFAULT_STRATEGIES, lion_lr=3e-4, adamw_lr=3e-3)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=16, help="per worker")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", metavar="FILE.png", help="draw the training-loss curves")
    args = ap.parse_args(argv)
    check_common_args(ap, args)
    if args.epochs < 1 or args.batch_size < 1:
        ap.error("--epochs and --batch-size must be >= 1")
    return args


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


def train_one(name, args, rank, n, device, data):
    (x_train, y_train), (x_test, y_test) = data
    model = make_model(args.hidden, args.seed).to(device)
    built = build(name, model, settings(args, n, BUCKET_MB))

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
            built.zero_grad()
            loss = torch.nn.functional.cross_entropy(built(xb), yb)
            loss.backward()
            built.step()
            total[0] += loss.detach() * len(idx)
            total[1] += len(idx)
        if n > 1:
            dist.all_reduce(total)  # logging only, not part of the bytes
        losses.append((total[0] / total[1]).item())
        if rank == 0 and not args.quiet:
            print(f"  [{name}] epoch {epoch + 1:3d}/{args.epochs}  train loss "
                  f"{losses[-1]:.4f}", flush=True)
    built.finish()
    wall = time.perf_counter() - start
    # Decentralized ranks hold different parameters: evaluate (and check) their average.
    with built.evaluation(), torch.no_grad():
        acc = (model(x_test.to(device)).argmax(1).cpu() == y_test).float().mean().item()
        in_sync = same_on_all_ranks(model, n)
    return {
        "strategy": name, "label": strategies.get(name).label, "test_accuracy": acc,
        "bytes_per_step": built.bytes_per_step, "steps": built.steps, "wall_s": wall,
        "losses": losses, "ranks_in_sync": in_sync,
        "inter_node_bytes_per_step": built.inter_node_bytes_per_step,
        "numel": sum(p.numel() for p in model.parameters()), "workers": n,
        "ranks_per_node": ranks_per_node(args, n),
    }


def run(rank, n, args, device):
    """The whole comparison on one rank (process group already set up); rank 0 returns rows."""
    data = load_digits(args.seed)
    if args.strategy == [AUTO]:
        numel = sum(p.numel() for p in make_model(args.hidden, args.seed).parameters())
        names = [choose_auto(args, n, rank, numel, BUCKET_MB)]
    else:
        names, skipped = strategy_names(args, n)
        if rank == 0:
            for name, reason in skipped:
                print(f"skipping {name}: {reason}", flush=True)
    rows = []
    for name in names:
        if rank == 0 and not args.quiet:
            print(f"training with {name} on {n} worker(s)", flush=True)
        rows.append(train_one(name, args, rank, n, device, data))
    return rows


def format_table(rows, n) -> str:
    fp32 = allreduce_fp32_bytes(rows[0]["numel"], n)
    lines = [
        (f"| strategy ({n} workers) | test accuracy | bytes sent / rank / step | vs fp32 "
         "all-reduce | wall time (s) |"),
        "|---|---|---|---|---|",
    ]
    for r in rows:
        b = r["bytes_per_step"]
        ratio = "1" if b == fp32 else (f"1/{fp32 / b:.1f}" if b else "-")
        lines.append(f"| {r['label']} | {100 * r['test_accuracy']:.1f}% | {b:,} | {ratio} | "
                     f"{r['wall_s']:.1f} |")
    if any(strategies.get(r["strategy"]).nodes for r in rows):
        lines.append(f"\nNodes of {rows[0]['ranks_per_node']} workers.")
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
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["label"])
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
            print(f"{r['label']}: of which between nodes {r['inter_node_bytes_per_step']:,} "
                  "bytes / rank / step")
    if not all(r["ranks_in_sync"] for r in rows):
        print("WARNING: ranks ended with different parameters", file=sys.stderr)
    if args.plot:
        plot(rows, args.plot)
        print(f"loss curves written to {args.plot}")


def main(argv=None):
    args = parse_args(argv)
    rows = launch(run, args.workers, args)
    if rows:  # rank 0 (every rank but 0 returns None under torchrun)
        report(rows, rows[0]["workers"], args)
    return rows
