"""torchft's own DDP against ``dk.DistributedLion(manager=)`` through the same failure, on the
emulated network, and the plain ``dk.DistributedLion`` on the same network without a failure.

    python bench/bench_elastic.py --rates 1 --repeats 2

Every variant trains the same MLP (``--dim`` -> ``--hidden`` -> ``--dim``, ReLU; 16.8M parameters
by default; each replica regresses its own random inputs onto themselves, ``--batch`` rows, the
same rows for the same step in every variant) with 3 processes of one rank each. The elastic
variants run them as replicas under a torchft Lighthouse, every replica with its own TCPStore and
``torchft.Manager`` (gloo, ``min_replica_size=2``, synchronous quorum):

- torchft-allreduce (default): torchft's Manager and ``torchft.optim.OptimizerWrapper`` around
  ``torch.optim.AdamW``, the gradients in DDP's buckets (25 MB, last layers first), each an fp32
  all-reduce through ``Manager.allreduce``; healing copies the model's and AdamW's state dicts;
- torchft-ddp: the same with ``torchft.ddp.DistributedDataParallel`` doing the all-reduce;
- dk-dlion (default): ``dk.DistributedLion(manager=)`` (vote/binary, ``heal_momentum="own"``);
  healing copies the parameters and the step count.

and one variant is not elastic:

- dk-dlion-plain (default): ``dk.DistributedLion`` (vote/binary, no manager) in a plain
  ``torch.distributed`` gloo group of the 3 processes (a TCPStore hosted by the first; collective
  timeout ``--collective-timeout``), ``--steps`` steps with no failure, no Lighthouse, no quorum.
  The same optimizer on the same wire as dk-dlion: what separates their time per step with 3
  replicas is what elasticity costs between failures, the quorum that every step asks the
  Lighthouse for, the Manager's commit decision, and the collectives through the Manager's
  process group. Its failure figures are "no failure injected".

The failure (elastic variants): replica 2 is killed with SIGKILL in the middle of step ``--kill-at``
(after its forward, before its backward: the others' collectives of that step fail). A process for
its restart is started with the others (torch imported) and waits; once the survivors have committed
step ``--restart-at`` it is told to go, with the same replica id: it joins a quorum, heals from a
live replica and votes again. The replicas train until a step >= ``--steps`` commits with all 3.

Network (``network.py``): 3 namespaces of one replica each, each node's link shaped to the rate
(Gbit/s) both ways; the Lighthouse and the plain group's TCPStore run in node 0's namespace (their
RPCs cross the links too). torchft advertises its servers by host name, and the namespaces share the
machine's host name, which resolves outside them: each replica advertises its node's address instead
(``Manager(hostname=)``, and the host name its checkpoint server reports). ``--rates 0``: no
namespaces, all on this machine's loopback (what ``--smoke`` runs; no root needed).

Measured per run, from each process's line per step attempt (time, step, committed,
participants; a plain rank's every step commits with 3) and the links' byte counters:

- ms per committed step with 3 replicas (median of the intervals between two consecutive
  committed 3-replica steps of replica 0 after ``--warmup`` steps), the same code for every
  variant, and with the 2 survivors (elastic variants);
- steps lost (elastic variants): attempts of a survivor that did not commit (the most over the
  survivors);
- time to heal (elastic variants): from the go to the restarted replica's first committed step (its
  first counted vote, or its first all-reduce that counted for DDP);
- bytes per step: the figure for the step's participants (D-Lion's last_stats, measured on every
  step; DDP: a ring all-reduce of the fp32 gradients, 2 (n-1)/n 4d) and what node 0's link
  carried per committed step over the whole run (healing and the quorum's RPCs included).

The variants run interleaved (allreduce, dlion, plain, allreduce, dlion, plain, ...) on the same
network, so all see the same load from whatever else runs on the machine; the load average is
recorded at every run. Writes bench/results/elastic-<timestamp>/ (or --out): elastic.json/.csv
(one row per run), runs/<variant>-<rate>-<repeat>/ (each run's raw records, one JSON line per step
attempt and process, and the tails of its logs: kept also when a run fails or is interrupted),
summary.md (the table, then per rate dk-dlion's ms per step with 3 replicas
next to dk-dlion-plain's and their ratio), and elastic-<rate>.png (replica 0's committed steps
against time) with matplotlib.
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

PLAIN = "dk-dlion-plain"  # no Manager and no failure: the elastic D-Lion's speed without them
VARIANTS = ("torchft-allreduce", "dk-dlion", PLAIN, "torchft-ddp")
DEFAULT_VARIANTS = VARIANTS[:3]
NO_FAILURE = "no failure injected"
BUCKET = 25 * 2**20 // 4  # DDP's default bucket_cap_mb, in fp32 elements
REPLICAS = 3
VICTIM = 2


def _load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


# ----------------------------------------------------------------------------- processes


def _publish(path: str, text: str) -> None:
    """Write ``text`` to ``path`` at once (renamed into place: a reader never sees half of it)."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.rename(path + ".tmp", path)


def _published(path: str) -> str:
    """What ``_publish`` wrote to ``path``, once it is there (the caller's run is timed out by
    the parent, which kills it)."""
    while not os.path.exists(path):
        time.sleep(0.02)
    with open(path) as f:
        return f.read()


def _begin(cfg_path: str, index: int):
    """The start of every training process, elastic replica or plain rank: its run's config,
    one thread, and ``write(**record)``, which appends one timed JSON line to its record file."""
    import socket

    with open(cfg_path) as f:
        cfg = json.load(f)
    addr = cfg["addrs"][index]
    if cfg["namespaces"]:  # the host name resolves outside the namespace: advertise the node
        socket.gethostname = lambda: addr
    import torch

    torch.set_num_threads(1)
    lines = open(cfg["out"].format(index), "a")

    def write(**record):
        lines.write(json.dumps(dict(t=time.time(), **record)) + "\n")
        lines.flush()

    return cfg, lines, write


def _model(cfg):
    """The MLP, with the same initial weights in every process."""
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(cfg["dim"], cfg["hidden"]), torch.nn.ReLU(),
                               torch.nn.Linear(cfg["hidden"], cfg["dim"]))


def _forward(net, cfg, step: int, index: int):
    """Replica ``index``'s loss at ``step``: its own random rows regressed onto themselves (a
    step tried again gets the same rows)."""
    import torch

    gen = torch.Generator().manual_seed(1000 * step + index)
    x = torch.randn(cfg["batch"], cfg["dim"], generator=gen)
    return torch.nn.functional.mse_loss(net(x), x)


def _lighthouse(cfg_path: str) -> None:
    """The Lighthouse of one run, in node 0's namespace; writes its port, serves until killed."""
    from dlion_kernels import launch

    with open(cfg_path) as f:
        cfg = json.load(f)
    house = launch.lighthouse(min_replicas=2, join_timeout_ms=cfg["join_timeout_ms"],
                              quorum_tick_ms=cfg["quorum_tick_ms"])
    port = house.address().rsplit(":", 1)[1]
    _publish(cfg["lighthouse_file"], f"http://{cfg['addrs'][0]}:{port}")
    signal.sigwait([signal.SIGTERM, signal.SIGINT])
    house.shutdown()


def _replica(cfg_path: str, index: int, restart: bool) -> None:
    """One replica of one elastic run (module docstring); one JSON line per step attempt."""
    os.environ.setdefault("RUST_LOG", "warn")
    cfg, lines, write = _begin(cfg_path, index)
    addr = cfg["addrs"][index]
    import torch
    import torch._dynamo  # noqa: F401  (what torch.optim loads at a first step: not in the heal)

    import dlion_kernels as dk
    from dlion_kernels import launch
    from dlion_kernels.demo.elastic import end_replica, read_records

    if restart:
        _published(cfg["go_file"])
    write(event="start")
    lighthouse = _published(cfg["lighthouse_file"])
    model = _model(cfg)
    params = list(model.parameters())
    ddp = cfg["variant"].startswith("torchft")
    state = {}
    if ddp:
        def save():
            return {"model": model.state_dict(), "optim": state["inner"].state_dict()}

        def load(sd):
            model.load_state_dict(sd["model"])
            state["inner"].load_state_dict(sd["optim"])
    manager = launch.replica_manager(f"replica{index}", lighthouse, addr=addr,
                                     load_state_dict=load if ddp else None,
                                     state_dict=save if ddp else None, min_replica_size=2,
                                     hostname=addr, timeout=cfg["timeout"], quorum_timeout=300.0)
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
        t0 = time.perf_counter()
        opt.zero_grad()  # the quorum (a restarted replica heals here)
        t1 = time.perf_counter()
        quorum_s = t1 - t0
        before = manager.current_step()
        step = before + 1
        loss = _forward(net, cfg, step, index)
        if (index == VICTIM and not restart and cfg["kill_at"] and step >= cfg["kill_at"]
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
        t0 = time.perf_counter()
        compute_s = t0 - t1
        opt.step()
        step_s = time.perf_counter() - t0
        n = manager.num_participants()
        if ddp:
            committed = manager.current_step() > before
            sent = round(2 * (n - 1) / n * 4 * sum(p.numel() for p in params))
        else:
            s = opt.last_stats
            committed, sent = s.committed, s.bytes_sent
        write(step=manager.current_step(), committed=committed, n=n, sent=sent,
              loss=loss.item(), quorum_ms=round(1e3 * quorum_s, 1),
              compute_ms=round(1e3 * compute_s, 1), step_ms=round(1e3 * step_s, 1))
        if committed and manager.current_step() >= cfg["steps"] and n == REPLICAS:
            break
    end_replica(lines, manager)


def _plain(cfg_path: str, index: int) -> None:
    """One rank of a plain run: the replicas' model, data and D-Lion in a ``torch.distributed``
    gloo group of all of them (no Manager, no quorum, no failure); one JSON line per step, in the
    replicas' record format."""
    cfg, lines, write = _begin(cfg_path, index)
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed import TCPStore

    import dlion_kernels as dk

    timeout = timedelta(seconds=cfg["timeout"])
    if index == 0:  # port 0: a free one in this namespace, told to the others through the file
        store = TCPStore(cfg["addrs"][0], 0, world_size=REPLICAS, is_master=True,
                         wait_for_workers=False, timeout=timeout)
        _publish(cfg["store_file"], str(store.port))
    else:
        store = TCPStore(cfg["addrs"][0], int(_published(cfg["store_file"])),
                         world_size=REPLICAS, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=index, world_size=REPLICAS,
                            timeout=timeout)
    model = _model(cfg)
    opt = dk.DistributedLion(list(model.parameters()), lr=cfg["lion_lr"])
    write(event="ready")
    for step in range(1, cfg["steps"] + 1):
        opt.zero_grad()
        t1 = time.perf_counter()
        loss = _forward(model, cfg, step, index)
        loss.backward()
        t0 = time.perf_counter()
        opt.step()
        step_s = time.perf_counter() - t0
        s = opt.last_stats
        write(step=step, committed=not s.skipped, n=s.world_size, sent=s.bytes_sent,
              loss=loss.item(), quorum_ms=0.0, compute_ms=round(1e3 * (t0 - t1), 1),
              step_ms=round(1e3 * step_s, 1))
    lines.close()
    dist.barrier()  # no rank tears down while another still talks to it (as launch.run_rank)
    dist.destroy_process_group()


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


class Processes:
    """The processes of one run, each started on a node of ``net`` with its output in its own
    log in ``run_dir``. ``wait`` polls a condition under one deadline for the whole run and
    fails it when a process ended with an error (a name in ``victims`` may end by SIGKILL);
    ``fail`` raises with the tails of every log; ``stop`` ends what is left (the Lighthouse by
    SIGTERM, the others by SIGKILL) and closes the logs."""

    def __init__(self, label, script, run_dir, net, env, timeout, victims=()):
        self.label, self.script, self.run_dir, self.net, self.env = (label, script, run_dir, net,
                                                                     env)
        self.deadline = time.monotonic() + timeout
        self.victims = set(victims)
        self.logs, self.procs = [], {}

    def start(self, name, node, argv):
        log = open(os.path.join(self.run_dir, f"{name}.log"), "w")
        self.logs.append(log)
        self.procs[name] = subprocess.Popen(
            self.net.argv(node, [sys.executable, self.script] + argv),
            env=dict(self.env, **self.net.env(node)), stdout=log, stderr=subprocess.STDOUT)

    def fail(self, why):
        for log in self.logs:
            log.flush()
        tails = "".join(open(log.name).read()[-2000:] for log in self.logs)
        raise RuntimeError(f"{self.label}: {why}\n{tails}")

    def wait(self, what, condition):
        while not condition():
            bad = {k: p.returncode for k, p in self.procs.items()
                   if p.poll() not in (None, 0)
                   and not (k in self.victims and p.returncode == -signal.SIGKILL)}
            if bad or time.monotonic() > self.deadline:
                self.fail(f"waiting for {what}: exit codes {bad}")
            time.sleep(0.05)

    def finish(self, names):
        """Waits for ``names`` to end; fails the run unless every one exited with 0."""
        self.wait("the end", lambda: all(self.procs[k].poll() is not None for k in names))
        codes = {k: self.procs[k].returncode for k in names}
        if any(codes.values()):
            self.fail(f"exit codes {codes}")

    def stop(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate() if p is self.procs.get("lighthouse") else p.kill()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        for log in self.logs:
            log.close()


def one_run(variant: str, args, net, tmp: str, label: str) -> dict:
    """One variant on ``net``, through the failure unless it is ``PLAIN``; returns the row
    (``measure``)."""
    from dlion_kernels.demo.elastic import read_records

    run_dir = os.path.join(tmp, label)
    os.makedirs(run_dir)
    cfg = dict(variant=variant, addrs=net.addrs, namespaces=net.namespaces, dim=args.dim,
               hidden=args.hidden, batch=args.batch, steps=args.steps,
               kill_at=None if args.no_failure else args.kill_at,
               lion_lr=args.lion_lr, adamw_lr=args.adamw_lr, timeout=args.collective_timeout,
               join_timeout_ms=args.join_timeout_ms, quorum_tick_ms=args.quorum_tick_ms,
               out=os.path.join(run_dir, "replica{}.jsonl"),
               go_file=os.path.join(run_dir, "go"),
               lighthouse_file=os.path.join(run_dir, "lighthouse"),
               store_file=os.path.join(run_dir, "store"))
    cfg_path = os.path.join(run_dir, "cfg.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    env = dict(os.environ, PYTHONPATH=common.REPO_ROOT + os.pathsep
               + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1", RUST_LOG="warn",
               **common.CACHING_MALLOC_ENV)
    run = Processes(variant, os.path.abspath(__file__), run_dir, net, env, args.timeout,
                    victims=[f"replica{VICTIM}"])
    procs = run.procs
    path = cfg["out"].format
    before = [net.counters(k) for k in range(REPLICAS)]
    load_start = _load()
    go_t = None  # when the restart was told to go; None: no failure (PLAIN, --no-failure)
    try:
        if variant == PLAIN:
            names = [f"rank{i}" for i in range(REPLICAS)]
            for i, name in enumerate(names):
                run.start(name, i, ["--plain-rank", cfg_path, str(i)])
        else:
            run.start("lighthouse", 0, ["--lighthouse", cfg_path])
            run.wait("the Lighthouse", lambda: os.path.exists(cfg["lighthouse_file"]))
            for i in range(REPLICAS):
                run.start(f"replica{i}", i, ["--replica", cfg_path, str(i)])
            names = [f"replica{i}" for i in range(REPLICAS)]
            if not args.no_failure:
                run.start("restart", VICTIM, ["--replica", cfg_path, str(VICTIM), "--restart"])
                run.wait("the kill", lambda: procs[f"replica{VICTIM}"].poll() is not None)
                if procs[f"replica{VICTIM}"].returncode != -signal.SIGKILL:
                    run.fail(f"replica {VICTIM} was to be killed; exit code "
                             f"{procs[f'replica{VICTIM}'].returncode}")
                survivors = [i for i in range(REPLICAS) if i != VICTIM]
                run.wait("the survivors' steps", lambda: all(
                    any(r.get("committed") and r["step"] >= args.restart_at
                        for r in read_records(path(i))) for i in survivors))
                go_t = time.time()
                open(cfg["go_file"], "w").close()
                names = ["replica0", "replica1", "restart"]
        run.finish(names)
    finally:
        run.stop()
        _keep(run_dir, os.path.join(args.keep_runs, "runs", label))
    after = [net.counters(k) for k in range(REPLICAS)]
    records = [read_records(path(i)) for i in range(REPLICAS)]
    row = measure(variant, records, go_t, args)
    row.update(load_start=load_start, load_end=_load(), shaper=net.shaper)
    if before[0] is not None:
        wire = after[0]["veth_tx"] - before[0]["veth_tx"]
        row["link_bytes_per_committed_step"] = round(wire / row["committed_steps"])
    return row


def _keep(run_dir: str, keep: str) -> None:
    """Every run's raw records and the tails of its logs, next to the results (also when the
    run failed or was interrupted)."""
    os.makedirs(keep, exist_ok=True)
    for name in sorted(os.listdir(run_dir)):
        if name.endswith((".jsonl", ".log")):
            with open(os.path.join(run_dir, name)) as f, open(os.path.join(keep, name), "w") as g:
                g.write(f.read() if name.endswith(".jsonl") else f.read()[-20000:])


def measure(variant, records, go_t, args) -> dict:
    """One run's row from its processes' records. ``go_t``: when the restarted replica was told
    to go; None for a run without a failure, whose failure fields (steps lost, time to heal, the
    2 survivors' figures) are None."""
    steps = [[r for r in rs if "step" in r] for rs in records]
    r0 = steps[0]
    survivors = [i for i in range(REPLICAS) if i != VICTIM]
    lost = (None if go_t is None
            else max(sum(not r["committed"] for r in steps[i]) for i in survivors))

    def intervals(n):
        out = []
        for a, b in zip(r0, r0[1:]):
            if (a["committed"] and b["committed"] and a["n"] == b["n"] == n
                    and a["step"] >= args.warmup):
                out.append(b["t"] - a["t"])
        return out

    three, two = intervals(3), intervals(2)
    # the 3-replica steps apart: before the kill, and after the restarted replica's first
    # committed step (its process new, its state healed)
    kill_i = next((i for i, r in enumerate(r0) if not r["committed"]), len(r0))
    healed_t = None if go_t is None else next(
        (r["t"] for r in records[VICTIM] if r.get("committed") and r["t"] >= go_t), None)

    def phase(rs):
        return [b["t"] - a["t"] for a, b in zip(rs, rs[1:])
                if a["committed"] and b["committed"] and a["n"] == b["n"] == 3
                and a["step"] >= args.warmup]

    before = phase(r0[:kill_i])
    after_heal = [] if healed_t is None else phase([r for r in r0 if r["t"] >= healed_t])

    def split(rs, key):
        vals = [r[key] for r in rs if key in r and r["committed"] and r["n"] == 3]
        return statistics.median(vals) if vals else None

    healed_rs = [] if healed_t is None else [r for r in r0 if r["t"] >= healed_t]
    phases = dict(
        ms_per_step_3_before=1e3 * statistics.median(before) if before else None,
        ms_per_step_3_after_heal=1e3 * statistics.median(after_heal) if after_heal else None,
        intervals_3_before=len(before), intervals_3_after_heal=len(after_heal),
        **{f"{k}_before": split(r0[:kill_i], k) for k in ("quorum_ms", "compute_ms", "step_ms")},
        **{f"{k}_after_heal": split(healed_rs, k) for k in ("quorum_ms", "compute_ms", "step_ms")})
    # where rank 0's 3-replica steps go: the quorum (zero_grad) and the exchange with the commit
    # decision (step); the rest is forward, backward and the records
    settled = [r for r in r0 if r["committed"] and r["n"] == 3 and r["step"] >= args.warmup]
    quorum = [r["quorum_ms"] for r in settled if "quorum_ms" in r]
    compute = [r["compute_ms"] for r in settled if "compute_ms" in r]
    exchange = [r["step_ms"] for r in settled if "step_ms" in r]
    after = [] if go_t is None else [r for r in records[VICTIM] if r["t"] >= go_t]
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
                quorum_ms_3=statistics.median(quorum) if quorum else None,
                compute_ms_3=statistics.median(compute) if compute else None,
                step_call_ms_3=statistics.median(exchange) if exchange else None,
                intervals_3=len(three), intervals_2=len(two), steps_lost=lost,
                heal_s=None if first is None else first["t"] - go_t,
                ready_s=None if ready is None else ready - go_t,
                first_vote_step=None if first is None else first["step"],
                bytes_per_step_3=sent.get(3), bytes_per_step_2=sent.get(2), **phases,
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
                            ms_per_step_3_before=med("ms_per_step_3_before"),
                            ms_per_step_3_after_heal=med("ms_per_step_3_after_heal"),
                            **{f"{k}_{p}": med(f"{k}_{p}") for p in ("before", "after_heal")
                               for k in ("quorum_ms", "compute_ms", "step_ms")},
                            quorum_ms_3=med("quorum_ms_3"), compute_ms_3=med("compute_ms_3"),
                            step_call_ms_3=med("step_call_ms_3"),
                            steps_lost=max((r["steps_lost"] for r in rs
                                            if r["steps_lost"] is not None), default=None),
                            heal_s=med("heal_s"), ready_s=med("ready_s"),
                            bytes_per_step_3=rs[0]["bytes_per_step_3"],
                            bytes_per_step_2=rs[0]["bytes_per_step_2"],
                            link_bytes_per_committed_step=med("link_bytes_per_committed_step")))
        ddp, plain = (_timed(out, rate, v) for v in (VARIANTS[0], PLAIN))
        for s in out:
            if s["rate_gbps"] == rate and s.get("ms_per_step_3"):
                if ddp:
                    s["ddp_time_ratio"] = ddp["ms_per_step_3"] / s["ms_per_step_3"]
                if plain:
                    s["plain_time_ratio"] = s["ms_per_step_3"] / plain["ms_per_step_3"]
    return out


def _timed(summary, rate, variant) -> dict | None:
    """``variant``'s summary row at ``rate`` if it has a time per step with 3 replicas."""
    return next((s for s in summary if s["rate_gbps"] == rate and s["variant"] == variant
                 and s.get("ms_per_step_3")), None)


def _rate(rate) -> str:
    return f"{rate:g} Gbit/s" if rate else "loopback"


def report(summary) -> str:
    """summary.md: the table (a run without a failure says so where the failure's figures go),
    then, per rate, the elastic D-Lion's time per step between failures against the plain one's."""
    shown = [dict(s, steps_lost=NO_FAILURE) if s.get("steps_lost") is None and "failed" not in s
             else s for s in summary]
    lines = [common.markdown_table(shown, COLUMNS)]
    for rate in dict.fromkeys(s["rate_gbps"] for s in summary):
        elastic, plain = (_timed(summary, rate, v) for v in ("dk-dlion", PLAIN))
        if elastic and plain:
            lines.append(
                f"{_rate(rate)}: dk-dlion (torchft Manager, a quorum per step) "
                f"{elastic['ms_per_step_3']:.0f} ms per committed step with 3 replicas between "
                f"failures, {PLAIN} (a torch.distributed gloo group, no Manager) "
                f"{plain['ms_per_step_3']:.0f} ms: the elastic step takes "
                f"{elastic['plain_time_ratio']:.2f}x the plain one's time (what the per-step "
                "quorum, commit decision and Manager's process group cost).\n")
    return "\n".join(lines)


COLUMNS = [("rate_gbps", "Gbit/s"), ("variant", "variant"), ("runs", "runs"),
           ("ms_per_step_3", "ms / committed step, 3 replicas", ".0f"),
           ("ms_per_step_2", "ms / committed step, 2 survivors", ".0f"),
           ("ms_per_step_3_before", "3 replicas before the kill", ".0f"),
           ("ms_per_step_3_after_heal", "3 replicas after the heal", ".0f"),
           ("quorum_ms_3", "quorum, 3 replicas (ms)", ".0f"),
           ("compute_ms_3", "forward and backward (ms)", ".0f"),
           ("step_call_ms_3", "step() (ms)", ".0f"),
           ("ddp_time_ratio", "torchft-allreduce's time / this", ".1f"),
           ("plain_time_ratio", f"this / {PLAIN}'s time", ".2f"),
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
    colors = dict(zip(VARIANTS, ("tab:orange", "tab:blue", "tab:green", "tab:red")))
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for r in rows:
        pts = [(t, s) for t, s, _, c in r["curve"] if c]
        label = r["variant"] + (f" ({NO_FAILURE})" if r.get("steps_lost") is None else "")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", ms=3,
                color=colors[r["variant"]], label=label if r["repeat"] == 0 else None)
    ax.set_xlabel("wall time (s) from replica 0's first step")
    ax.set_ylabel("committed steps")
    ax.set_title(f"{_rate(rate)}: replica {VICTIM} killed, restarted, healed")
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
    ap.add_argument("--no-failure", action="store_true",
                    help="the elastic variants kill no replica: their speed between failures, "
                    "step for step against dk-dlion-plain")
    ap.add_argument("--lion-lr", type=float, default=1e-4)
    ap.add_argument("--adamw-lr", type=float, default=1e-3)
    ap.add_argument("--collective-timeout", type=float, default=60.0)
    ap.add_argument("--join-timeout-ms", type=int, default=5000,
                    help="the Lighthouse's wait for a replica that heartbeats but has not asked "
                    "for the quorum yet (default 5000: on a loaded machine steps of the replicas "
                    "end seconds apart, and with 1000 the quorums split into pairs; keep it "
                    "above a heal plus a step: 60000, torchft's default, at 100 Mbit/s, where "
                    "the all-reduce's 201 MB heal takes 16 s)")
    ap.add_argument("--quorum-tick-ms", type=int, default=100,
                    help="how often the Lighthouse looks for a quorum while replicas are missing "
                    "from it (torchft's default 100)")
    ap.add_argument("--timeout", type=float, default=900.0,
                    help="the most one run may take, start to end (s)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--keep-runs", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--lighthouse", help=argparse.SUPPRESS)
    ap.add_argument("--replica", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--restart", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--plain-rank", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.lighthouse:
        _lighthouse(args.lighthouse)
        return 0
    if args.replica:
        _replica(args.replica[0], int(args.replica[1]), args.restart)
        return 0
    if args.plain_rank:
        _plain(args.plain_rank[0], int(args.plain_rank[1]))
        return 0
    if args.smoke:
        args.rates, args.repeats, args.dim, args.hidden = [0.0], 1, 64, 128
        args.steps, args.kill_at, args.restart_at, args.warmup = 12, 5, 6, 1
    if not 1 <= args.kill_at <= args.restart_at < args.steps:
        ap.error("need 1 <= --kill-at <= --restart-at < --steps")
    import network

    out = common.results_dir("elastic", args.out)
    args.keep_runs = out
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
                        failure = (NO_FAILURE if row["steps_lost"] is None else
                                   f"{row['ms_per_step_2'] or 0:.0f} ms (2), steps lost "
                                   f"{row['steps_lost']}, heal {row['heal_s'] or -1:.2f} s")
                        print(f"  {row['ms_per_step_3'] or 0:.0f} ms / step (3 replicas: "
                              f"quorum {row['quorum_ms_3'] or 0:.0f} ms, forward and backward "
                              f"{row['compute_ms_3'] or 0:.0f} ms, step() "
                              f"{row['step_call_ms_3'] or 0:.0f} ms), {failure}, "
                              f"load {row['load_end']}", flush=True)
            finally:
                if topo:
                    topo.close()
    meta["load_end"] = _load()
    table = summarize(rows)
    text = report(table)
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
