"""What the demo tasks share: the strategies (optimizer + gradient exchange) by name, the fp32
all-reduce baseline and its byte count, the rank-agreement check, and ``launch`` (the ranks
torchrun started, or gloo processes spawned here by ``dlion_kernels.launch.spawn``).

Strategy names (rows of the tables):

- ``"AdamW + all-reduce"``, ``"Lion + all-reduce"``: fp32 gradient all-reduce, then the optimizer
- ``"D-Lion vote"``, ``"D-Lion average"``: ``DistributedLion(mode=...)``; a suffix
  ``", overlap"`` sets ``overlap=True``, ``", hierarchy L"`` sets ``hierarchy=L``
- ``"Decentralized <topology> <optimizer>"``: ``DecentralizedDataParallel`` on that topology with
  ``accum-adamw``, ``accum-lion`` or ``adamw`` per bucket
"""

from __future__ import annotations

import argparse
import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

import dlion_kernels as dk
from dlion_kernels import topologies
from dlion_kernels.launch import spawn

TASKS = ("digits", "chars")
DECENTRALIZED_OPTIMIZERS = ("accum-adamw", "accum-lion", "adamw")


def task_of(argv=None) -> str | None:
    """The value of ``--task`` in argv (None if absent), read before the task's own parser runs
    (so ``--task chars --help`` shows the chars options)."""
    pre = argparse.ArgumentParser(prog="python -m dlion_kernels.demo", add_help=False)
    pre.add_argument("--task", choices=TASKS, default=None)
    return pre.parse_known_args(argv)[0].task


@dataclass
class Hyper:
    """The hyper-parameters every strategy reads."""

    lion_lr: float
    adamw_lr: float
    weight_decay: float
    backend: str | None = None
    accum_steps: int | None = None  # K of AccumAdamW / AccumLion; None: the number of workers
    bucket_mb: float = 0.25         # buckets of the decentralized wrapper
    ranks_per_node: int = 1         # L of alternating-exp-ring (hierarchy takes it from the name)


def allreduce_grads(model, n) -> int:
    """The usual data-parallel gradient sync: fp32 all-reduce (sum, then / n). Returns the bytes
    a ring all-reduce sends per rank, 2 (n-1)/n * 4d."""
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    if n > 1:
        dist.all_reduce(flat)
        flat /= n
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))
    return round(2 * (n - 1) / n * flat.numel() * flat.element_size())


def same_on_all_ranks(model_or_tensor, n) -> bool:
    """Whether every rank holds bit-identical values (all parameters of a module, or a tensor),
    checked cheaply through one float64 scalar per rank."""
    if isinstance(model_or_tensor, torch.Tensor):
        check = model_or_tensor.detach().double().sum().reshape(())
    else:
        check = torch.stack([p.detach().double().sum()
                             for p in model_or_tensor.parameters()]).sum()
    if n == 1:
        return True
    gathered = [torch.zeros_like(check) for _ in range(n)]
    dist.all_gather(gathered, check)
    return all(torch.equal(g, check) for g in gathered)


def parse_name(name: str) -> dict:
    """The parts of a strategy name (see the module docstring); ValueError if it is none."""
    if name in ("AdamW + all-reduce", "Lion + all-reduce"):
        return {"kind": "all-reduce", "optimizer": name.split()[0]}
    if name.startswith("Decentralized "):
        parts = name.split()
        if len(parts) == 3 and parts[1] in topologies.TOPOLOGIES \
                and parts[2] in DECENTRALIZED_OPTIMIZERS:
            return {"kind": "decentralized", "topology": parts[1], "optimizer": parts[2]}
    if name.startswith("D-Lion "):
        head, *suffixes = name.split(", ")
        mode = head[len("D-Lion "):]
        out = {"kind": "dlion", "mode": mode, "overlap": False, "hierarchy": None}
        ok = mode in ("vote", "average")
        for s in suffixes:
            if s == "overlap":
                out["overlap"] = True
            elif s.startswith("hierarchy ") and s[len("hierarchy "):].isdigit():
                out["hierarchy"] = int(s[len("hierarchy "):])
            else:
                ok = False
        if ok:
            return out
    raise ValueError(
        f"unknown strategy {name!r}: expected 'AdamW + all-reduce', 'Lion + all-reduce', "
        "'D-Lion vote|average[, overlap][, hierarchy L]' or 'Decentralized <topology> "
        f"<optimizer>' with a topology of {topologies.TOPOLOGIES} and an optimizer of "
        f"{DECENTRALIZED_OPTIMIZERS}")


def plan_strategy(name: str) -> str:
    """The runtime model's row (``dlion_kernels.plan``) for the strategy ``name``: the one of its
    gradient exchange (both all-reduce optimizers: ``allreduce-fp32``)."""
    spec = parse_name(name)
    if spec["kind"] == "all-reduce":
        return "allreduce-fp32"
    if spec["kind"] == "decentralized":
        return f"decentralized-{spec['topology']}"
    hier = "hier-" if (spec["hierarchy"] or 1) > 1 else ""
    return f"dlion-{hier}{spec['mode']}" + ("-overlap" if spec["overlap"] else "")


def why_not(name: str, n: int, ranks_per_node: int) -> str | None:
    """Why the strategy cannot run on n workers (None if it can)."""
    spec = parse_name(name)
    if spec["kind"] == "dlion" and spec["hierarchy"] is not None and n % spec["hierarchy"]:
        return f"hierarchy {spec['hierarchy']} needs a multiple of {spec['hierarchy']} workers"
    if spec["kind"] == "decentralized":
        try:
            topologies.check(spec["topology"], n, ranks_per_node)
        except ValueError as exc:
            return str(exc)
    return None


class Strategy:
    """One row's optimizer and gradient exchange on one rank.

    ``forward`` runs the model (through the decentralized wrapper if there is one), ``step(loss)``
    does the backward, the exchange and the update and returns the bytes this rank sent,
    ``finish()`` ends outstanding communication, and ``evaluation()`` is the context to evaluate
    in (the average over ranks for decentralized training, whose ranks differ)."""

    def __init__(self, name: str, model: torch.nn.Module, n: int, hyper: Hyper,
                 solo_group=None):
        self.name, self.model, self.n = name, model, n
        self.spec = spec = parse_name(name)
        self.ddp = self.opt = None
        self.inter_node_bytes = None
        self.bytes_total, self.steps = 0, 0
        params = list(model.parameters())
        common = {"weight_decay": hyper.weight_decay, "backend": hyper.backend}
        if spec["kind"] == "decentralized":
            self.ddp = _decentralized(spec, model, n, hyper)
        elif spec["kind"] == "dlion":
            self.opt = dk.DistributedLion(params, lr=hyper.lion_lr, mode=spec["mode"],
                                          hierarchy=spec["hierarchy"], overlap=spec["overlap"],
                                          **common)
        elif spec["optimizer"] == "Lion":
            # Plain Lion is D-Lion on a group of one with ternary votes (the exact sign).
            self.opt = dk.DistributedLion(params, lr=hyper.lion_lr, votes="ternary",
                                          group=solo_group, **common)
        else:
            self.opt = torch.optim.AdamW(params, lr=hyper.adamw_lr,
                                         weight_decay=hyper.weight_decay)

    def forward(self, *args, **kwargs):
        return (self.ddp if self.ddp is not None else self.model)(*args, **kwargs)

    def step(self, loss: torch.Tensor) -> int:
        if self.ddp is not None:  # backward mixes, steps and launches the gossip, per bucket
            before = self.ddp.bytes_sent
            loss.backward()
            sent = self.ddp.bytes_sent - before
        else:
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            if self.spec["kind"] == "all-reduce":
                sent = allreduce_grads(self.model, self.n)
                self.opt.step()
            else:
                self.opt.step()
                sent = self.opt.last_stats.bytes_sent
                self.inter_node_bytes = getattr(self.opt.last_stats, "inter_node_bytes_sent",
                                                None)
        self.bytes_total += sent
        self.steps += 1
        return sent

    @property
    def bytes_per_step(self) -> int:
        """Mean bytes sent per step (alternating-exp-ring's groups change size step to step)."""
        return round(self.bytes_total / self.steps) if self.steps else 0

    def finish(self) -> None:
        if self.ddp is not None:
            self.ddp.synchronize()

    def evaluation(self):
        return self.ddp.global_average() if self.ddp is not None else contextlib.nullcontext()


def _decentralized(spec, model, n, hyper: Hyper):
    """DecentralizedDataParallel with the named per-bucket optimizer."""
    K = hyper.accum_steps or n
    if spec["optimizer"] == "accum-adamw":
        def opt_fn(ps):
            return dk.AccumAdamW(ps, lr=hyper.adamw_lr, weight_decay=hyper.weight_decay,
                                 accum_steps=K, backend=hyper.backend)
    elif spec["optimizer"] == "accum-lion":
        def opt_fn(ps):
            return dk.AccumLion(ps, lr=hyper.lion_lr, weight_decay=hyper.weight_decay,
                                accum_steps=K, backend=hyper.backend)
    else:
        def opt_fn(ps):
            return torch.optim.AdamW(ps, lr=hyper.adamw_lr, weight_decay=hyper.weight_decay)
    return dk.DecentralizedDataParallel(model, opt_fn, topology=spec["topology"],
                                        bucket_mb=hyper.bucket_mb,
                                        local_world_size=hyper.ranks_per_node)


# ----------------------------------------------------------------------------- launching


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
        dist.destroy_process_group()
        return rows if rank == 0 else None
    try:
        return spawn(n, run, args, torch.device("cpu"),
                     threads=max(1, (os.cpu_count() or 1) // n))[0]
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from None
