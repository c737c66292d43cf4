"""The chars task under torchft's quorum: ``python -m dlion_kernels.demo --task chars --elastic``.

    python -m dlion_kernels.demo --task chars --elastic --kill-at 40 --restart-at 60

``--replicas`` R replica processes (one each) train the chars transformer with
``DistributedLion(manager=)`` (vote/binary, lr ``--lion-lr``, the first of ``--seeds``) under a
torchft Lighthouse started in this process (``min_replicas=2``). Every replica has its own
TCPStore and ``torchft.Manager`` (gloo, ``min_replica_size=2``, synchronous quorum). Replica r
takes, at step s, the r-th share of the chars task's global batch of step s; while a replica is
away its share is not trained on.

``--kill-at K``: replica ``--kill-replica`` (default the last) is killed with SIGKILL in the
middle of its first attempt at step K or later with all replicas taking part (after its
backward, before its vote), so the others' vote of that step fails. ``--restart-at S``: once
the others have committed step S, a new process with the same replica id starts; it heals
from a live replica at its first quorum and votes again. With a restart the replicas train
until a step >= ``--iters`` commits with all R of them.

"Step" is torchft's step count: a step that does not commit is tried again with the same
number and the same batch. Reported:

- the loss through the failure: replica 0's validation loss every ``--eval-every`` steps, with
  the participants of that step;
- steps lost: the attempts of a surviving replica that did not commit (the most over the
  survivors), per failure;
- time to heal: from the restart (the process is told to start; torch is already imported) to
  the healed replica's first committed step, i.e. its first counted vote;
- bytes per step: what each replica sent, against the wire format's figure for the step's
  participants and against an fp32 ring all-reduce;
- whether every replica, the healed one included, ends with bit-identical parameters.
"""

from __future__ import annotations

import hashlib
import json
import math
import multiprocessing as mp
import os
import signal
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

from dlion_kernels import launch
from dlion_kernels.elastic import DEFAULT_HEAL_MOMENTUM, HEAL_MOMENTUM
from dlion_kernels.kernels.layout import (
    HEADER_WORDS,
    aggregate_planes,
    num_blocks,
    shard_blocks,
    vote_planes,
)

from . import chars
from .common import allreduce_fp32_bytes

MIN_REPLICAS = 2
# one fork server that imported these once: R processes importing torch at once cost a minute
# of CPU on a small machine, and a restart that imports nothing starts at once
PRELOAD = [*launch.PRELOAD, "torchft", "dlion_kernels.elastic",
           "dlion_kernels.optim.dlion", "dlion_kernels.kernels.native",
           "dlion_kernels.kernels.reference", "dlion_kernels.demo.chars"]


def parse_args(argv=None):
    """The chars task's options and the elastic ones."""
    ap = chars.make_parser()
    ap.prog += " --elastic"
    add_args(ap)
    args = ap.parse_args(argv)
    chars.check_args(ap, args)
    check_args(ap, args)
    return args


def add_args(ap) -> None:
    """The chars task's elastic options."""
    ap.add_argument("--elastic", action="store_true", required=True,
                    help="train DistributedLion on torchft's quorum: --replicas processes under "
                    "a Lighthouse started here (--strategy and --workers are not used)")
    ap.add_argument("--replicas", type=int, default=3, help="--elastic: replica processes "
                    "(default 3)")
    ap.add_argument("--kill-at", type=int, default=None, metavar="K",
                    help="--elastic: SIGKILL a replica in the middle of step K")
    ap.add_argument("--kill-replica", type=int, default=None, metavar="R",
                    help="--elastic: the replica --kill-at kills (default the last)")
    ap.add_argument("--restart-at", type=int, default=None, metavar="S",
                    help="--elastic: restart the killed replica once the others committed step S")
    ap.add_argument("--heal-momentum", choices=HEAL_MOMENTUM, default=DEFAULT_HEAL_MOMENTUM,
                    help=f"--elastic: the healed replica's momentum (default "
                    f"{DEFAULT_HEAL_MOMENTUM})")
    ap.add_argument("--eval-every", type=int, default=10, metavar="E",
                    help="--elastic: replica 0's validation loss every E steps (default 10)")
    ap.add_argument("--join-timeout-ms", type=int, default=5000, metavar="MS",
                    help="how long the Lighthouse waits for a live replica that has not asked "
                    "for the quorum yet (default 5000; with 1000 on a loaded machine the "
                    "replicas reached quorums seconds apart and split into alternating pairs)")
    ap.add_argument("--plot", metavar="PNG", default=None,
                    help="--elastic: also draw the loss through the failure (needs matplotlib)")


def check_args(ap, args) -> None:
    """argparse errors for the elastic options."""
    if args.replicas < MIN_REPLICAS:
        ap.error(f"--replicas must be >= {MIN_REPLICAS} (the quorum's min_replica_size)")
    if args.eval_every < 1:
        ap.error("--eval-every must be >= 1")
    if args.join_timeout_ms < 0:
        ap.error("--join-timeout-ms must be >= 0")
    if args.kill_replica is not None and args.kill_at is None:
        ap.error("--kill-replica needs --kill-at")
    if args.restart_at is not None and args.kill_at is None:
        ap.error("--restart-at needs --kill-at")
    if args.kill_at is not None:
        if args.kill_replica is None:
            args.kill_replica = args.replicas - 1
        if not 0 <= args.kill_replica < args.replicas:
            ap.error(f"--kill-replica must be in [0, {args.replicas}), got {args.kill_replica}")
        if not 1 <= args.kill_at < args.iters:
            ap.error(f"--kill-at must be in [1, --iters) = [1, {args.iters}), got {args.kill_at}")
        if args.restart_at is None and args.replicas - 1 < MIN_REPLICAS:
            ap.error(f"with {args.replicas} replicas a kill leaves fewer than {MIN_REPLICAS}: "
                     "give --restart-at, or more --replicas")
        if args.restart_at is not None and not args.kill_at <= args.restart_at < args.iters:
            ap.error(f"--restart-at must be in [--kill-at, --iters) = [{args.kill_at}, "
                     f"{args.iters}), got {args.restart_at}")


def vote_bytes(numels, n: int) -> int:
    """What one replica sends in a vote/binary step among n replicas (one bucket): (n-1)
    all_to_all chunks of the header and a shard's 1-bit votes, (n-1) gathered shards of the
    aggregate, in 4-byte words."""
    if n < 2:
        return 0
    shard = shard_blocks(sum(num_blocks(k) for k in numels), n)
    up = (n - 1) * (HEADER_WORDS + shard * vote_planes("binary"))
    down = (n - 1) * shard * aggregate_planes("vote", "binary", n)
    return 4 * (up + down)


def digest(params) -> str:
    h = hashlib.blake2b(digest_size=12)
    for p in params:
        h.update(p.detach().contiguous().view(-1).numpy().tobytes())
    return h.hexdigest()


# ----------------------------------------------------------------------------- a replica


def _replica(index: int, args, lighthouse: str, path: str, dies: bool, go=None) -> None:
    """One replica: its store, Manager and model; one JSON line per step attempt in ``path``."""
    from dlion_kernels.optim.dlion import DistributedLion

    torch.set_num_threads(1)
    launch.log_to(path + ".log")  # torchft's lines and warnings stay out of the report
    if go is not None:
        go.wait()
    lines = open(path, "a")

    def write(**record):
        lines.write(json.dumps(dict(t=time.time(), **record)) + "\n")
        lines.flush()

    write(event="start")
    train, val = chars.load_text()
    evals = chars.val_starts(len(val), args.eval_windows, args.context)
    seed = args.seeds[0]
    manager = launch.replica_manager(f"replica{index}", lighthouse,
                                     min_replica_size=MIN_REPLICAS, timeout=30.0,
                                     quorum_timeout=120.0)
    model = chars.make_model(args, seed)  # the same initial weights on every replica
    params = list(model.parameters())
    opt = DistributedLion(params, lr=args.lion_lr, weight_decay=args.weight_decay,
                             manager=manager, heal_momentum=args.heal_momentum)
    write(event="ready")
    if go is None:  # the first quorum together (see --join-timeout-ms)
        others = [os.path.join(os.path.dirname(path), f"replica{i}.jsonl")
                  for i in range(args.replicas)]
        while not all(any(r.get("event") == "ready" for r in read_records(o)) for o in others):
            time.sleep(0.02)
    while True:
        opt.zero_grad()  # this step's quorum: a restarted replica heals here
        step = manager.current_step() + 1  # the step this attempt makes
        x, y = chars.batch(train, chars.train_starts(len(train), seed, step, index,
                                                     args.replicas, args.batch_size,
                                                     args.context), args.context)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        if dies and step >= args.kill_at and manager.num_participants() == args.replicas:
            lines.close()
            os.kill(os.getpid(), signal.SIGKILL)  # mid-step: the others' vote fails
        opt.step()
        s = opt.last_stats
        record = dict(step=s.manager_step, committed=s.committed, n=s.participants,
                      sent=s.bytes_sent, loss=loss.item(), digest=digest(params))
        if s.committed and s.manager_step % args.eval_every == 0:
            record["val"] = chars.val_loss(model, val, evals, args.context, "cpu")
        write(**record)
        if s.committed and s.manager_step >= args.iters and (
                args.restart_at is None or s.participants == args.replicas):
            break
        if s.participants < args.replicas:
            time.sleep(0.01)  # leave the CPU to a replica that is starting
    end_replica(lines, manager)


def read_records(path) -> list:
    """The JSON records a replica wrote to ``path``, one a line; none if it has not started, and
    a last line still being written is left out."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def end_replica(lines, manager, leave: bool = True) -> None:
    """A replica's clean end: close its record file, then ``launch.end_replica``."""
    lines.close()
    launch.end_replica(manager, leave)


# ----------------------------------------------------------------------------- the run


def run(args) -> dict:
    """All replicas under a Lighthouse started here; returns the report (``summarize``)."""
    quiet = args.quiet
    house = launch.lighthouse(min_replicas=MIN_REPLICAS, join_timeout_ms=args.join_timeout_ms)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    victim = args.kill_replica if args.kill_at is not None else None
    with tempfile.TemporaryDirectory(prefix="dlion-elastic-") as tmp:
        path = [os.path.join(tmp, f"replica{i}.jsonl") for i in range(args.replicas)]
        procs = [ctx.Process(target=_replica, args=(i, args, house.address(), path[i],
                                                    i == victim))
                 for i in range(args.replicas)]
        go = ctx.Event()
        restart = None
        if victim is not None and args.restart_at is not None:
            restart = ctx.Process(target=_replica, args=(victim, args, house.address(),
                                                         path[victim], False, go))
        events = {}
        start = time.time()
        try:
            for p in procs + ([restart] if restart else []):
                p.start()
            if victim is not None:
                procs[victim].join(timeout=600)
                if procs[victim].exitcode != -signal.SIGKILL:
                    raise RuntimeError(f"replica {victim} was to be killed at step "
                                       f"{args.kill_at}; exit code {procs[victim].exitcode}")
                events["killed_t"] = time.time()
                if not quiet:
                    print(f"replica {victim} killed (SIGKILL) in the middle of step "
                          f"{args.kill_at}", flush=True)
            if restart is not None:
                others = [i for i in range(args.replicas) if i != victim]
                wait_for(lambda: all(any(r.get("committed") and r["step"] >= args.restart_at
                                         for r in read_records(path[i])) for i in others),
                         procs)
                events["restart_t"] = time.time()
                go.set()
                if not quiet:
                    print(f"replica {victim} restarted after step {args.restart_at}", flush=True)
                procs[victim] = restart
            for p in procs:
                p.join(timeout=600)
            codes = [p.exitcode for p in procs]
            if codes != [0] * args.replicas:
                tails = "".join(f"replica {i}:\n{open(p + '.log').read()[-2000:]}\n"
                                for i, p in enumerate(path) if os.path.exists(p + ".log"))
                raise RuntimeError(f"replicas ended with exit codes {codes}\n{tails}")
        finally:
            for p in procs + ([restart] if restart else []):
                if p.is_alive():
                    p.kill()
                    p.join()
            house.shutdown()
        wall = time.time() - start
        records = [read_records(p) for p in path]
    numels = [p.numel() for p in chars.make_model(args, args.seeds[0]).parameters()]
    return summarize(records, numels, args, events, wall)


def wait_for(condition, procs, limit: float = 600.0, who: str = "replicas") -> None:
    """Polls ``condition`` until it holds; RuntimeError when one of ``procs`` ended with an
    error (a SIGKILL is the demo's own kill) or after ``limit`` seconds."""
    end = time.monotonic() + limit
    while not condition():
        bad = [p.exitcode for p in procs if p.exitcode not in (None, 0, -signal.SIGKILL)]
        if bad or time.monotonic() > end:
            raise RuntimeError(f"{who} failed (exit codes {bad}) or timed out")
        time.sleep(0.05)


def summarize(records, numels, args, events, wall) -> dict:
    """The report of a run from every replica's lines (see the module docstring)."""
    R, victim = args.replicas, args.kill_replica if args.kill_at is not None else None
    steps = [[r for r in rs if "step" in r] for rs in records]
    survivors = [i for i in range(R) if i != victim]
    lost = max(sum(not r["committed"] for r in steps[i]) for i in survivors)
    failures = 0 if victim is None else 1
    curve = [dict(step=r["step"], n=r["n"], val_loss=r["val"], train_loss=r["loss"])
             for r in steps[0] if r["committed"] and "val" in r]
    d = sum(numels)
    by_n: dict = {}
    bytes_ok = True
    for rs in steps:
        for r in rs:
            if r["committed"]:
                by_n.setdefault(r["n"], []).append(r["sent"])
                bytes_ok &= r["sent"] == vote_bytes(numels, r["n"])
    per_n = {n: dict(measured=statistics.fmean(v), formula=vote_bytes(numels, n),
                     fp32_allreduce=allreduce_fp32_bytes(d, n), steps=len(v))
             for n, v in sorted(by_n.items())}
    finals = [next((r for r in reversed(rs) if r["committed"]), None) for rs in steps]
    identical = all(f is not None for f in finals) and len({f["digest"] for f in finals}) == 1
    # every replica that committed a given step holds the same parameters after it
    per_step: dict = {}
    for rs in steps:
        for r in rs:
            if r["committed"]:
                per_step.setdefault(r["step"], set()).add(r["digest"])
    in_sync = all(len(v) == 1 for v in per_step.values())
    out = dict(replicas=R, numel=d, iters=args.iters, final_step=max(per_step, default=0),
               kill_at=args.kill_at, kill_replica=victim, restart_at=args.restart_at,
               heal_momentum=args.heal_momentum, failures=failures, steps_lost=lost,
               steps_lost_per_failure=lost / failures if failures else 0.0,
               bytes_per_step=per_n, bytes_match_formula=bytes_ok,
               final_bit_identical=identical, committed_steps_in_sync=in_sync,
               final_val_loss=curve[-1]["val_loss"] if curve else None,
               curve=curve, wall_s=wall, heal=None)
    if victim is not None and "restart_t" in events:
        t0 = events["restart_t"]
        after = [r for r in records[victim] if r["t"] >= t0]
        ready = next((r["t"] for r in after if r.get("event") == "ready"), None)
        first = next((r for r in after if r.get("committed")), None)
        others_during = [r for r in steps[survivors[0]]
                         if r["committed"] and t0 <= r["t"] and (first is None
                                                                 or r["t"] < first["t"])]
        out["heal"] = dict(
            heal_s=None if first is None else first["t"] - t0,
            ready_s=None if ready is None else ready - t0,
            first_vote_step=None if first is None else first["step"],
            first_vote_n=None if first is None else first["n"],
            first_vote_bit_identical=first is not None and first["digest"] in per_step.get(
                first["step"], ()),
            survivor_steps_meanwhile=len(others_during))
    if victim is not None:
        out["downtime_s"] = _gap(steps[survivors[0]], events.get("killed_t"))
    out["steps"] = steps
    return out


def _gap(rs, killed_t) -> float | None:
    """The longest time between two committed steps of a survivor around the kill."""
    ts = [r["t"] for r in rs if r["committed"]]
    gaps = [b - a for a, b in zip(ts, ts[1:])]
    return max(gaps) if gaps and killed_t is not None else None


def format_report(rep) -> str:
    lines = [f"elastic D-Lion (vote/binary) on torchft: {rep['replicas']} replicas, "
             f"{rep['numel']:,} parameters, final step {rep['final_step']}, "
             f"{rep['wall_s']:.1f} s", "",
             "| step | participants | validation loss (replica 0) | its training loss |",
             "|---|---|---|---|"]
    for c in rep["curve"]:
        lines.append(f"| {c['step']} | {c['n']} | {c['val_loss']:.4f} | {c['train_loss']:.4f} |")
    lines += ["", "| participants | steps | bytes sent / replica / step | wire-format figure | "
              "fp32 ring all-reduce |", "|---|---|---|---|---|"]
    for n, b in rep["bytes_per_step"].items():
        ratio = b["fp32_allreduce"] / b["measured"] if b["measured"] else math.inf
        lines.append(f"| {n} | {b['steps']} | {b['measured']:,.0f} | {b['formula']:,} | "
                     f"{b['fp32_allreduce']:,} (x{ratio:.1f}) |")
    lines.append("")
    if rep["kill_at"] is not None:
        lines.append(f"replica {rep['kill_replica']} killed at step {rep['kill_at']}: steps lost "
                     f"{rep['steps_lost']} (per failure {rep['steps_lost_per_failure']:g}), "
                     f"longest gap between two committed steps of a survivor "
                     f"{rep['downtime_s']:.2f} s")
    h = rep["heal"]
    if h:
        heal = "never" if h["heal_s"] is None else f"{h['heal_s']:.2f} s"
        lines.append(f"restarted after step {rep['restart_at']}: time to heal (restart to its "
                     f"first counted vote, step {h['first_vote_step']} with "
                     f"{h['first_vote_n']} replicas) {heal}; process ready after "
                     f"{h['ready_s']:.2f} s; the others committed "
                     f"{h['survivor_steps_meanwhile']} steps meanwhile")
    lines.append(f"bytes per step equal the wire format's figure: {rep['bytes_match_formula']}; "
                 f"every committed step bit-identical on its replicas: "
                 f"{rep['committed_steps_in_sync']}; all replicas end bit-identical: "
                 f"{rep['final_bit_identical']}")
    return "\n".join(lines)


def plot(rep, png: str) -> str | None:
    """Replica 0's validation loss against the step, the failure and the heal marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    curve = rep["curve"]
    ax.plot([c["step"] for c in curve], [c["val_loss"] for c in curve], marker=".",
            label="validation loss (replica 0)")
    if rep["kill_at"] is not None:
        ax.axvline(rep["kill_at"], color="tab:red", ls="--", label="replica killed")
    if rep["heal"] and rep["heal"]["first_vote_step"] is not None:
        ax.axvline(rep["heal"]["first_vote_step"], color="tab:green", ls=":",
                   label="healed replica's first vote")
    ax.set_xlabel("step (committed)")
    ax.set_ylabel("cross entropy")
    ax.set_title(f"chars, elastic D-Lion, {rep['replicas']} replicas")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def main(argv=None) -> dict:
    args = parse_args(argv)
    rep = run(args)
    print(format_report(rep))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": {k: v for k, v in vars(args).items() if k != "json"},
                       "report": rep}, f, indent=1)
    if args.plot:
        print(f"saved {args.plot}" if plot(rep, args.plot) else
              "no plot: matplotlib is not installed")
    return rep
