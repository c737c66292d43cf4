"""The second demo task: a small causal character-level transformer, trained data-parallel with
every strategy the library runs, on text that ships with Python (nothing is downloaded).

    python -m dlion_kernels.demo --task chars                  # 4 gloo workers on this CPU
    torchrun --nproc-per-node 4 -m dlion_kernels.demo --task chars

Data: the source of ten modules of Python's standard library (``STDLIB_FILES``, read from
``sysconfig.get_paths()["stdlib"]``), about 0.3 MB of characters. The last 10% of every file is
the validation text, the rest the training text. Characters are ASCII 32-126, newline and tab,
everything else one unknown id: a vocabulary of 98.

Model (``--d-model 64 --layers 2 --heads 4 --context 64``): pre-norm transformer blocks
(causal ``scaled_dot_product_attention``, a 4x GELU MLP), learned positions, about 0.11 M
parameters. Each iteration every worker takes its own ``--batch-size 8`` windows of the training
text (a global batch of 8 n windows drawn from a generator seeded by the seed and the iteration,
so every strategy sees the same data); the validation loss is the mean cross entropy over
``--eval-windows 64`` fixed windows of the validation text after ``--iters 120`` iterations.
These sizes are chosen so that the whole comparison (8 strategies x 3 seeds on 4 workers) runs
in about 4 minutes on an idle 2-core machine: one worker's iteration costs about 28 ms of CPU
(1 thread), so 4 workers on 2 cores take about 60-70 ms per iteration with the exchange, about
8 s per run, 24 runs. Larger sizes train further but take longer.

Strategies (rows; ``--strategy`` picks any of ``dlion_kernels/strategies.py``, or ``auto``),
each from the same initial weights per seed; by default:

- adamw-allreduce: fp32 gradient all-reduce (DDP), then AdamW (lr ``--adamw-lr``)
- dlion-vote, dlion-average: ``DistributedLion`` (lr ``--lion-lr``; seed 0, the default sizes:
  3e-3 reached validation loss 2.28, 1e-3 2.49; AdamW 2.30)
- dlion-vote-overlap: the exchange overlapped with backward (bit-identical to dlion-vote)
- dlion-vote-hier: exact gradient mean inside nodes of L = ``--ranks-per-node`` workers, the
  nodes vote
- fsdp-dlion, fsdp-allreduce (any ``--strategy``, not by default): FSDP2 shards every block,
  the embeddings, the final norm and the head over the ``--ranks-per-node`` workers of a node
  (a mesh of N replicas x L shards); the N replicas vote (D-Lion) or HSDP all-reduces their
  gradient shards (then Lion). Each worker holds 1/L of the parameters, gradients and momentum
- decentralized-<topology>-accum-adamw: ``DecentralizedDataParallel`` with ``AccumAdamW``
  (K = the number of workers, the AdamW learning rate, as the paper's recipe) on the ring,
  one-peer-exp and alternating-exp-ring (nodes of ``--ranks-per-node``) topologies; evaluated on
  the parameters averaged over the ranks (``global_average()``)

Not by default: diloco-dlion and diloco-nesterov (``DiLoCo``: local AdamW steps, lr
``--adamw-lr``, and every ``--sync-every`` H inner steps an outer step, D-Lion's vote or DiLoCo's
fp32 Nesterov, in ``--fragments`` P fragments), evaluated on theta_bar (the synced parameters);
e.g. ``--strategy diloco-dlion diloco-nesterov --sync-every 8 --fragments 1``: 15 syncs in the
default 120 iterations.

DDP's buckets, D-Lion's overlap buckets and the gossip buckets are all 0.125 MB.

The table gives per strategy the validation loss (mean and sample standard deviation over the
seeds), the bytes each rank sent per step (the mean over steps: alternating-exp-ring's groups
change size) and of those the bytes to other nodes where the strategy has nodes, the memory a
worker holds for parameters, gradients and optimizer state at the end (counted from the
tensors: a sharded parameter counts its shard), and the wall time of one training run (mean
over seeds).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import sysconfig
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

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

STDLIB_FILES = ("argparse.py", "textwrap.py", "functools.py", "contextlib.py", "heapq.py",
                "fractions.py", "shlex.py", "string.py", "pprint.py", "calendar.py")
VOCAB = 98  # ASCII 32..126 (95), "\n", "\t", unknown
UNKNOWN = VOCAB - 1
DEFAULT_STRATEGIES = (
    "adamw-allreduce",
    "dlion-vote",
    "dlion-average",
    "dlion-vote-overlap",
    "dlion-vote-hier",
    "decentralized-ring-accum-adamw",
    "decentralized-one-peer-exp-accum-adamw",
    "decentralized-alternating-exp-ring-accum-adamw",
)
BUCKET_MB = 0.125


def make_parser() -> argparse.ArgumentParser:
    """The chars task's options (``parse_args`` checks them; the elastic run adds its own)."""
    ap = argparse.ArgumentParser(prog="python -m dlion_kernels.demo --task chars",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Elastic training on torchft's quorum (a replica killed "
                                 "and restarted): --task chars --elastic --help")
    add_common_args(ap, "chars", DEFAULT_STRATEGIES, lion_lr=3e-3, adamw_lr=3e-3)
    ap.add_argument("--iters", type=int, default=120, help="training iterations per run")
    ap.add_argument("--batch-size", type=int, default=8, help="windows per worker per iteration")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--json", metavar="FILE", help="also write the per-seed rows and the table "
                    "rows as JSON")
    return ap


def check_args(ap: argparse.ArgumentParser, args) -> None:
    """argparse errors for the values the parser cannot check alone."""
    check_common_args(ap, args)
    for flag in ("iters", "batch_size", "context", "d_model", "heads", "layers",
                 "eval_windows"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.d_model % args.heads:
        ap.error("--d-model must be a multiple of --heads")


def parse_args(argv=None):
    ap = make_parser()
    args = ap.parse_args(argv)
    check_args(ap, args)
    return args


# ----------------------------------------------------------------------------- data


def _encode(text: str) -> torch.Tensor:
    table = torch.full((256,), UNKNOWN, dtype=torch.uint8)
    table[32:127] = torch.arange(95, dtype=torch.uint8)
    table[ord("\n")], table[ord("\t")] = 95, 96
    raw = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)
    return table[raw.long()]


def load_text(files=STDLIB_FILES) -> tuple[torch.Tensor, torch.Tensor]:
    """(train ids, validation ids) as uint8 tensors: the standard library files in order, the
    last 10% of each file to validation."""
    root = sysconfig.get_paths()["stdlib"]
    train, val = [], []
    for name in files:
        with open(os.path.join(root, name), encoding="utf-8") as f:
            ids = _encode(f.read())
        cut = int(0.9 * len(ids))
        train.append(ids[:cut])
        val.append(ids[cut:])
    return torch.cat(train), torch.cat(val)


def batch(ids: torch.Tensor, starts: torch.Tensor, context: int):
    """Inputs and next-character targets of the windows starting at ``starts``."""
    idx = starts[:, None] + torch.arange(context + 1)
    window = ids[idx].long()
    return window[:, :-1], window[:, 1:]


def train_starts(num_ids: int, seed: int, it: int, rank: int, n: int, size: int, context: int):
    """This rank's share of iteration it's global batch (the same global batch for every
    strategy; rank r takes windows r*size .. (r+1)*size - 1)."""
    gen = torch.Generator().manual_seed(1_000_003 * seed + it)
    starts = torch.randint(0, num_ids - context - 1, (n * size,), generator=gen)
    return starts[rank * size : (rank + 1) * size]


def val_starts(num_ids: int, windows: int, context: int) -> torch.Tensor:
    """Evenly spaced windows over the validation text."""
    last = num_ids - context - 1
    return torch.linspace(0, last, min(windows, last + 1)).round().long()


# ----------------------------------------------------------------------------- model


class Block(torch.nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x GELU MLP."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(),
                                       torch.nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class CharTransformer(torch.nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int, context: int):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Embedding(context, d)
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_model(args, seed: int) -> CharTransformer:
    torch.manual_seed(seed)
    return CharTransformer(VOCAB, args.d_model, args.heads, args.layers, args.context)


def _loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def val_loss(model, val, starts, context, device) -> float:
    x, y = batch(val, starts, context)
    return _loss(model(x.to(device)), y.to(device)).item()


# ----------------------------------------------------------------------------- training


def train_one(name, args, seed, rank, n, device, data):
    train, val = data
    model = make_model(args, seed).to(device)
    built = build(name, model, settings(args, n, BUCKET_MB))
    evals = val_starts(len(val), args.eval_windows, args.context)
    initial = val_loss(model, val, evals, args.context, device)
    recent = torch.zeros(2, device=device)  # training loss of the last 10% of the iterations
    start = time.perf_counter()
    for it in range(args.iters):
        x, y = batch(train, train_starts(len(train), seed, it, rank, n, args.batch_size,
                                         args.context), args.context)
        built.zero_grad()
        loss = _loss(built(x.to(device)), y.to(device))
        loss.backward()
        built.step()
        if it >= args.iters - max(1, args.iters // 10):
            recent += torch.stack([loss.detach(), torch.ones((), device=device)])
    wall = time.perf_counter() - start
    memory = built.memory()  # the last step's gradients are still held
    # Before the last mixing: decentralized ranks hold different parameters, the others not.
    differ = not same_on_all_ranks(model, n)
    tic = time.perf_counter()
    built.finish()
    wall += time.perf_counter() - tic
    if n > 1:
        dist.all_reduce(recent)  # logging only, not part of the bytes
    own = torch.tensor(val_loss(model, val, evals, args.context, device), device=device)
    if n > 1:
        dist.all_reduce(own)  # the mean over ranks of each rank's own loss
    with built.evaluation():  # decentralized: the parameters averaged over all ranks
        loss_val = val_loss(model, val, evals, args.context, device)
        eval_in_sync = same_on_all_ranks(model, n)
    wall_t = torch.tensor([wall], dtype=torch.float64)
    if n > 1:  # the slowest rank's time
        dist.all_reduce(wall_t, op=dist.ReduceOp.MAX)
    diloco = strategies.get(name).family == "diloco"
    label = strategies.get(name).label
    if diloco:
        label += f" (H = {args.sync_every}, P = {args.fragments})"
    return {
        "strategy": name, "label": label, "seed": seed,
        "val_loss": loss_val, "initial_val_loss": initial,
        "own_val_loss_mean": own.item() / n, "train_loss_end": (recent[0] / recent[1]).item(),
        "bytes_per_step": built.bytes_per_step, "steps": built.steps,
        "inter_node_bytes_per_step": built.inter_node_bytes_per_step, "wall_s": wall_t.item(),
        "ranks_differ": differ, "eval_in_sync": eval_in_sync, "memory": memory,
        "numel": sum(p.numel() for p in model.parameters()), "workers": n,
        "ranks_per_node": ranks_per_node(args, n),
        "sync_every": args.sync_every if diloco else None,
        "fragments": args.fragments if diloco else None,
    }


def run(rank, n, args, device):
    """Every strategy and seed on one rank (process group already set up); rank 0 gets rows."""
    # FSDP2 warns once per module class whose output is a view (Linear on 3-D input, the
    # model's logits): an in-place op on such an output would skip its backward hook. This
    # model and loop never write into an output.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w+\) returned a view",
                            category=UserWarning)
    data = load_text()
    if args.strategy == [AUTO]:
        numel = sum(p.numel() for p in make_model(args, args.seeds[0]).parameters())
        names = [choose_auto(args, n, rank, numel, BUCKET_MB)]
    else:
        names, skipped = strategy_names(args, n)
        if rank == 0:
            for name, reason in skipped:
                print(f"skipping {name}: {reason}", flush=True)
    rows = []
    for seed in args.seeds:
        for name in names:
            if rank == 0 and not args.quiet:
                print(f"seed {seed}: training with {name} on {n} worker(s)", flush=True)
            rows.append(train_one(name, args, seed, rank, n, device, data))
            if rank == 0 and not args.quiet:
                r = rows[-1]
                print(f"  validation loss {r['val_loss']:.4f} (from {r['initial_val_loss']:.4f})"
                      f", {r['wall_s']:.1f} s", flush=True)
    return rows


# ----------------------------------------------------------------------------- report


def summarize(rows) -> list[dict]:
    """One row per strategy, in the order run: mean and sample std over the seeds."""
    out = {}
    for r in rows:
        out.setdefault(r["strategy"], []).append(r)
    table = []
    for name, runs in out.items():
        losses = [r["val_loss"] for r in runs]
        table.append({
            "strategy": name, "label": runs[0]["label"], "seeds": [r["seed"] for r in runs],
            "val_loss_mean": statistics.fmean(losses),
            "val_loss_std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
            "bytes_per_step": round(statistics.fmean(r["bytes_per_step"] for r in runs)),
            "inter_node_bytes_per_step": runs[0]["inter_node_bytes_per_step"],
            "memory": runs[0].get("memory"),
            "wall_s": statistics.fmean(r["wall_s"] for r in runs),
            "ranks_differ": any(r["ranks_differ"] for r in runs),
            "eval_in_sync": all(r["eval_in_sync"] for r in runs)})
    return table


def format_table(table, rows) -> str:
    n, seeds = rows[0]["workers"], len(table[0]["seeds"])
    fp32 = allreduce_fp32_bytes(rows[0]["numel"], n)
    lines = [
        (f"| strategy ({n} workers, {rows[0]['steps']} iterations) | validation loss (mean ± std "
        f"over {seeds} seed{'s' if seeds > 1 else ''}) | bytes sent / rank / step | of which "
        "between nodes | vs fp32 all-reduce | memory / rank (kB): params + grads + state | "
        "wall time / run (s) |"),
        "|---|---|---|---|---|---|---|",
    ]
    for t in table:
        b, inter, mem = t["bytes_per_step"], t["inter_node_bytes_per_step"], t.get("memory")
        ratio = "1" if b == fp32 else (f"1/{fp32 / b:.1f}" if b else "-")
        inter = "-" if inter is None else f"{inter:,}"
        mem = "-" if mem is None else " + ".join(
            f"{mem[k] / 1e3:.0f}" for k in ("params", "grads", "optimizer_state"))
        lines.append(f"| {t['label']} | {t['val_loss_mean']:.4f} ± {t['val_loss_std']:.4f} | "
                     f"{b:,} | {inter} | {ratio} | {mem} | {t['wall_s']:.1f} |")
    initial = statistics.fmean(r["initial_val_loss"] for r in rows)
    lines.append("")
    if any(strategies.get(t["strategy"]).nodes for t in table):
        lines.append(f"Nodes of {rows[0]['ranks_per_node']} workers.")
    lines.append(f"{rows[0]['numel']:,} parameters; validation loss at initialization "
                 f"{initial:.4f} (uniform over the {VOCAB} characters: {math.log(VOCAB):.4f}).")
    return "\n".join(lines)


def report(rows, args, total_s) -> list[dict]:
    table = summarize(rows)
    print()
    print(format_table(table, rows))
    print(f"total time {total_s:.0f} s")
    # gossip and DiLoCo's fragments leave the ranks apart; they are evaluated in sync
    bad = [t["strategy"] for t in table if not t["eval_in_sync"] or (
        t["ranks_differ"] and strategies.get(t["strategy"]).family not in ("decentralized",
                                                                           "diloco"))]
    if bad:
        print(f"WARNING: ranks ended with different parameters: {bad}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": {k: v for k, v in vars(args).items() if k != "json"},
                       "table": table, "runs": rows, "total_s": total_s}, f, indent=1)
    return table


def main(argv=None):
    args = parse_args(argv)
    start = time.perf_counter()
    rows = launch(run, args.workers, args)
    if rows:  # rank 0 (every rank but 0 returns None under torchrun)
        report(rows, args, time.perf_counter() - start)
    return rows
