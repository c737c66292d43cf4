"""torchft's own DDP against ``dk.DistributedLion(manager=)`` through the same failure, on the
emulated network.

    python bench/bench_elastic.py --rates 1 --repeats 2

Both variants train the same MLP (``--dim`` -> ``--hidden`` -> ``--dim``, ReLU; 16.8M parameters
by default; each replica regresses its own random inputs onto themselves, ``--batch`` rows) with
3 replica processes of one rank each, under a torchft Lighthouse, every replica with its own
TCPStore and ``torchft.Manager`` (gloo, ``min_replica_size=2``, synchronous quorum):

- torchft-ddp: ``torchft.ddp.DistributedDataParallel`` (its fp32 all-reduce of the gradient
  buckets through ``Manager.allreduce``) and ``torchft.optim.OptimizerWrapper`` around
  ``torch.optim.AdamW``; healing copies the model's and AdamW's state dicts;
- dk-dlion: ``dk.DistributedLion(manager=)`` (vote/binary, ``heal_momentum="own"``); healing
  copies the parameters and the step count.

The failure: replica 2 is killed with SIGKILL in the middle of step ``--kill-at`` (after its
forward, before its backward: the others' collectives of that step fail). A process for its
restart is started with the others (torch imported) and waits; once the survivors have committed
step ``--restart-at`` it is told to go, with the same replica id: it joins a quorum, heals from a
live replica and votes again. The replicas train until a step >= ``--steps`` commits with all 3.

Network (``network.py``): 3 namespaces of one replica each, each node's link shaped to the rate
(Gbit/s) both ways; the Lighthouse runs in node 0's namespace (its heartbeats and quorum RPCs
cross the links too). torchft advertises its servers by host name, and the namespaces share the
machine's host name, which resolves outside them: each replica advertises its node's address
instead (``Manager(hostname=)``, and the host name its checkpoint server reports). ``--rates 0``:
no namespaces, all on this machine's loopback (what ``--smoke`` runs; no root needed).

Measured per run, from each replica's line per step attempt (time, torchft step, committed,
participants) and the links' byte counters:

- ms per committed step with 3 replicas (median of the intervals between two consecutive
  committed 3-replica steps of replica 0 after ``--warmup`` steps), and with the 2 survivors;
- steps lost: attempts of a survivor that did not commit (the most over the survivors);
- time to heal: from the go to the restarted replica's first committed step (its first counted
  vote, or its first all-reduce that counted for DDP);
- bytes per step: the figure for the step's participants (D-Lion's last_stats, measured on every
  step; DDP: a ring all-reduce of the fp32 gradients, 2 (n-1)/n 4d) and what node 0's link
  carried per committed step over the whole run (healing and the quorum's RPCs included).

The variants run interleaved (ddp, dlion, ddp, dlion, ...) on the same network, so both see the
same load from whatever else runs on the machine; the load average is recorded at every run.
Writes bench/results/elastic-<timestamp>/ (or --out): elastic.json/.csv (one row per run),
summary.md, and elastic-<rate>.png (replica 0's committed steps against time) with matplotlib.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

VARIANTS = ("torchft-allreduce", "dk-dlion", "torchft-ddp")
DEFAULT_VARIANTS = VARIANTS[:2]
BUCKET = 25 * 2**20 // 4  # DDP's default bucket_cap_mb, in fp32 elements
REPLICAS = 3
VICTIM = 2


def _load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


# ----------------------------------------------------------------------------- processes


def _lighthouse(cfg_path: str) -> None:
    """The Lighthouse of one run, in node 0's namespace; writes its port, serves until killed."""
    os.environ.setdefault("RUST_LOG", "warn")
    from torchft.coordination import LighthouseServer

    with open(cfg_path) as f:
        cfg = json.load(f)
    house = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=cfg["join_timeout_ms"])
    port = house.address().rsplit(":", 1)[1]
    with open(cfg["lighthouse_file"] + ".tmp", "w") as f:
        f.write(f"http://{cfg['addrs'][0]}:{port}")
    os.rename(cfg["lighthouse_file"] + ".tmp", cfg["lighthouse_file"])
    signal.sigwait([signal.SIGTERM, signal.SIGINT])
    house.shutdown()


def _replica(cfg_path: str, index: int, restart: bool) -> None:
    """One replica of one run (module docstring); one JSON line per step attempt."""
    import socket

    with open(cfg_path) as f:
        cfg = json.load(f)
    addr = cfg["addrs"][index]
    if cfg["namespaces"]:  # the host name resolves outside the namespace: advertise the node
        socket.gethostname = lambda: addr
    os.environ.setdefault("RUST_LOG", "warn")
    from datetime import timedelta

    import torch
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    import dlion_kernels as dk
    from dlion_kernels.demo.elastic import end_replica, read_records

    torch.set_num_threads(1)
    lines = open(cfg["out"].format(index), "a")

    def write(**record):
        lines.write(json.dumps(dict(t=time.time(), **record)) + "\n")
        lines.flush()

    import torch._dynamo  # noqa: F401  (what torch.optim loads at a first step: not in the heal)

    if restart:
        while not os.path.exists(cfg["go_file"]):
            time.sleep(0.02)
    write(event="start")
    with open(cfg["lighthouse_file"]) as f:
        lighthouse = f.read()
    torch.manual_seed(0)  # the same initial weights on every replica
    model = torch.nn.Sequential(torch.nn.Linear(cfg["dim"], cfg["hidden"]), torch.nn.ReLU(),
                                torch.nn.Linear(cfg["hidden"], cfg["dim"]))
    params = list(model.parameters())
    store = TCPStore(addr, 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=cfg["timeout"])
    ddp = cfg["variant"].startswith("torchft")
    state = {}
    if ddp:
        def save():
            return {"model": model.state_dict(), "optim": state["inner"].state_dict()}

        def load(sd):
            model.load_state_dict(sd["model"])
            state["inner"].load_state_dict(sd["optim"])
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load if ddp else None,
                      state_dict=save if ddp else None, min_replica_size=2,
                      use_async_quorum=False, replica_id=f"replica{index}", store_addr=addr,
                      store_port=store.port, rank=0, world_size=1, lighthouse_addr=lighthouse,
                      hostname=addr, timeout=timeout, quorum_timeout=timedelta(seconds=300),
                      connect_timeout=timeout)
    buckets = []
    if ddp:
        from torchft.optim import OptimizerWrapper

        state["inner"] = torch.optim.AdamW(params, lr=cfg["adamw_lr"])
        opt = OptimizerWrapper(manager, state["inner"])
        net = model
        if cfg["variant"] == "torchft-ddp":
            from torchft.ddp import DistributedDataParallel

            net = DistributedDataParallel(manager, model)
        else:  # DDP's buckets (25 MB, last layers first), each through Manager.allreduce
            for p in reversed(params):
                if not buckets or sum(q.numel() for q in buckets[-1]) + p.numel() > BUCKET:
                    buckets.append([])
                buckets[-1].append(p)
    else:
        net = model
        opt = dk.DistributedLion(params, lr=cfg["lion_lr"], manager=manager)
    write(event="ready")
    if not restart:  # the first quorum together: a replica late by more than the join timeout
        # would start a quorum of its own, and quorums of 2 would alternate from then on
        while not all(any(r.get("event") == "ready" for r in read_records(cfg["out"].format(i)))
                      for i in range(REPLICAS)):
            time.sleep(0.05)
    while True:
        opt.zero_grad()  # the quorum (a restarted replica heals here)
        before = manager.current_step()
        step = before + 1
        gen = torch.Generator().manual_seed(1000 * step + index)
        x = torch.randn(cfg["batch"], cfg["dim"], generator=gen)
        loss = torch.nn.functional.mse_loss(net(x), x)
        if (index == VICTIM and not restart and step >= cfg["kill_at"]
                and manager.num_participants() == REPLICAS):
            lines.close()
            os.kill(os.getpid(), signal.SIGKILL)  # mid-step: the others' collectives fail
        loss.backward()
        if buckets:
            flats = [torch.cat([p.grad.view(-1) for p in b]) for b in buckets]
            works = [manager.allreduce(f) for f in flats]  # the mean; errors go to the manager
            for b, f, w in zip(buckets, flats, works):
                w.wait()
                offset = 0
                for p in b:
                    p.grad.copy_(f[offset:offset + p.numel()].view_as(p.grad))
                    offset += p.numel()
        opt.step()
        n = manager.num_participants()
        if ddp:
            committed = manager.current_step() > before
            sent = round(2 * (n - 1) / n * 4 * sum(p.numel() for p in params))
        else:
            s = opt.last_stats
            committed, sent = s.committed, s.bytes_sent
        write(step=manager.current_step(), committed=committed, n=n, sent=sent,
              loss=loss.item())
        if committed and manager.current_step() >= cfg["steps"] and n == REPLICAS:
            break
    end_replica(lines, manager)


class Local:
    """No namespaces: every process on this machine's loopback."""

    namespaces = False
    addrs = ["127.0.0.1"] * REPLICAS
    shaper = "none"

    def argv(self, node, argv):
        return argv

    def env(self, node):
        return {}

    def counters(self, node):
        return None


class Shaped:
    """The emulated network: one namespace per replica (``network.Topology``)."""

    namespaces = True

    def __init__(self, topo):
        self.topo, self.addrs, self.shaper = topo, topo.addrs, topo.shaper

    def argv(self, node, argv):
        return ["ip", "netns", "exec", self.topo.hosts[node]] + argv

    def env(self, node):
        return {"GLOO_SOCKET_IFNAME": self.topo.host_if[node]}

    def counters(self, node):
        return self.topo.counters(node)


def one_run(variant: str, args, net, tmp: str, label: str) -> dict:
    """One variant through the failure on ``net``; returns the row (``measure``)."""
    from dlion_kernels.demo.elastic import read_records

    run_dir = os.path.join(tmp, label)
    os.makedirs(run_dir)
    cfg = dict(variant=variant, addrs=net.addrs, namespaces=net.namespaces, dim=args.dim,
               hidden=args.hidden, batch=args.batch, steps=args.steps, kill_at=args.kill_at,
               lion_lr=args.lion_lr, adamw_lr=args.adamw_lr, timeout=args.collective_timeout,
               join_timeout_ms=args.join_timeout_ms,
               out=os.path.join(run_dir, "replica{}.jsonl"),
               go_file=os.path.join(run_dir, "go"),
               lighthouse_file=os.path.join(run_dir, "lighthouse"))
    cfg_path = os.path.join(run_dir, "cfg.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    env = dict(os.environ, PYTHONPATH=common.REPO_ROOT + os.pathsep
               + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1", RUST_LOG="warn",
               **common.CACHING_MALLOC_ENV)
    me = os.path.abspath(__file__)
    logs, procs = [], {}

    def start(name, node, argv):
        log = open(os.path.join(run_dir, f"{name}.log"), "w")
        logs.append(log)
        procs[name] = subprocess.Popen(net.argv(node, [sys.executable, me] + argv),
                                       env=dict(env, **net.env(node)), stdout=log,
                                       stderr=subprocess.STDOUT)

    def fail(why):
        for log in logs:
            log.flush()
        if args.keep_failed:  # the logs of a failed run, next to the results
            keep = os.path.join(args.keep_failed, f"failed-{label}")
            os.makedirs(keep, exist_ok=True)
            for log in logs:
                with open(log.name) as f, open(os.path.join(keep, os.path.basename(log.name)),
                                               "w") as g:
                    g.write(f.read()[-20000:])
        tails = "".join(open(log.name).read()[-2000:] for log in logs)
        raise RuntimeError(f"{variant}: {why}\n{tails}")

    def wait(what, condition, limit):
        end = time.monotonic() + limit
        while not condition():
            bad = {k: p.returncode for k, p in procs.items()
                   if p.poll() not in (None, 0) and not (k == "replica2" and p.returncode
                                                         == -signal.SIGKILL)}
            if bad or time.monotonic() > end:
                fail(f"waiting for {what}: exit codes {bad}")
            time.sleep(0.05)

    path = cfg["out"].format
    before = [net.counters(k) for k in range(REPLICAS)]
    load_start = _load()
    try:
        start("lighthouse", 0, ["--lighthouse", cfg_path])
        wait("the Lighthouse", lambda: os.path.exists(cfg["lighthouse_file"]), 120)
        for i in range(REPLICAS):
            start(f"replica{i}", i, ["--replica", cfg_path, str(i)])
        start("restart", VICTIM, ["--replica", cfg_path, str(VICTIM), "--restart"])
        wait("the kill", lambda: procs[f"replica{VICTIM}"].poll() is not None, args.timeout)
        if procs[f"replica{VICTIM}"].returncode != -signal.SIGKILL:
            fail(f"replica {VICTIM} was to be killed; exit code "
                 f"{procs[f'replica{VICTIM}'].returncode}")
        survivors = [i for i in range(REPLICAS) if i != VICTIM]
        wait("the survivors' steps", lambda: all(
            any(r.get("committed") and r["step"] >= args.restart_at for r in read_records(path(i)))
            for i in survivors), args.timeout)
        go_t = time.time()
        open(cfg["go_file"], "w").close()
        names = ["replica0", "replica1", "restart"]
        wait("the end", lambda: all(procs[k].poll() is not None for k in names), args.timeout)
        codes = {k: procs[k].returncode for k in names}
        if any(codes.values()):
            fail(f"exit codes {codes}")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate() if p is procs.get("lighthouse") else p.kill()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        for log in logs:
            log.close()
    after = [net.counters(k) for k in range(REPLICAS)]
    records = [read_records(path(i)) for i in range(REPLICAS)]
    row = measure(variant, records, go_t, args)
    row.update(load_start=load_start, load_end=_load(), shaper=net.shaper)
    if before[0] is not None:
        wire = after[0]["veth_tx"] - before[0]["veth_tx"]
        row["link_bytes_per_committed_step"] = round(wire / row["committed_steps"])
    return row


def measure(variant, records, go_t, args) -> dict:
    steps = [[r for r in rs if "step" in r] for rs in records]
    r0 = steps[0]
    survivors = [i for i in range(REPLICAS) if i != VICTIM]
    lost = max(sum(not r["committed"] for r in steps[i]) for i in survivors)

    def intervals(n):
        out = []
        for a, b in zip(r0, r0[1:]):
            if (a["committed"] and b["committed"] and a["n"] == b["n"] == n
                    and a["step"] >= args.warmup):
                out.append(b["t"] - a["t"])
        return out

    three, two = intervals(3), intervals(2)
    after = [r for r in records[VICTIM] if r["t"] >= go_t]
    first = next((r for r in after if r.get("committed")), None)
    ready = next((r["t"] for r in after if r.get("event") == "ready"), None)
    committed = [r for r in r0 if r["committed"]]
    sent = {}
    for r in committed:
        sent.setdefault(r["n"], r["sent"])
    return dict(variant=variant, steps_run=len(r0), committed_steps=len(committed),
                final_step=committed[-1]["step"] if committed else 0,
                ms_per_step_3=1e3 * statistics.median(three) if three else None,
                ms_per_step_2=1e3 * statistics.median(two) if two else None,
                intervals_3=len(three), intervals_2=len(two), steps_lost=lost,
                heal_s=None if first is None else first["t"] - go_t,
                ready_s=None if ready is None else ready - go_t,
                first_vote_step=None if first is None else first["step"],
                bytes_per_step_3=sent.get(3), bytes_per_step_2=sent.get(2),
                wall_s=(r0[-1]["t"] - r0[0]["t"]) if r0 else None,
                curve=[(r["t"] - r0[0]["t"], r["step"], r["n"], r["committed"]) for r in r0])


# ----------------------------------------------------------------------------- report


def summarize(rows) -> list[dict]:
    out = []
    for rate in dict.fromkeys(r["rate_gbps"] for r in rows):
        for variant in VARIANTS:
            every = [r for r in rows if r["rate_gbps"] == rate and r["variant"] == variant]
            rs = [r for r in every if "failed" not in r]
            if len(rs) < len(every):
                out.append(dict(rate_gbps=rate, variant=variant, runs=len(every),
                                failed=f"{len(every) - len(rs)} of {len(every)} runs failed"))
            if not rs:
                continue

            def med(key, rs=rs):
                vals = [r[key] for r in rs if r.get(key) is not None]
                return statistics.median(vals) if vals else None

            out.append(dict(rate_gbps=rate, variant=variant, runs=len(rs),
                            ms_per_step_3=med("ms_per_step_3"),
                            ms_per_step_2=med("ms_per_step_2"),
                            steps_lost=max(r["steps_lost"] for r in rs),
                            heal_s=med("heal_s"), ready_s=med("ready_s"),
                            bytes_per_step_3=rs[0]["bytes_per_step_3"],
                            bytes_per_step_2=rs[0]["bytes_per_step_2"],
                            link_bytes_per_committed_step=med("link_bytes_per_committed_step")))
        ddp = next((s for s in out if s["rate_gbps"] == rate and s["variant"] == VARIANTS[0]
                    and s.get("ms_per_step_3")), None)
        for s in out:
            if s["rate_gbps"] == rate and ddp and s.get("ms_per_step_3"):
                s["ddp_time_ratio"] = ddp["ms_per_step_3"] / s["ms_per_step_3"]
    return out


COLUMNS = [("rate_gbps", "Gbit/s"), ("variant", "variant"), ("runs", "runs"),
           ("ms_per_step_3", "ms / committed step, 3 replicas", ".0f"),
           ("ms_per_step_2", "ms / committed step, 2 survivors", ".0f"),
           ("ddp_time_ratio", "torchft-allreduce's time / this", ".1f"),
           ("steps_lost", "steps lost (1 failure)"),
           ("heal_s", "time to heal (s)", ".2f"),
           ("ready_s", "of which store, Manager, model (s)", ".2f"),
           ("bytes_per_step_3", "bytes / replica / step (3)", ",.0f"),
           ("link_bytes_per_committed_step", "node 0 link bytes / committed step", ",.0f"),
           ("failed", "failed")]


def _plot(out, rate, rows) -> str | None:
    plt = common.pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for r in rows:
        pts = [(t, s) for t, s, _, c in r["curve"] if c]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", ms=3,
                color="tab:blue" if r["variant"] == "dk-dlion" else "tab:orange",
                label=r["variant"] if r["repeat"] == 0 else None)
    ax.set_xlabel("wall time (s) from replica 0's first step")
    ax.set_ylabel("committed steps")
    ax.set_title(f"{rate:g} Gbit/s: replica 2 killed, restarted, healed")
    ax.legend()
    return common.save_figure(fig, out, f"elastic-{rate:g}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(ap)
    ap.add_argument("--rates", type=float, nargs="+", default=[1.0],
                    help="Gbit/s per node; 0: no namespaces, loopback (default 1)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(DEFAULT_VARIANTS))
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--kill-at", type=int, default=10)
    ap.add_argument("--restart-at", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lion-lr", type=float, default=1e-4)
    ap.add_argument("--adamw-lr", type=float, default=1e-3)
    ap.add_argument("--collective-timeout", type=float, default=60.0)
    ap.add_argument("--join-timeout-ms", type=int, default=5000,
                    help="the Lighthouse's wait for a replica that heartbeats but has not asked "
                    "for the quorum yet (default 5000: on a loaded machine steps of the replicas "
                    "end seconds apart, and with 1000 the quorums split into pairs)")
    ap.add_argument("--timeout", type=float, default=900.0, help="per run (s)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--keep-failed", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--lighthouse", help=argparse.SUPPRESS)
    ap.add_argument("--replica", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--restart", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.lighthouse:
        _lighthouse(args.lighthouse)
        return 0
    if args.replica:
        _replica(args.replica[0], int(args.replica[1]), args.restart)
        return 0
    if args.smoke:
        args.rates, args.repeats, args.dim, args.hidden = [0.0], 1, 64, 128
        args.steps, args.kill_at, args.restart_at, args.warmup = 12, 5, 6, 1
    if not 1 <= args.kill_at <= args.restart_at < args.steps:
        ap.error("need 1 <= --kill-at <= --restart-at < --steps")
    import network

    out = common.results_dir("elastic", args.out)
    args.keep_failed = out
    meta = common.metadata({"load_start": _load()})
    rows = []
    if any(args.rates):
        network.check_privileges("dlel")
        network.install_signal_handlers()
    with tempfile.TemporaryDirectory(prefix="dlion-elastic-") as tmp:
        for rate in args.rates:
            topo = network.Topology(REPLICAS, rate * 1000, prefix="dlel") if rate else None
            try:
                net = Shaped(topo.__enter__()) if topo else Local()
                for rep in range(args.repeats):
                    for variant in args.variants:  # interleaved: both see the same load
                        label = f"{variant}-{rate:g}-{rep}"
                        print(f"{label}: ...", flush=True)
                        try:
                            row = one_run(variant, args, net, tmp, label)
                        except RuntimeError as e:  # reported, not fatal: the others still run
                            why = [ln for ln in str(e).splitlines() if "Error" in ln]
                            row = dict(variant=variant, failed=str(e).splitlines()[0],
                                       errors=sorted(set(why))[:4], curve=[])
                            print(f"  FAILED: {row['failed']}; {row['errors']}", flush=True)
                            rows.append(dict(row, rate_gbps=rate, repeat=rep))
                            continue
                        row.update(rate_gbps=rate, repeat=rep)
                        rows.append(row)
                        common.save(out, "elastic", [{k: v for k, v in r.items() if k != "curve"}
                                                     for r in rows], meta, partial=True)
                        print(f"  {row['ms_per_step_3'] or 0:.0f} ms / step (3 replicas), "
                              f"{row['ms_per_step_2'] or 0:.0f} ms (2), steps lost "
                              f"{row['steps_lost']}, heal {row['heal_s'] or -1:.2f} s, load "
                              f"{row['load_end']}", flush=True)
            finally:
                if topo:
                    topo.close()
    meta["load_end"] = _load()
    table = summarize(rows)
    text = common.markdown_table(table, COLUMNS)
    print(text)
    common.save_text(out, "summary.md", text)
    common.save(out, "elastic", [{k: v for k, v in r.items() if k != "curve"} for r in rows],
                meta, summary=table, curves={f"{r['variant']}-{r['rate_gbps']:g}-{r['repeat']}":
                                             r["curve"] for r in rows}, args=vars(args))
    for rate in args.rates:
        common.plot_unless(args.no_plot, lambda rate=rate: _plot(
            out, rate, [r for r in rows if r["rate_gbps"] == rate]))
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
