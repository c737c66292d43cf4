"""An emulated cluster on one Linux host: network namespaces, veth pairs, a bridge, tbf shaping.

One namespace per NODE; a node holds ``ranks_per_node`` (L) rank processes::

    netns <tag>-n0  (ranks 0..L-1,   lo + veth) --veth--+
    netns <tag>-n1  (ranks L..2L-1,  lo + veth) --veth--+-- bridge br0 in netns <tag>-hub
    ...                                                 |
    netns <tag>-n{N-1}  ----------------------------- --+

Node k has address ``<subnet>.<k+1>/24`` on its veth; nothing is routed anywhere else and the
root namespace is not touched (the bridge lives in a namespace of its own). Each node's link is
shaped in both directions: a ``tbf`` on the node-side veth (uplink) and one on the bridge-side
veth (downlink), i.e. a full-duplex NIC of the given rate per node into a non-blocking switch.
With ``delay_ms`` > 0, ``netem`` is tried first for a one-way delay (tbf as its child); kernels
without ``sch_netem`` fall back to tbf only and ``netem_error`` says why.

How the L ranks of a node talk to each other without crossing the shaped link: gloo's TCP
transport binds every rank to one address (``GLOO_SOCKET_IFNAME`` names the interface whose
address is used), publishes it through the rendezvous store, and its peers connect to that
address. All L ranks of a node get ``GLOO_SOCKET_IFNAME=<node's veth>``, so they bind the same
node address (different ports). A peer in another namespace reaches it over veth -> bridge ->
veth (shaped); a peer in the same namespace connects to an address that is local to its own
namespace, and the kernel delivers traffic to a local address through ``lo`` (the ``local``
routing table), never through the veth. So intra-node bytes stay on the namespace's loopback,
unshaped. ``verify_routing()`` checks this with the interfaces' byte counters
(``python bench/network.py --verify``).

Names are unique per topology (``<prefix><6 hex>``, checked against ``ip netns list``), as is
the /24 inside ``10.<A>.<B>``; every namespace created is deleted on ``close()`` (context manager
exit, exceptions, and ``install_signal_handlers()`` turns SIGTERM/SIGHUP into an exception so the
``with`` block unwinds). A leftover from ``kill -9`` goes with ``ip netns del NAME``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

SUBNET_FIRST = 10


class Skip(Exception):
    """The benchmark cannot run here (no privileges, no iproute2); not a failure."""


def ip(*args, check=True, timeout=30):
    """Run an iproute2 command; raise RuntimeError with its message when it fails."""
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): "
                           f"{(proc.stderr or proc.stdout).strip()}")
    return proc


def check_privileges(prefix: str = "dlbn") -> None:
    """Raise Skip with the reason when namespaces cannot be made here."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        raise Skip("iproute2 ('ip' and 'tc') is not installed")
    if os.geteuid() != 0:
        raise Skip("needs root to create network namespaces (ip netns add); run with sudo")
    probe = f"{prefix}{os.urandom(3).hex()}-probe"
    proc = ip("ip", "netns", "add", probe, check=False)
    if proc.returncode != 0:
        raise Skip(f"'ip netns add' failed: {(proc.stderr or proc.stdout).strip()}")
    ip("ip", "netns", "del", probe, check=False)


def _existing_netns() -> set[str]:
    out = ip("ip", "netns", "list", check=False).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _on_signal(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def install_signal_handlers() -> None:
    """SIGTERM / SIGHUP raise KeyboardInterrupt, so ``with Topology(...)`` blocks clean up."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)


class Topology:
    """``nodes`` namespaces of ``ranks_per_node`` ranks each on a bridge, links shaped to
    ``rate_mbit`` (None: unshaped). A context manager that always removes what it created."""

    def __init__(self, nodes: int, rate_mbit: float | None, delay_ms: float = 0.0,
                 ranks_per_node: int = 1, prefix: str = "dlbn"):
        if nodes < 1 or ranks_per_node < 1:
            raise ValueError(f"nodes and ranks_per_node must be >= 1, got {nodes}, "
                             f"{ranks_per_node}")
        if len(prefix) > 6 or not prefix.isalnum():
            raise ValueError(f"prefix must be 1-6 alphanumeric characters, got {prefix!r}")
        if nodes > 250:
            raise ValueError(f"at most 250 nodes on one /24, got {nodes}")
        self.nodes, self.ranks_per_node = nodes, ranks_per_node
        self.n = nodes * ranks_per_node
        self.rate_mbit, self.delay_ms = rate_mbit, delay_ms
        existing = _existing_netns()
        while True:  # other benchmarks may hold namespaces of the same prefix
            tag = os.urandom(3).hex()
            self.hub = f"{prefix}{tag}-hub"
            self.hosts = [f"{prefix}{tag}-n{k}" for k in range(nodes)]
            if not ({self.hub, *self.hosts} & existing):
                break
        self.tag = tag
        # interface names <= 15 characters; each lives in its own namespace, so only
        # uniqueness inside this topology matters
        self.host_if = [f"dv{tag}a{k}" for k in range(nodes)]
        self.hub_if = [f"dv{tag}b{k}" for k in range(nodes)]
        t = int(tag, 16)
        self.subnet = f"{SUBNET_FIRST}.{100 + (t >> 8) % 150}.{t % 250 + 1}"
        self.addrs = [f"{self.subnet}.{k + 1}" for k in range(nodes)]
        self.created: list[str] = []
        self.shaper = "tbf" if rate_mbit else "none"
        self.netem_error = None

    # --------------------------------------------------------------- rank placement

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def rank_netns(self, rank: int) -> str:
        return self.hosts[self.node_of(rank)]

    def rank_addr(self, rank: int) -> str:
        return self.addrs[self.node_of(rank)]

    def rank_env(self, rank: int) -> dict:
        """What a rank process needs: gloo's interface and torchrun's placement variables."""
        node = self.node_of(rank)
        return {
            "GLOO_SOCKET_IFNAME": self.host_if[node],
            "RANK": str(rank), "WORLD_SIZE": str(self.n),
            "LOCAL_RANK": str(rank % self.ranks_per_node),
            "LOCAL_WORLD_SIZE": str(self.ranks_per_node),
            "GROUP_RANK": str(node), "NODE_RANK": str(node),
            "MASTER_ADDR": self.addrs[0],
        }

    def exec_argv(self, rank: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.rank_netns(rank)] + list(argv)

    # --------------------------------------------------------------- build / tear down

    def __enter__(self):
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def _netns(self, name):
        ip("ip", "netns", "add", name)
        self.created.append(name)
        ip("ip", "-n", name, "link", "set", "lo", "up")

    def _build(self):
        self._netns(self.hub)
        ip("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        ip("ip", "-n", self.hub, "link", "set", "br0", "up")
        for k in range(self.nodes):
            ns, a, b = self.hosts[k], self.host_if[k], self.hub_if[k]
            self._netns(ns)
            # created directly inside the namespaces: nothing ever appears in the root netns
            ip("ip", "link", "add", a, "netns", ns, "type", "veth", "peer", "name", b,
               "netns", self.hub)
            ip("ip", "-n", ns, "addr", "add", f"{self.addrs[k]}/24", "dev", a)
            ip("ip", "-n", ns, "link", "set", a, "up")
            ip("ip", "-n", self.hub, "link", "set", b, "master", "br0")
            ip("ip", "-n", self.hub, "link", "set", b, "up")
            if self.rate_mbit:
                self._shape(ns, a, uplink=True)
                self._shape(self.hub, b, uplink=False)

    def _tbf(self, ns, dev, parent):
        rate_bytes = self.rate_mbit * 1e6 / 8
        burst = max(int(rate_bytes / 1000), 64 * 1024)  # 1 ms of traffic, >= one GSO packet
        ip("tc", "-n", ns, "qdisc", "add", "dev", dev, *parent, "tbf",
           "rate", f"{self.rate_mbit:g}mbit", "burst", str(burst), "latency", "50ms")

    def _shape(self, ns, dev, uplink: bool):
        if uplink and self.delay_ms > 0 and self.netem_error is None:
            proc = ip("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:",
                      "netem", "delay", f"{self.delay_ms:g}ms", check=False)
            if proc.returncode == 0:
                self._tbf(ns, dev, ("parent", "1:1", "handle", "10:"))
                self.shaper = "netem+tbf"
                return
            self.netem_error = (proc.stderr or proc.stdout).strip()
            ip("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
        self._tbf(ns, dev, ("root",))

    def close(self):
        for name in reversed(self.created):
            ip("ip", "netns", "del", name, check=False)
        self.created.clear()

    # --------------------------------------------------------------- counters

    def counters(self, node: int) -> dict:
        """Byte counters of node's veth and loopback: {"veth_tx", "veth_rx", "lo_tx", ...}."""
        out = {}
        for key, dev in (("veth", self.host_if[node]), ("lo", "lo")):
            stats = json.loads(ip("ip", "-n", self.hosts[node], "-s", "-j", "link", "show",
                                  "dev", dev).stdout)[0]["stats64"]
            out[f"{key}_tx"], out[f"{key}_rx"] = stats["tx"]["bytes"], stats["rx"]["bytes"]
        return out

    # --------------------------------------------------------------- processes

    def launch(self, argv_of_rank, env: dict, log_dir: str, timeout: float,
               label: str = "") -> None:
        """Start one process per rank in its node's namespace (``argv_of_rank(rank)``, env plus
        ``rank_env(rank)``), wait for all; on failure or timeout kill the rest and raise
        RuntimeError with the end of every rank's log."""
        procs, logs = [], []
        try:
            for r in range(self.n):
                log = open(os.path.join(log_dir, f"log{label}-r{r}.txt"), "w")
                logs.append(log)
                procs.append(subprocess.Popen(self.exec_argv(r, argv_of_rank(r)),
                                              env=dict(env, **self.rank_env(r)),
                                              stdout=log, stderr=subprocess.STDOUT))
            end = time.time() + timeout
            failed = []
            pending = list(enumerate(procs))
            while pending and not failed:  # poll all: the first rank to fail ends the wait
                time.sleep(0.2)
                for r, p in list(pending):
                    if p.poll() is not None:
                        pending.remove((r, p))
                        if p.returncode != 0:
                            failed.append(f"rank {r}: exit code {p.returncode}")
                if pending and time.time() > end:
                    failed.append(f"timed out after {timeout:.0f} s (ranks "
                                  f"{[r for r, _ in pending]} still running)")
            if failed:
                tails = []
                for log in logs:
                    log.flush()
                    with open(log.name) as f:
                        tails.append(f"--- {os.path.basename(log.name)}\n" + f.read()[-3000:])
                raise RuntimeError(f"{label or 'run'} failed: " + "; ".join(failed) + "\n"
                                   + "\n".join(tails))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for log in logs:
                log.close()


# ----------------------------------------------------------------------------- verification


def _verify_worker(cfg_path: str) -> None:
    """One rank of verify_routing: an all_reduce inside its node, then one across nodes."""
    import datetime

    import torch
    import torch.distributed as dist

    with open(cfg_path) as f:
        cfg = json.load(f)
    rank, n, L = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), cfg["L"]
    dist.init_process_group("gloo", init_method=f"tcp://{cfg['master']}:{cfg['port']}",
                            rank=rank, world_size=n, timeout=datetime.timedelta(seconds=60))
    intra = [dist.new_group(list(range(s, s + L))) for s in range(0, n, L)][rank // L]
    inter = [dist.new_group(list(range(j, n, L))) for j in range(L)][rank % L]
    x = torch.ones(cfg["numel"])
    for phase, group in (("intra", intra), ("inter", inter)):
        dist.barrier()
        with open(cfg["sync"] + f".{phase}.{rank}", "w"):
            pass  # the driver reads counters between phases
        while not os.path.exists(cfg["sync"] + f".{phase}.go"):
            time.sleep(0.05)
        dist.all_reduce(x, group=group)
        dist.barrier()
    with open(cfg["sync"] + f".done.{rank}", "w"):
        pass
    while not os.path.exists(cfg["sync"] + ".done.go"):
        time.sleep(0.05)
    dist.destroy_process_group()


def verify_routing(nodes: int = 2, ranks_per_node: int = 2, numel: int = 4 << 20,
                   rate_mbit: float = 10000.0) -> dict:
    """Run an all_reduce of ``numel`` fp32 inside each node, then one across nodes (one group
    per local rank), and read every node's veth / lo byte counters around each phase. Returns
    the counter deltas per phase and node, and ``ok``: the intra-node phase moved less than 1%
    of its payload over the veths while lo carried it, and the inter-node phase crossed them."""
    payload = numel * 4
    with Topology(nodes, rate_mbit, ranks_per_node=ranks_per_node, prefix="dlvr") as topo, \
            tempfile.TemporaryDirectory(prefix="dlion-verify-") as tmp:
        cfg = {"L": ranks_per_node, "numel": numel, "master": topo.addrs[0],
               "port": 20000 + int.from_bytes(os.urandom(2), "little") % 30000,
               "sync": os.path.join(tmp, "sync")}
        cfg_path = os.path.join(tmp, "cfg.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        import threading

        err = []
        env = dict(os.environ, OMP_NUM_THREADS="1")
        th = threading.Thread(target=lambda: _guard(err, topo.launch, lambda r: [
            sys.executable, os.path.abspath(__file__), "--verify-worker", cfg_path], env, tmp,
            120.0, "-verify"))
        th.start()
        result, before = {}, None
        try:
            for phase in ("intra", "inter", "done"):
                while not all(os.path.exists(cfg["sync"] + f".{phase}.{r}")
                              for r in range(topo.n)):
                    if err or not th.is_alive():
                        raise RuntimeError(f"verify workers failed: {err}")
                    time.sleep(0.05)
                now = [topo.counters(k) for k in range(nodes)]
                if phase != "intra":
                    prev_phase = "intra" if phase == "inter" else "inter"
                    result[prev_phase] = [{k: now[i][k] - before[i][k] for k in now[i]}
                                          for i in range(nodes)]
                before = now
                open(cfg["sync"] + f".{phase}.go", "w").close()
        finally:
            th.join()
        if err:
            raise RuntimeError(f"verify workers failed: {err[0]}")
    intra_veth = max(d["veth_tx"] for d in result["intra"])
    intra_lo = min(d["lo_tx"] for d in result["intra"])
    inter_veth = min(d["veth_tx"] for d in result["inter"])
    result.update(nodes=nodes, ranks_per_node=ranks_per_node, payload_bytes=payload,
                  ok=bool(intra_veth < 0.01 * payload and intra_lo > payload
                          and inter_veth > payload // 2))
    return result


def _guard(err, fn, *args):
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - handed to the driver thread
        err.append(str(e))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Emulated-cluster helpers; --verify checks that "
                                 "intra-node gloo traffic stays on loopback.")
    ap.add_argument("--verify", action="store_true")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--verify-worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.verify_worker:
        _verify_worker(args.verify_worker)
        return 0
    if not args.verify:
        ap.print_help()
        return 0
    try:
        check_privileges()
    except Skip as e:
        print(f"network --verify skipped: {e}")
        return 0
    install_signal_handlers()
    res = verify_routing(args.nodes, args.ranks_per_node)
    print(json.dumps(res, indent=1))
    print("intra-node traffic on loopback, inter-node on the shaped veth: "
          + ("OK" if res["ok"] else "FAILED"))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
