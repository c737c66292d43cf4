"""Training across sites, the whole stack, against torchft's own streaming DiLoCo (fp32),
through the same failure, on the emulated network.

    sudo python bench/bench_sites.py --rates 0.1 0.01 --repeats 1
    python bench/bench_sites.py --smoke          # loopback, a tiny model, a few steps

Both variants train the chars demo's transformer (``--d-model``, ``--layers``; the same initial
weights, the same data: site r, rank q takes share r L + q of the chars task's global batch of
each step) on ``--sites`` 3 sites of ``--ranks-per-site`` L = 2 ranks. A site is its own
torch.distributed job (gloo) that shards the model with FSDP2 (``fully_shard`` per block and on
the root) and takes AdamW inner steps; between the sites, every ``--sync-every`` H inner steps
and in 2 fragments streamed (one fragment's sync every H / 2 steps, applied one inner step
later), under torchft's quorum (a Lighthouse in node 0's namespace, a Manager per rank,
``min_replica_size`` 2, synchronous quorum):

- dk: ``dk.DiLoCo`` with its default outer step (the 1-bit vote with error feedback, its default
  outer lr), ``fragments=2, overlap_steps=1, manager=`` (``dlion_kernels/demo/sites.py``, the
  demo's own rank);
- dk-nesterov: the same with ``outer="nesterov"`` (DiLoCo's fp32 all-reduce and Nesterov outer
  step, lr 0.7, momentum 0.9): the fp32 outer step on the same code path;
- torchft: ``torchft.local_sgd.DiLoCo`` (0.2.0) with the model cut into 2 fragments (the first
  half of the parameters and the rest, as DiLoCo cuts them), an fp32 all-reduce of each
  fragment's pseudo-gradient through the Manager, ``torch.optim.SGD(lr=0.7, momentum=0.9,
  nesterov=True)`` as each fragment's outer optimizer, ``fragment_sync_delay=1``. Healing copies
  the model's and AdamW's local shards (its own fragments register theirs).

The failure: every rank of site 2 is killed with SIGKILL at the first sync it starts at inner step
``--kill-at`` or later (its fragment's exchange in flight). Its ranks are restarted once the
survivors are past inner step ``--restart-at``: they train alone until their next sync, heal there
and sync with the others again. Every rank trains to inner step ``--iters``.

Network (``network.py``): one namespace per site, its link shaped to the rate (Gbit/s) both ways;
a site's own ranks talk over the namespace's loopback. ``--rates 0``: no namespaces (loopback).

Measured per run, from every rank's line per inner step and the links' byte counters:

- site 0's validation loss every ``--eval-every`` fragment syncs, against wall time; the time to
  reach the target loss, where dk-nesterov (DiLoCo's fp32 Nesterov outer step) ended at this
  rate (without it, the highest final loss of the variants), from the first step (none: not
  reached in the run);
- syncs lost per failure: a survivor's syncs that did not apply (dk: the sync's ``committed``;
  torchft: a sync whose Manager step did not advance);
- bytes between sites per fragment sync: what node 0's link carried, per sync, over the run
  (quorum RPCs and healing included), and per rank the exchange's own count (dk);
- ms per inner step (median over the survivors' steps without a sync, after the first steps).

Writes bench/results/sites-<time>/ (or ``--out``): sites.json (one row per run), summary.md,
runs/<variant>-<rate>-<repeat>/ (every rank's raw records and its log's tail).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_elastic as be  # noqa: E402  (the processes' files, the networks, the Lighthouse)
import common  # noqa: E402
import network  # noqa: E402

VARIANTS = ("dk", "dk-nesterov", "torchft")
SITES, RANKS, VICTIM = 3, 2, 2


# ----------------------------------------------------------------------------- one rank


def _site_rank(cfg_path: str, site: int, position: int, restart: bool) -> None:
    """One rank of one site of one run: its stores (rank 0 hosts the site's job store and its
    Managers' store and publishes their ports), then the variant's loop."""
    import socket

    with open(cfg_path) as f:
        cfg = json.load(f)
    addr = cfg["addr"][str(site)]
    if cfg["namespaces"]:  # the host name resolves outside the namespace: advertise the node
        socket.gethostname = lambda: addr
    import torch
    from torch.distributed import TCPStore

    torch.set_num_threads(1)
    if restart:
        be._published(cfg["go_file"])
    ports_file = cfg["ports_file"].format(site=site, start=int(restart))
    stores = []
    if position == 0:
        stores = [TCPStore(addr, 0, is_master=True, wait_for_workers=False) for _ in range(2)]
        be._publish(ports_file, " ".join(str(s.port) for s in stores))
    ports = [int(p) for p in be._published(ports_file).split()]
    out = cfg["out"].format(site=site, position=position)
    if cfg["variant"].startswith("dk"):
        from dlion_kernels.demo import sites

        sites.run_rank(cfg, site, position, restart, out, ports=ports)
    else:
        _torchft_rank(cfg, site, position, restart, out, ports)


def _fragments(model, parts: int = 2) -> list:
    """The model's modules cut into ``parts`` runs of about equal parameter counts, in
    ``model.parameters()`` order (as dk.DiLoCo cuts its fragments)."""
    import torch

    units = [model.tok, model.pos, *model.blocks, model.norm, model.head]
    sizes = [sum(p.numel() for p in u.parameters()) for u in units]
    total, cut, acc = sum(sizes), [], 0
    for i, k in enumerate(sizes):
        acc += k
        if len(cut) < parts - 1 and acc >= total * (len(cut) + 1) / parts:
            cut.append(i + 1)
    bounds = [0, *cut, len(units)]
    return [torch.nn.ModuleList(units[a:b]) for a, b in zip(bounds, bounds[1:])]


def _torchft_rank(cfg, site, position, restart, out, ports) -> None:
    """The torchft variant's rank (module docstring); the same records as the dk rank."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torchft.local_sgd import DiLoCo

    from dlion_kernels import launch
    from dlion_kernels.demo import chars, sites
    from dlion_kernels.demo.elastic import read_records
    from dlion_kernels.exchange.sharded import own_shard

    lines = open(out, "a")

    def write(**record):
        lines.write(json.dumps(dict(t=time.time(), **record)) + "\n")
        lines.flush()

    write(event="start")
    L, R, H = cfg["ranks_per_site"], cfg["replicas"], cfg["sync_every"]
    addr = cfg["addr"][str(site)]
    store = dist.TCPStore(addr, ports[0], is_master=False, wait_for_workers=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("site", store), rank=position,
                            world_size=L)
    train, val = chars.load_text()
    evals = chars.val_starts(len(val), cfg["eval_windows"], cfg["context"])
    model = chars.make_model(type("Args", (), cfg), cfg["seed"])
    fragments = _fragments(model)  # cut before sharding: the same modules on every rank
    sites.shard(model, init_device_mesh("cpu", (L,), mesh_dim_names=("shard",)))
    inner = torch.optim.AdamW(model.parameters(), lr=cfg["inner_lr"],
                              weight_decay=cfg["weight_decay"])

    def save():  # this rank's local shards of the model and of AdamW's state
        state = {name: own_shard(t).detach().clone() for name, t in model.state_dict().items()}
        return {"model": state, "inner": [
            {k: own_shard(v).clone() if torch.is_tensor(v) else v for k, v in s.items()}
            for s in (inner.state[p] for p in model.parameters())]}

    def load(saved):
        with torch.no_grad():
            for name, t in model.state_dict().items():
                own_shard(t).copy_(saved["model"][name])
        for p, s in zip(model.parameters(), saved["inner"]):
            for k, v in s.items():
                if torch.is_tensor(v) and k in inner.state[p]:
                    own_shard(inner.state[p][k]).copy_(v)
                elif not torch.is_tensor(v):
                    inner.state[p][k] = v

    manager = launch.replica_manager(
        f"site{site}", cfg["lighthouse"], rank=position, world_size=L, store_port=ports[1],
        addr=addr, min_replica_size=cfg["min_sites"], timeout=cfg["timeout"],
        quorum_timeout=cfg["quorum_timeout"], hostname=addr, state_dict=save,
        load_state_dict=load, init_sync=False)  # the same seeded weights everywhere
    outers = [torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9, nesterov=True)
              for f in fragments]
    write(event="ready")
    if not restart:
        others = [cfg["out"].format(site=r, position=q) for r in range(R) for q in range(L)]
        while not all(any(x.get("event") == "ready" for x in read_records(o)) for o in others):
            time.sleep(0.05)
    every = H // len(fragments)
    dies = cfg["kill_at"] is not None and site == VICTIM and not restart
    with DiLoCo(manager, fragments, inner, outers, sync_every=H, fragment_sync_delay=1):
        t, syncs, together = 0, 0, cfg["kill_at"] is None
        while True:
            t += 1
            started = time.perf_counter()
            before = manager.current_step()
            share = chars.train_starts(len(train), cfg["seed"], t, site * L + position, R * L,
                                       cfg["batch_size"], cfg["context"])
            x, y = chars.batch(train, share, cfg["context"])
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            inner.step()  # DiLoCo's hooks: a fragment's sync starts, or one in flight applies
            inner.zero_grad()
            ms = 1000 * (time.perf_counter() - started)
            # torchft starts a fragment's all-reduce at local step every - 1 of its cycle and
            # applies it at step every (fragment_sync_delay=1)
            if dies and t % every == every - 1 and t >= cfg["kill_at"]:
                lines.close()
                os.kill(os.getpid(), signal.SIGKILL)  # its all-reduce in flight
            record = dict(step=t, loss=loss.item(), ms=ms, mstep=manager.current_step())
            if t % every == 0:  # the step where the sync in flight was applied (or not)
                syncs += 1
                applied = manager.current_step() > before
                record.update(sync=t - 1, committed=applied,
                              n=manager.num_participants())
                together = applied and manager.num_participants() == R
                if site == 0 and syncs % cfg["eval_every"] == 0:
                    record["val"] = chars.val_loss(model, val, evals, cfg["context"], "cpu")
            write(**record)
            # every site stops at the same committed sync (a restarted one's own count of
            # steps is behind; the Manager's step, healed, is the same everywhere)
            if "sync" in record and manager.current_step() >= cfg["iters"] // every and (
                    together or cfg["restart_at"] is None):
                break
            if t > 4 * cfg["iters"]:
                raise RuntimeError(f"site {site}: no sync with all {R} sites since the restart")
    lines.close()
    launch.end_replica(manager)


# ----------------------------------------------------------------------------- one run


def one_run(variant: str, args, net, tmp: str, label: str) -> dict:
    from dlion_kernels.demo.elastic import read_records

    run_dir = os.path.join(tmp, label)
    os.makedirs(run_dir)
    cfg = dict(variant=variant, namespaces=net.namespaces, addrs=list(net.addrs),
               addr={str(r): net.addrs[r] for r in range(SITES)},
               d_model=args.d_model, heads=args.heads, layers=args.layers, context=args.context,
               batch_size=args.batch_size, eval_windows=args.eval_windows, iters=args.iters,
               sync_every=args.sync_every, fragments=2, overlap_steps=1, replicas=SITES,
               outer="nesterov" if variant == "dk-nesterov" else "dlion",
               ranks_per_site=RANKS, min_sites=2, inner_lr=args.inner_lr, outer_lr=None,
               kill_at=args.kill_at, kill_site=VICTIM, restart_at=args.restart_at,
               eval_every=args.eval_every, weight_decay=args.weight_decay, seed=args.seed,
               timeout=args.collective_timeout, quorum_timeout=600.0,
               join_timeout_ms=args.join_timeout_ms, quorum_tick_ms=100,
               out=os.path.join(run_dir, "site{site}-rank{position}.jsonl"),
               ports_file=os.path.join(run_dir, "ports-{site}-{start}"),
               go_file=os.path.join(run_dir, "go"),
               lighthouse_file=os.path.join(run_dir, "lighthouse"))
    cfg_path = os.path.join(run_dir, "cfg.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    env = dict(os.environ, PYTHONPATH=common.REPO_ROOT + os.pathsep
               + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1", RUST_LOG="warn")
    victims = {f"site{VICTIM}-{q}" for q in range(RANKS)}
    run = be.Processes(variant, os.path.abspath(__file__), run_dir, net, env, args.timeout,
                       victims=victims)
    procs = run.procs
    path = {(r, q): cfg["out"].format(site=r, position=q) for r in range(SITES)
            for q in range(RANKS)}
    before = [net.counters(k) for k in range(SITES)]
    load_start, go_t, t0 = be._load(), None, time.time()
    # the Lighthouse of this script's own config (bench_elastic's, with our file names)
    try:
        run.start("lighthouse", 0, ["--lighthouse", cfg_path])
        run.wait("the Lighthouse", lambda: os.path.exists(cfg["lighthouse_file"]))
        cfg["lighthouse"] = be._published(cfg["lighthouse_file"])
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        for r in range(SITES):
            for q in range(RANKS):
                run.start(f"site{r}-{q}", r, ["--rank", cfg_path, str(r), str(q)])
        names = [f"site{r}-{q}" for r in range(SITES) for q in range(RANKS)]
        if args.kill_at is not None:
            for q in range(RANKS):
                run.start(f"restart-{q}", VICTIM, ["--rank", cfg_path, str(VICTIM), str(q),
                                                   "--restart"])
            run.wait("the kill", lambda: all(procs[v].poll() is not None for v in victims))
            survivors = [k for k in path if k[0] != VICTIM]
            run.wait("the survivors' steps", lambda: all(
                any(x.get("step", 0) >= args.restart_at for x in read_records(path[k]))
                for k in survivors))
            go_t = time.time()
            open(cfg["go_file"], "w").close()
            names = [n for n in names if n not in victims] + [f"restart-{q}"
                                                              for q in range(RANKS)]
        run.finish(names)
    finally:
        run.stop()
        be._keep(run_dir, os.path.join(args.out, "runs", label))
    after = [net.counters(k) for k in range(SITES)]
    records = {k: read_records(v) for k, v in path.items()}
    row = measure(variant, records, t0, go_t, args)
    row.update(load_start=load_start, load_end=be._load(), shaper=net.shaper)
    if before[0] is not None:
        row["link_bytes_node0"] = after[0]["veth_tx"] - before[0]["veth_tx"]
        syncs = sum(1 for x in records[(0, 0)] if "sync" in x)
        row["link_bytes_node0_per_sync"] = round(row["link_bytes_node0"] / max(syncs, 1))
    return row


def measure(variant, records, t0, go_t, args) -> dict:
    steps = {k: [x for x in rs if "step" in x] for k, rs in records.items()}
    syncs = {k: [x for x in rs if "sync" in x] for k, rs in steps.items()}
    survivors = [k for k in records if k[0] != VICTIM]
    lost = max((sum(not x["committed"] for x in syncs[k]) for k in survivors), default=0)
    curve = [(x["t"] - t0, x["step"], x["val"]) for x in syncs[(0, 0)] if "val" in x]
    ms = [x["ms"] for k in survivors for x in steps[k][5:] if "sync" not in x]
    per_sync = [x["inter"] for k in survivors for x in syncs[k]
                if x.get("committed") and "inter" in x]
    heal = None
    if go_t is not None:
        first = min((x["t"] for q in range(RANKS) for x in syncs[(VICTIM, q)]
                     if x["committed"] and x["t"] >= go_t), default=None)
        heal = None if first is None else first - go_t
    return dict(variant=variant, final_val_loss=curve[-1][2] if curve else None, curve=curve,
                syncs_lost=lost, heal_s=heal, inner_step_ms=statistics.median(ms) if ms else None,
                exchange_bytes_per_rank_per_sync=statistics.median(per_sync) if per_sync
                else None, wall_s=max(x["t"] for rs in steps.values() for x in rs) - t0)


# ----------------------------------------------------------------------------- report


def time_to(curve, target):
    return next((t for t, _, loss in curve if loss <= target), None)


TARGETS = ("dk-nesterov", "torchft", "dk")  # the final losses the times are measured to


def summarize(rows) -> list[dict]:
    """Per rate and variant: the medians of its runs, and the time it took to reach each
    variant's final loss at this rate (the median of that variant's runs; None: not reached in
    the run), with torchft's time to it over this one's."""
    out = []
    for rate in dict.fromkeys(r["rate_gbps"] for r in rows):
        at = [r for r in rows if r["rate_gbps"] == rate and "failed" not in r]
        targets = {}
        for v in TARGETS:
            finals = [r["final_val_loss"] for r in at if r["variant"] == v
                      and r["final_val_loss"] is not None]
            if finals:
                targets[v] = statistics.median(finals)
        for variant in VARIANTS:
            rs = [r for r in at if r["variant"] == variant]
            if not rs:
                continue

            def med(key, rs=rs):
                vals = [r[key] for r in rs if r.get(key) is not None]
                return statistics.median(vals) if vals else None

            row = dict(rate_gbps=rate, variant=variant, runs=len(rs),
                       final_val_loss=med("final_val_loss"), wall_s=med("wall_s"),
                       inner_step_ms=med("inner_step_ms"),
                       syncs_lost=max(r["syncs_lost"] for r in rs), heal_s=med("heal_s"),
                       link_bytes_node0_per_sync=med("link_bytes_node0_per_sync"),
                       exchange_bytes_per_rank_per_sync=med(
                           "exchange_bytes_per_rank_per_sync"))
            for v, target in targets.items():
                reach = [t for t in (time_to(r["curve"], target) for r in rs) if t is not None]
                row[f"to_{v}_s"] = statistics.median(reach) if reach else None
            out.append(row)
        ft = next((s for s in out if s["rate_gbps"] == rate and s["variant"] == "torchft"), None)
        for s in out:
            if s["rate_gbps"] != rate or ft is None or s is ft:
                continue
            for v in targets:
                if s.get(f"to_{v}_s") and ft.get(f"to_{v}_s"):
                    s[f"torchft_ratio_to_{v}"] = ft[f"to_{v}_s"] / s[f"to_{v}_s"]
            if s.get("link_bytes_node0_per_sync") and ft.get("link_bytes_node0_per_sync"):
                s["link_bytes_ratio"] = s["link_bytes_node0_per_sync"] / \
                    ft["link_bytes_node0_per_sync"]
    return out


COLUMNS = [("rate_gbps", "Gbit/s"), ("variant", "variant"), ("runs", "runs"),
           ("final_val_loss", "final val loss", ".4f"), ("wall_s", "wall (s)", ".1f"),
           ("to_dk-nesterov_s", "s to Nesterov's final loss", ".1f"),
           ("to_torchft_s", "s to torchft's final loss", ".1f"),
           ("torchft_ratio_to_torchft", "torchft's time to it / this", ".1f"),
           ("to_dk_s", "s to dk's final loss", ".1f"),
           ("inner_step_ms", "ms / inner step", ".0f"),
           ("syncs_lost", "syncs lost (1 failure)"), ("heal_s", "time to heal (s)", ".1f"),
           ("link_bytes_node0_per_sync", "node 0 link bytes / sync", ",.0f"),
           ("link_bytes_ratio", "this / torchft's link bytes", ".3f"),
           ("exchange_bytes_per_rank_per_sync", "exchange bytes / rank / sync", ",.0f")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", nargs="+", type=float, default=[0.1, 0.01],
                    help="Gbit/s per site link (0: loopback, no namespaces)")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8, help="windows per rank per step")
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--eval-every", type=int, default=4, help="fragment syncs")
    ap.add_argument("--iters", type=int, default=240)
    ap.add_argument("--sync-every", type=int, default=8)
    ap.add_argument("--inner-lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=1e-2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kill-at", type=int, default=80)
    ap.add_argument("--restart-at", type=int, default=120)
    ap.add_argument("--collective-timeout", type=float, default=60.0)
    ap.add_argument("--join-timeout-ms", type=int, default=60000)
    ap.add_argument("--timeout", type=float, default=3600.0, help="per run, seconds")
    ap.add_argument("--smoke", action="store_true", help="loopback, a tiny model, few steps")
    ap.add_argument("--out", default=None)
    ap.add_argument("--lighthouse", metavar="CFG", help=argparse.SUPPRESS)
    ap.add_argument("--rank", nargs=3, metavar=("CFG", "SITE", "POSITION"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--restart", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--summarize", metavar="FOLDER",
                    help="write FOLDER/summary.md again from its sites.json (no run)")
    args = ap.parse_args(argv)
    if args.summarize:
        with open(os.path.join(args.summarize, "sites.json")) as f:
            data = json.load(f)
        data["summary"] = summarize(data["rows"])
        text = common.markdown_table(data["summary"], COLUMNS)
        with open(os.path.join(args.summarize, "summary.md"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(args.summarize, "sites.json"), "w") as f:
            json.dump(data, f, indent=1)
        print(text)
        return 0
    if args.lighthouse:
        be._lighthouse(args.lighthouse)
        return 0
    if args.rank:
        _site_rank(args.rank[0], int(args.rank[1]), int(args.rank[2]), args.restart)
        return 0
    if args.smoke:  # the stack and torchft's, through the failure (the fp32 one of ours: no)
        args.rates, args.repeats = [0.0], 1
        args.variants = [v for v in args.variants if v != "dk-nesterov"] or ["dk"]
        args.d_model, args.layers, args.heads, args.context = 16, 2, 2, 16
        args.batch_size, args.eval_windows, args.iters, args.sync_every = 2, 8, 28, 4
        args.kill_at, args.restart_at, args.eval_every = 8, 12, 2
    if not args.kill_at < args.restart_at < args.iters:
        ap.error("--kill-at < --restart-at < --iters")
    args.out = args.out or os.path.join(common.RESULTS_DIR, time.strftime("sites-%Y%m%d-%H%M%S"))
    os.makedirs(args.out, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="dlion-bench-sites-") as tmp:
        for rate in args.rates:
            if rate:
                network.check_privileges("dlst")
                topo = network.Topology(SITES, rate * 1000, ranks_per_node=RANKS, prefix="dlst")
                ctx = topo
            else:
                topo, ctx = None, None
            net = be.Shaped(topo) if topo else be.Local()
            with (ctx if ctx is not None else _null()):
                for k in range(args.repeats):
                    for variant in args.variants:
                        label = f"{variant}-{rate:g}-{k}"
                        try:
                            row = one_run(variant, args, net, tmp, label)
                        except Exception as e:  # kept, and the other runs go on
                            row = dict(variant=variant, failed=str(e)[-3000:])
                            print(f"{label}: failed: {str(e)[-500:]}", flush=True)
                        row.update(rate_gbps=rate, repeat=k)
                        rows.append(row)
                        shown = {k2: v for k2, v in row.items() if k2 != "curve"}
                        print(f"{label}: {json.dumps(shown)}", flush=True)
                        with open(os.path.join(args.out, "sites.json"), "w") as f:
                            json.dump(dict(args=vars(args), rows=rows), f, indent=1)
    summary = summarize(rows)
    text = common.markdown_table(summary, COLUMNS)
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "sites.json"), "w") as f:
        json.dump(dict(args=vars(args), rows=rows, summary=summary), f, indent=1)
    print(text)
    print(f"results in {args.out}")
    return 0 if all("failed" not in r for r in rows) else 1


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    sys.exit(main())
