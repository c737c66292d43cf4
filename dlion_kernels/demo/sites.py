"""Training across sites, the whole stack: ``python -m dlion_kernels.demo --task chars --sites``.

    python -m dlion_kernels.demo --task chars --sites --kill-at 40 --restart-at 56

``--replicas`` R sites train the chars transformer together. A site is one replica of
``--ranks-per-site`` L ranks, its own torch.distributed job (gloo) that shards the model over its
ranks with FSDP2 (``fully_shard`` per block and on the root). Between the sites runs
``dk.DiLoCo`` with its default 1-bit outer step, the model cut into ``--fragments`` P fragments
streamed (``--overlap-steps`` 1: a fragment's exchange runs during the next inner step), under
torchft's quorum (a Lighthouse started here, a ``torchft.Manager`` per rank, gloo, synchronous
quorum, ``min_replica_size`` ``--min-sites``). Each rank takes AdamW inner steps on its share of
the chars task's global batch (site r, rank q: share r L + q of R L); nothing crosses the sites
between syncs, and at a sync only the 1-bit vote of the fragment that is due does.

``--kill-at K``: every rank of site ``--kill-site`` (default the last) is killed with SIGKILL at
the first sync it starts at inner step K or later (its exchange in flight: the others' sync
fails). ``--restart-at S``: once the others have applied a sync at inner step S or later, the
site's L ranks start again, train alone until their first sync, heal there from a live site
(theta_bar, the outer state, the parameters) and sync with the others again. The sites train
until inner step ``--iters`` (with a restart, until a sync at or after it commits with all R).

Reported: site 0's validation loss every ``--eval-every`` syncs; syncs lost (a survivor's syncs
that did not commit, the most over the survivors); the time to heal (from the restart to the
restarted site's first committed sync); bytes between sites per sync (the exchange's count,
against DiLoCo's fp32 all-reduce of the same fragment); ms per inner step; whether every site
ends with the same theta_bar, rank by rank.
"""

from __future__ import annotations

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

from . import chars
from .elastic import PRELOAD as ELASTIC_PRELOAD
from .elastic import digest, read_records, wait_for

PRELOAD = [*ELASTIC_PRELOAD, "torch.distributed.fsdp", "dlion_kernels.local_steps.diloco"]


def parse_args(argv=None):
    ap = chars.make_parser()
    ap.prog += " --sites"
    add_args(ap)
    args = ap.parse_args(argv)
    chars.check_args(ap, args)
    check_args(ap, args)
    return args


def add_args(ap) -> None:
    ap.add_argument("--sites", action="store_true", required=True,
                    help="train across sites: --replicas sites of --ranks-per-site ranks "
                    "(FSDP2 inside), DiLoCo between them on torchft's quorum")
    ap.add_argument("--replicas", type=int, default=3, help="--sites: sites (default 3)")
    ap.add_argument("--ranks-per-site", type=int, default=2, metavar="L",
                    help="--sites: ranks of one site, FSDP2 over them (default 2)")
    ap.add_argument("--min-sites", type=int, default=2,
                    help="--sites: the quorum's min_replica_size (default 2)")
    ap.add_argument("--inner-lr", type=float, default=3e-3, help="--sites: AdamW's lr")
    ap.add_argument("--outer-lr", type=float, default=None,
                    help="--sites: DiLoCo's outer lr (default: DiLoCo's own)")
    ap.add_argument("--kill-at", type=int, default=None, metavar="K",
                    help="--sites: SIGKILL a site at its first sync from inner step K on")
    ap.add_argument("--kill-site", type=int, default=None, metavar="R")
    ap.add_argument("--restart-at", type=int, default=None, metavar="S",
                    help="--sites: restart it once the others applied a sync at step S")
    ap.add_argument("--eval-every", type=int, default=2, metavar="E",
                    help="--sites: site 0's validation loss every E syncs (default 2)")
    ap.add_argument("--overlap-steps", type=int, default=1, metavar="TAU",
                    help="--sites: inner steps a fragment's exchange runs before it is applied "
                    "(default 1)")
    ap.add_argument("--join-timeout-ms", type=int, default=60000, metavar="MS",
                    help="how long the Lighthouse waits for a live site that has not asked yet")
    ap.set_defaults(fragments=2)


def check_args(ap, args) -> None:
    if args.strategy != chars.make_parser().get_default("strategy"):
        ap.error("--sites trains DiLoCo with its default outer step: no --strategy")
    if args.replicas < 1 or args.ranks_per_site < 1 or args.min_sites < 1:
        ap.error("--replicas, --ranks-per-site and --min-sites must be >= 1")
    if args.min_sites > args.replicas:
        ap.error("--min-sites must be <= --replicas")
    if args.sync_every % args.fragments:
        ap.error("--sync-every must be a multiple of --fragments")
    if not 0 <= args.overlap_steps < args.sync_every // args.fragments:
        ap.error("--overlap-steps must be in [0, sync_every / fragments)")
    if args.kill_site is not None and args.kill_at is None:
        ap.error("--kill-site needs --kill-at")
    if args.restart_at is not None and args.kill_at is None:
        ap.error("--restart-at needs --kill-at")
    if args.kill_at is not None:
        if args.kill_site is None:
            args.kill_site = args.replicas - 1
        if not 0 <= args.kill_site < args.replicas:
            ap.error(f"--kill-site must be in [0, {args.replicas})")
        if args.restart_at is None and args.replicas - 1 < args.min_sites:
            ap.error("a kill would leave fewer than --min-sites: give --restart-at")
        if args.restart_at is not None and not args.kill_at <= args.restart_at < args.iters:
            ap.error("--restart-at must be in [--kill-at, --iters)")


def config(args) -> dict:
    """What every rank needs, JSON-able (the benchmark writes its own)."""
    keys = ("d_model", "heads", "layers", "context", "batch_size", "eval_windows", "iters",
            "sync_every", "fragments", "overlap_steps", "replicas", "ranks_per_site",
            "min_sites", "inner_lr", "outer_lr", "kill_at", "kill_site", "restart_at",
            "eval_every", "weight_decay")
    cfg = {k: getattr(args, k) for k in keys}
    cfg.update(seed=args.seeds[0], timeout=30.0, quorum_timeout=300.0)
    return cfg


# ----------------------------------------------------------------------------- one rank


def shard(model, mesh) -> None:
    """FSDP2 over the site's ranks: each block, then the root."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def run_rank(cfg: dict, site: int, position: int, restart: bool, out: str, go=None,
             ports=None) -> None:
    """One rank of one site (module docstring); one JSON line per inner step and per sync in
    ``out``. ``cfg`` also holds: ``lighthouse``, ``ports`` (per site and start: the site's job
    store and its Managers' store, both hosted by the caller; or ``ports`` given here), ``addr``
    and ``hostname`` per site (None: this machine's loopback)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from dlion_kernels.local_steps import fragments as frag
    from dlion_kernels.local_steps.diloco import DiLoCo

    torch.set_num_threads(1)
    if cfg.get("logs"):  # the demo's report only on the terminal (the logs: kept on failure)
        launch.log_to(out + ".log")
    if go is not None:
        go.wait()
    lines = open(out, "a")

    def write(**record):
        lines.write(json.dumps(dict(t=time.time(), **record)) + "\n")
        lines.flush()

    write(event="start")
    L, R = cfg["ranks_per_site"], cfg["replicas"]
    addr = (cfg.get("addr") or {}).get(str(site), "localhost")
    job_port, manager_port = ports or cfg["ports"][str(site)][1 if restart else 0]
    if L > 1:
        store = dist.TCPStore(addr, job_port, is_master=False, wait_for_workers=False)
        dist.init_process_group("gloo", store=dist.PrefixStore("site", store), rank=position,
                                world_size=L)
    manager = launch.replica_manager(
        f"site{site}", cfg["lighthouse"], rank=position, world_size=L, store_port=manager_port,
        addr=addr, min_replica_size=cfg["min_sites"], timeout=cfg["timeout"],
        quorum_timeout=cfg["quorum_timeout"],
        **({"hostname": cfg["hostname"][str(site)]} if cfg.get("hostname") else {}))
    train, val = chars.load_text()
    evals = chars.val_starts(len(val), cfg["eval_windows"], cfg["context"])
    args = type("Args", (), cfg)  # chars.make_model reads d_model, heads, layers, context
    model = chars.make_model(args, cfg["seed"])  # the same initial weights on every site
    if L > 1:
        shard(model, init_device_mesh("cpu", (L,), mesh_dim_names=("shard",)))
    inner = torch.optim.AdamW(model.parameters(), lr=cfg["inner_lr"],
                              weight_decay=cfg["weight_decay"])
    diloco = DiLoCo(model, inner, sync_every=cfg["sync_every"], fragments=cfg["fragments"],
                    overlap_steps=cfg["overlap_steps"], outer=cfg.get("outer", "dlion"),
                    outer_lr=cfg["outer_lr"], manager=manager)
    write(event="ready")
    if not restart:  # the first syncs together: a site late past the join timeout would
        others = [cfg["out"].format(site=r, position=q) for r in range(R) for q in range(L)]
        while not all(any(x.get("event") == "ready" for x in read_records(o)) for o in others):
            time.sleep(0.05)
    dies = cfg["kill_at"] is not None and site == cfg["kill_site"] and not restart
    # with a restart the sites end together: at a sync that commits with all R of them
    together = cfg["restart_at"] is None or cfg["kill_at"] is None
    syncs = 0
    while True:
        t = diloco.inner_step + 1
        started = time.perf_counter()
        share = chars.train_starts(len(train), cfg["seed"], t, site * L + position, R * L,
                                   cfg["batch_size"], cfg["context"])
        x, y = chars.batch(train, share, cfg["context"])
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        inner.step()
        inner.zero_grad()
        s = diloco.step()
        ms = 1000 * (time.perf_counter() - started)
        due = frag.due(t, cfg["sync_every"], cfg["fragments"]) is not None
        if dies and due and t >= cfg["kill_at"]:
            lines.close()
            os.kill(os.getpid(), signal.SIGKILL)  # its exchange in flight: the others' fails
        record = dict(step=diloco.inner_step, loss=loss.item(), ms=ms)
        if s is not None:
            syncs += 1
            record.update(sync=s.step, fragment=s.fragment, committed=s.committed,
                          n=s.participants, sent=s.bytes_sent, inter=s.inter_node_bytes_sent,
                          numel=s.numel, fp32=s.allreduce_fp32_bytes,
                          theta=digest(diloco.theta_bar))
            last_with_all = s.committed and s.participants == R
            if site == 0 and syncs % cfg["eval_every"] == 0:
                record["val"] = chars.val_loss(model, val, evals, cfg["context"], "cpu")
        write(**record)
        if diloco.inner_step >= cfg["iters"] and s is not None and (together or last_with_all):
            break
        if diloco.inner_step > 4 * cfg["iters"]:
            raise RuntimeError(f"site {site}: no sync with all {R} sites since the restart, "
                               f"after {diloco.inner_step} inner steps")
    lines.close()
    launch.end_replica(manager)  # leaves at once (torchft's threads would hold the process)


# ----------------------------------------------------------------------------- the run


def run(args) -> dict:
    """Every site's ranks under a Lighthouse started here; the report (``summarize``)."""
    from torch.distributed import TCPStore

    cfg = config(args)
    R, L = args.replicas, args.ranks_per_site
    house = launch.lighthouse(min_replicas=args.min_sites, join_timeout_ms=args.join_timeout_ms)
    # per site and start (the first, a restart): its job's store and its Managers' store, kept
    # here so that they outlive the site's processes
    stores = {(r, k): [TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
                       for _ in range(2)] for r in range(R) for k in range(2)}
    cfg["ports"] = {str(r): [[s.port for s in stores[(r, k)]] for k in range(2)]
                    for r in range(R)}
    cfg["lighthouse"] = house.address()
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    victim = args.kill_site if args.kill_at is not None else None
    events: dict = {}
    with tempfile.TemporaryDirectory(prefix="dlion-sites-") as tmp:
        cfg["out"] = os.path.join(tmp, "site{site}-rank{position}.jsonl")
        cfg["logs"] = True
        path = {(r, q): cfg["out"].format(site=r, position=q) for r in range(R)
                for q in range(L)}
        procs = {(r, q): ctx.Process(target=run_rank, args=(cfg, r, q, False, path[(r, q)]))
                 for r in range(R) for q in range(L)}
        go = ctx.Event()
        restarts = {}
        if victim is not None and args.restart_at is not None:
            restarts = {(victim, q): ctx.Process(target=run_rank, args=(
                cfg, victim, q, True, path[(victim, q)], go)) for q in range(L)}
        start = time.time()
        try:
            for p in [*procs.values(), *restarts.values()]:
                p.start()
            if victim is not None:
                for q in range(L):
                    procs[(victim, q)].join(timeout=900)
                    if procs[(victim, q)].exitcode != -signal.SIGKILL:
                        raise RuntimeError(f"site {victim} rank {q} was to be killed; exit code "
                                           f"{procs[(victim, q)].exitcode}")
                events["killed_t"] = time.time()
                if not args.quiet:
                    print(f"site {victim} killed (SIGKILL, all {L} ranks) at its sync from inner "
                          f"step {args.kill_at} on", flush=True)
            if restarts:
                others = [key for key in procs if key[0] != victim]
                wait_for(lambda: all(any(x.get("committed") and x["sync"] >= args.restart_at
                                         for x in read_records(path[k])) for k in others),
                         list(procs.values()), limit=900.0, who="sites")
                events["restart_t"] = time.time()
                go.set()
                if not args.quiet:
                    print(f"site {victim} restarted after the sync at step {args.restart_at}",
                          flush=True)
                procs.update(restarts)
            for p in procs.values():
                p.join(timeout=900)
            codes = {k: p.exitcode for k, p in procs.items()}
            if any(c != 0 for c in codes.values()):
                raise RuntimeError(f"site ranks ended with exit codes {codes}\n"
                                   + _log_tails(path))
        finally:
            for p in [*procs.values(), *restarts.values()]:
                if p.is_alive():
                    p.kill()
                    p.join()
            house.shutdown()
        wall = time.time() - start
        records = {k: read_records(v) for k, v in path.items()}
    return summarize(records, args, events, wall)


def _log_tails(path) -> str:
    tails = []
    for (r, q), p in path.items():
        if os.path.exists(p + ".log"):
            with open(p + ".log") as f:
                tails.append(f"site {r} rank {q}:\n{f.read()[-2000:]}")
    return "\n".join(tails)


def summarize(records, args, events, wall) -> dict:
    """The report from every rank's lines (module docstring)."""
    R, L = args.replicas, args.ranks_per_site
    victim = args.kill_site if args.kill_at is not None else None
    syncs = {k: [x for x in rs if "sync" in x] for k, rs in records.items()}
    steps = {k: [x for x in rs if "step" in x] for k, rs in records.items()}
    survivors = [k for k in records if k[0] != victim]
    lost = max((sum(not x["committed"] for x in syncs[k]) for k in survivors), default=0)
    curve = [dict(step=x["step"], n=x["n"], val_loss=x["val"]) for x in syncs[(0, 0)]
             if "val" in x]
    committed = [x for rs in syncs.values() for x in rs if x["committed"]]
    by_n: dict = {}
    for x in committed:
        by_n.setdefault(x["n"], []).append(x)
    per_n = {n: dict(syncs=len(v), inter_bytes=statistics.fmean(x["inter"] for x in v),
                     fp32_allreduce=statistics.fmean(x["fp32"] for x in v))
             for n, v in sorted(by_n.items())}
    # every rank that applied a given sync holds the theta_bar of its position after it
    theta: dict = {}
    for (r, q), rs in syncs.items():
        for x in rs:
            if x["committed"]:
                theta.setdefault((x["sync"], q), set()).add(x["theta"])
    in_sync = all(len(v) == 1 for v in theta.values())
    finals = {}
    for (r, q), rs in syncs.items():
        last = next((x for x in reversed(rs) if x["committed"]), None)
        finals.setdefault(q, set()).add(None if last is None else (last["sync"], last["theta"]))
    ms = [x["ms"] for k in survivors for x in steps[k][3:] if "sync" not in x]
    out = dict(replicas=R, ranks_per_site=L, iters=args.iters, sync_every=args.sync_every,
               fragments=args.fragments, overlap_steps=args.overlap_steps,
               kill_at=args.kill_at, kill_site=victim, restart_at=args.restart_at,
               syncs_lost=lost, per_participants=per_n, committed_syncs_in_sync=in_sync,
               final_theta_identical=all(len(v) == 1 for v in finals.values()),
               inner_step_ms=statistics.median(ms) if ms else None,
               final_val_loss=curve[-1]["val_loss"] if curve else None, curve=curve,
               wall_s=wall, heal=None)
    if victim is not None and "restart_t" in events:
        t0 = events["restart_t"]
        first = min((x["t"] for q in range(L) for x in syncs[(victim, q)]
                     if x["committed"] and x["t"] >= t0), default=None)
        out["heal"] = dict(heal_s=None if first is None else first - t0)
    out["records"] = {f"{r}-{q}": rs for (r, q), rs in records.items()}
    return out


def format_report(rep) -> str:
    lines = [f"training across sites: {rep['replicas']} sites x {rep['ranks_per_site']} ranks "
             f"(FSDP2 inside), DiLoCo's default outer step, H = {rep['sync_every']}, "
             f"{rep['fragments']} fragments streamed ({rep['overlap_steps']} step), torchft's "
             f"quorum; {rep['wall_s']:.1f} s", "",
             "| inner step | sites | validation loss (site 0) |", "|---|---|---|"]
    for c in rep["curve"]:
        lines.append(f"| {c['step']} | {c['n']} | {c['val_loss']:.4f} |")
    lines += ["", "| sites in the sync | syncs (all ranks) | bytes between sites / rank / sync | "
              "fp32 all-reduce of the fragment |", "|---|---|---|---|"]
    for n, b in rep["per_participants"].items():
        ratio = b["fp32_allreduce"] / b["inter_bytes"] if b["inter_bytes"] else math.inf
        lines.append(f"| {n} | {b['syncs']} | {b['inter_bytes']:,.0f} | "
                     f"{b['fp32_allreduce']:,.0f} (x{ratio:.1f}) |")
    lines.append("")
    if rep["kill_at"] is not None:
        lines.append(f"site {rep['kill_site']} killed at its sync from step {rep['kill_at']}: "
                     f"syncs lost {rep['syncs_lost']}")
    if rep["heal"]:
        h = rep["heal"]["heal_s"]
        lines.append(f"restarted after the sync at step {rep['restart_at']}: time to heal "
                     f"(restart to its first committed sync) "
                     f"{'never' if h is None else f'{h:.2f} s'}")
    ms = rep["inner_step_ms"]
    lines.append(f"ms per inner step (median, survivors): {'-' if ms is None else f'{ms:.1f}'}; "
                 f"every committed sync bit-identical across sites: "
                 f"{rep['committed_syncs_in_sync']}; all sites end with the same theta_bar: "
                 f"{rep['final_theta_identical']}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    rep = run(args)
    print(format_report(rep))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": {k: v for k, v in vars(args).items() if k != "json"},
                       "report": rep}, f, indent=1)
    return rep
