"""What the demo tasks share: the command-line options every task has (``--strategy`` takes the
slugs of ``dlion_kernels/strategies.py``, or ``auto``), the ``Settings`` the strategies are built
with (``dlion_kernels/recipes/``), ``--strategy auto`` (the runtime model picks), the
rank-agreement check, and ``launch`` (the ranks torchrun started, or gloo processes spawned here
by ``dlion_kernels.launch.spawn``).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from dlion_kernels import strategies
from dlion_kernels.accounting import ring_all_reduce_bytes
from dlion_kernels.recipes import Settings
from dlion_kernels.launch import spawn

TASKS = ("digits", "chars")
AUTO = "auto"


def task_of(argv=None) -> str | None:
    """The value of ``--task`` in argv (None if absent), read before the task's own parser runs
    (so ``--task chars --help`` shows the chars options)."""
    pre = argparse.ArgumentParser(prog="python -m dlion_kernels.demo", add_help=False)
    pre.add_argument("--task", choices=TASKS, default=None)
    return pre.parse_known_args(argv)[0].task


def add_common_args(ap: argparse.ArgumentParser, task: str, default_strategies, *,
                    lion_lr: float, adamw_lr: float) -> None:
    """The options of every task; ``check_common_args`` validates them after parsing."""
    other = [t for t in TASKS if t != task]
    ap.add_argument("--task", choices=TASKS, default=task,
                    help=f"{task}: this task (default); {', '.join(other)}: the other one "
                    f"(its own options: --task {other[0]} --help)")
    ap.add_argument("--workers", type=int, default=4, help="processes to start (ignored under "
                    "torchrun, which starts them)")
    ap.add_argument("--strategy", nargs="+", metavar="SLUG", default=list(default_strategies),
                    help=f"rows to train, in order (default: {' '.join(default_strategies)}); "
                    f"'{AUTO}' alone: the runtime model picks the fastest strategy it predicts "
                    "on these workers (they calibrate for a few seconds) and only that one "
                    f"trains. Slugs: {', '.join(strategies.STRATEGIES)}")
    ap.add_argument("--ranks-per-node", type=int, default=None, metavar="L",
                    help="node size of the hierarchical strategies and of alternating-exp-ring "
                    "(default: LOCAL_WORLD_SIZE if it makes two or more nodes, else 2; with "
                    f"--strategy {AUTO}: 1)")
    ap.add_argument("--lion-lr", type=float, default=lion_lr, help="Lion, D-Lion, AccumLion")
    ap.add_argument("--adamw-lr", type=float, default=adamw_lr, help="AdamW, AccumAdamW")
    ap.add_argument("--weight-decay", type=float, default=1e-2)
    ap.add_argument("--backend", default=None, help="dlion_kernels backend (default: auto)")
    ap.add_argument("--accum-steps", type=int, default=None,
                    help="K of AccumAdamW / AccumLion (default: the number of workers, as the "
                    "paper scales it)")
    ap.add_argument("--sync-every", type=int, default=8, metavar="H",
                    help="diloco-*: inner steps between two syncs of a fragment (default 8)")
    ap.add_argument("--fragments", type=int, default=1, metavar="P",
                    help="diloco-*: Streaming DiLoCo's fragments, one syncs every H / P inner "
                    "steps (default 1; H must be a multiple of P)")
    ap.add_argument("--diloco-dlion-lr", type=float, default=None,
                    help="diloco-dlion's outer lr, also diloco-dlion-ef's and -ef-decay's "
                         "(default: DiLoCo's, 1e-2)")
    ap.add_argument("--diloco-nesterov-lr", type=float, default=None,
                    help="diloco-nesterov's outer lr (default: DiLoCo's, 0.7)")
    ap.add_argument("--diloco-scaled-lr", type=float, default=1.0,
                    help="diloco-dlion-ef-scale's outer lr (default 1.0)")
    ap.add_argument("--diloco-sparseloco-lr", type=float, default=None,
                    help="diloco-sparseloco's outer lr (default: DiLoCo's, 1.0)")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")


def check_common_args(ap: argparse.ArgumentParser, args) -> None:
    """argparse errors (exit code 2) for values ``add_common_args`` cannot check alone."""
    if args.workers < 1:
        ap.error("--workers must be >= 1")
    if args.ranks_per_node is not None and args.ranks_per_node < 1:
        ap.error("--ranks-per-node must be >= 1")
    if args.sync_every < 1 or args.fragments < 1 or args.sync_every % args.fragments:
        ap.error(f"--sync-every ({args.sync_every}) and --fragments ({args.fragments}) must be "
                 ">= 1, and --sync-every a multiple of --fragments")
    if AUTO in args.strategy:
        if args.strategy != [AUTO]:
            ap.error(f"--strategy {AUTO} picks one strategy: give it alone")
        if args.ranks_per_node is None:  # the model sees the nodes it is told of, else none
            args.ranks_per_node = 1
        return
    for name in args.strategy:
        try:
            strategies.get(name)
        except ValueError as exc:
            ap.error(f"--strategy: {exc}")


def ranks_per_node(args, n: int) -> int:
    """L: --ranks-per-node, else LOCAL_WORLD_SIZE when it makes two or more nodes, else 2."""
    if args.ranks_per_node is not None:
        return args.ranks_per_node
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    return local if local >= 1 and n % local == 0 and n // local >= 2 else 2


def settings(args, n: int, bucket_mb: float) -> Settings:
    """The task's options as the strategies' build settings."""
    return Settings(lion_lr=args.lion_lr, adamw_lr=args.adamw_lr,
                    weight_decay=args.weight_decay, backend=args.backend,
                    accum_steps=args.accum_steps, bucket_mb=bucket_mb,
                    ranks_per_node=ranks_per_node(args, n), sync_every=args.sync_every,
                    fragments=args.fragments, diloco_dlion_lr=args.diloco_dlion_lr,
                    diloco_nesterov_lr=args.diloco_nesterov_lr,
                    diloco_scaled_lr=args.diloco_scaled_lr,
                    diloco_sparseloco_lr=args.diloco_sparseloco_lr)


def strategy_names(args, n: int) -> tuple[list[str], list[tuple[str, str]]]:
    """(the --strategy slugs that can run on n workers, [(slug, why not)] for the others)."""
    L = ranks_per_node(args, n)
    runnable, skipped = [], []
    for name in args.strategy:
        reason = strategies.get(name).problem(n, L)
        (skipped.append((name, reason)) if reason else runnable.append(name))
    return runnable, skipped


def choose_auto(args, n: int, rank: int, numel: int, bucket_mb: float) -> str:
    """``--strategy auto``: the slug the runtime model predicts fastest on these workers among
    every strategy it predicts that can run here. Collective (every worker calibrates, rank 0's
    inputs go to all, all decide alike); rank 0 prints the predictions."""
    from dlion_kernels.plan import auto
    from dlion_kernels.plan.__main__ import table

    if n < 2:
        raise SystemExit(f"--strategy {AUTO} needs at least 2 workers (it times the links)")
    L = ranks_per_node(args, n)
    ranked = auto.strategies(numel, ranks_per_node=L, bucket_mb=bucket_mb)
    slug, row = ranked[0]  # fastest first
    if rank == 0:
        print(f"runtime model, {numel:,} parameters on {n} workers (nodes of {L}):\n"
              f"{table([r for _, r in ranked])}\n"
              f"chosen: {slug} (the model's row {row.strategy})", flush=True)
    return slug


def same_on_all_ranks(model_or_tensor, n) -> bool:
    """Whether every rank holds bit-identical values (all parameters of a module, or a tensor),
    checked cheaply through one float64 scalar per rank. FSDP2's sharded parameters (DTensors)
    are gathered whole first (collective in their shard group): the replicas must agree."""
    if isinstance(model_or_tensor, torch.Tensor):
        check = model_or_tensor.detach().double().sum().reshape(())
    else:
        check = torch.stack([_whole(p).double().sum()
                             for p in model_or_tensor.parameters()]).sum()
    if n == 1:
        return True
    gathered = [torch.zeros_like(check) for _ in range(n)]
    dist.all_gather(gathered, check)
    return all(torch.equal(g, check) for g in gathered)


def _whole(p):
    from dlion_kernels.exchange.sharded import is_dtensor

    return p.detach().full_tensor() if is_dtensor(p) else p.detach()


def allreduce_fp32_bytes(numel: int, n: int) -> int:
    """What a ring all-reduce of fp32 gradients sends per rank, 2 (n-1)/n * 4d: the tables'
    reference."""
    return round(ring_all_reduce_bytes(n, 4 * numel))


def launch(run, n: int, args):
    """``run(rank, n, args, device)`` on every rank; returns rank 0's result (None on the other
    ranks under torchrun). Under torchrun (RANK and WORLD_SIZE set) this process is one rank
    (NCCL on a GPU, else gloo); otherwise n gloo processes are spawned here (``spawn``). ``run``
    must be a module-level function (spawned processes import it by name)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        cuda = torch.cuda.is_available()
        dist.init_process_group("nccl" if cuda else "gloo")
        rank, n = dist.get_rank(), dist.get_world_size()
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else \
            torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        rows = run(rank, n, args, device)
        dist.barrier()  # no rank tears down while another still talks to it (gloo aborts then)
        dist.destroy_process_group()
        return rows if rank == 0 else None
    try:
        return spawn(n, run, args, torch.device("cpu"),
                     threads=max(1, (os.cpu_count() or 1) // n))[0]
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from None
