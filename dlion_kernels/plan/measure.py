"""``--measure``: calibrate the runtime model on the running process group (torchrun).

In a few seconds, on the group that ``torchrun`` started (gloo for CPU, NCCL for CUDA):

1. Nodes: ranks are grouped by hostname (``LOCAL_WORLD_SIZE`` must agree, or pass
   ``ranks_per_node`` for emulated nodes that share a hostname, e.g. network namespaces).
2. Point to point, per link class: a ping-pong between rank 0 and a rank of its node (intra) and
   one of another node (inter), with a 4-byte and a large message: latency = half the small
   round trip; bandwidth = large bytes / (half the large round trip - latency). A class that does
   not exist here (one node) takes the other class's figures.
3. Collectives on the whole group at 3 sizes: all_reduce, all_to_all_single,
   all_gather_into_tensor, reduce_scatter_tensor. For each kind, the two scales of
   ``Calibration`` are fitted by least squares (>= 0) so that ``lat_scale * latency terms +
   bw_scale * bandwidth terms`` of the model matches the slowest rank's median time.
4. Compute: ``step_fn()`` (your forward + backward, split 1:2 into fwd and bwd) timed on every
   rank; or, by default, a dense MLP of ~1M parameters, forward and backward timed separately and
   scaled linearly to ``params``. The spread over ranks and repetitions gives ``jitter_ms``
   (normal, sigma). The optimizer: one ``fused_dlion_step`` on a one-rank group, per element,
   scaled to ``params``.

Returns, on rank 0, the inputs of ``predict`` (``ranks``, ``ranks_per_node``, ``inter_gbps``,
``intra_gbps``, ``latency_us``, ``intra_latency_us``, ``fwd_ms``, ``bwd_ms``, ``opt_ms``,
``jitter_ms``, ``jitter_dist``, ``algorithm``, ``calibration``); None on the other ranks.
"""

from __future__ import annotations

import os
import socket
import statistics
import time

import torch
import torch.distributed as dist

from ..exchange.collectives import gather_into_tensor, reduce_scatter_into_tensor
from . import model

SIZES = (64_000, 512_000, 2_000_000)  # bytes per rank of the calibration collectives
P2P_BYTES = 4_000_000


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, reps, device, group=None) -> float:
    """Median over reps of the slowest rank's time of fn(), ms (one warm-up call)."""
    fn()
    times = []
    for _ in range(reps):
        dist.barrier(group=group)
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.median())


def layout(ranks_per_node):
    """(n, L) of the default group: its size and ranks per node, from hostnames (and
    LOCAL_WORLD_SIZE), or L as given. Collective when ``ranks_per_node`` is None."""
    n, rank = dist.get_world_size(), dist.get_rank()
    if ranks_per_node is not None:
        L = int(ranks_per_node)
    else:
        names = [None] * n
        dist.all_gather_object(names, socket.gethostname())
        counts = {h: names.count(h) for h in names}
        L = counts[names[rank]]
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if len(set(counts.values())) != 1:
            raise ValueError(f"ranks per host differ ({counts}); pass --ranks-per-node")
        if local is not None and int(local) != L and len(counts) == 1:
            L = int(local)  # several emulated nodes on one host: trust torchrun's layout
    if L < 1 or n % L:
        raise ValueError(f"world size {n} is not a multiple of ranks per node {L}")
    return n, L


def _ping_pong(peer, nbytes, reps, device) -> float:
    """Half the median round trip between rank 0 and ``peer``, ms (others only wait)."""
    rank = dist.get_rank()
    buf = torch.zeros(max(1, nbytes // 4), dtype=torch.int32, device=device)
    times = []
    for i in range(reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        elif rank == peer:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        _sync(device)
        if i:  # the first round trip sets up the connection
            times.append((time.perf_counter() - t0) * 1e3 / 2)
    t = torch.tensor([statistics.median(times) if rank == 0 else 0.0], dtype=torch.float64)
    dist.broadcast(t, 0)
    return float(t[0])


def _link(peer, reps, device):
    lat_ms = _ping_pong(peer, 4, reps, device)
    big_ms = _ping_pong(peer, P2P_BYTES, reps, device)
    seconds = max(big_ms - lat_ms, 1e-6) / 1e3
    return lat_ms * 1e3, P2P_BYTES * 8 / seconds / 1e9  # latency us, Gbit/s


def _fit(xs, ys) -> tuple[float, float]:
    """Least squares of y = a x0 + b x1 with a, b >= 0 (two unknowns, closed form)."""
    s00 = sum(x[0] * x[0] for x in xs)
    s11 = sum(x[1] * x[1] for x in xs)
    s01 = sum(x[0] * x[1] for x in xs)
    t0 = sum(x[0] * y for x, y in zip(xs, ys))
    t1 = sum(x[1] * y for x, y in zip(xs, ys))
    det = s00 * s11 - s01 * s01
    if det > 1e-30:
        a, b = (t0 * s11 - t1 * s01) / det, (t1 * s00 - t0 * s01) / det
        if a >= 0 and b >= 0:
            return a, b
    # One scale at its bound 0: refit the other alone, keep the better of the two.
    cands = [(t0 / s00 if s00 else 0.0, 0.0), (0.0, t1 / s11 if s11 else 0.0)]

    def err(ab):
        return sum((ab[0] * x[0] + ab[1] * x[1] - y) ** 2 for x, y in zip(xs, ys))
    return min(((max(a, 0.0), max(b, 0.0)) for a, b in cands), key=err)


def _collectives(cl, n, L, reps, device):
    """Fit (lat_scale, bw_scale) per collective kind on the whole group."""
    g = model.Group(n, n // L, L)
    gather = gather_into_tensor()
    scatter = reduce_scatter_into_tensor()
    lat_only = model.Calibration({k: 1.0 for k in model.COLLECTIVES},
                                 {k: 0.0 for k in model.COLLECTIVES})
    bw_only = model.Calibration({k: 0.0 for k in model.COLLECTIVES},
                                {k: 1.0 for k in model.COLLECTIVES})
    lat_cl = model.Cluster(n, L, cl.intra, cl.inter, cl.algorithm, lat_only)
    bw_cl = model.Cluster(n, L, cl.intra, cl.inter, cl.algorithm, bw_only)
    fitted_lat, fitted_bw = {}, {}
    for kind in model.COLLECTIVES:
        xs, ys = [], []
        for size in SIZES:
            words = max(n, size // 4 // n * n)
            nbytes = words * 4
            x = torch.ones(words, dtype=torch.float32, device=device)
            out = torch.empty_like(x)
            shard = torch.ones(words // n, dtype=torch.float32, device=device)
            if kind == "all_reduce":
                fn, cost, arg = (lambda x=x: dist.all_reduce(x)), model.all_reduce, nbytes
            elif kind == "all_to_all":
                fn, cost, arg = ((lambda o=out, x=x: dist.all_to_all_single(o, x)),
                                 model.all_to_all, nbytes / n)
            elif kind == "all_gather":
                fn, cost, arg = ((lambda o=out, s=shard: gather(o, s)), model.all_gather,
                                 nbytes / n)
            else:
                fn, cost, arg = ((lambda s=shard, x=x: scatter(s, x)),
                                 model.reduce_scatter, nbytes)
            try:
                ms = _timed(fn, reps, device)
            except (RuntimeError, NotImplementedError):  # e.g. reduce_scatter on old gloo
                break
            xs.append((cost(lat_cl, g, arg).ms, cost(bw_cl, g, arg).ms))
            ys.append(ms)
        if len(ys) >= 2:
            fitted_lat[kind], fitted_bw[kind] = _fit(xs, ys)
    return model.Calibration(fitted_lat, fitted_bw)


def _default_compute(params, reps, device):
    """fwd, bwd ms of a dense MLP (~1M parameters, batch 64), scaled linearly to params."""
    torch.manual_seed(0)
    width, depth, batch = 512, 4, 64
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    net = torch.nn.Sequential(*layers).to(device)
    count = sum(p.numel() for p in net.parameters())
    x = torch.randn(batch, width, device=device)
    fwd, bwd = [], []
    for i in range(reps + 1):
        _sync(device)
        t0 = time.perf_counter()
        loss = net(x).square().mean()
        _sync(device)
        t1 = time.perf_counter()
        loss.backward()
        _sync(device)
        t2 = time.perf_counter()
        if i:
            fwd.append((t1 - t0) * 1e3)
            bwd.append((t2 - t1) * 1e3)
    scale = params / count
    return [f * scale for f in fwd], [b * scale for b in bwd]


def _optimizer_ms(params, reps, device, solo) -> float:
    from ..exchange.step import fused_dlion_step  # the library's own step, one-rank group

    numel = 1_000_000
    p = torch.randn(numel, device=device)
    g = torch.randn(numel, device=device)
    m = torch.zeros(numel, device=device)
    times = []
    for i in range(reps + 1):
        _sync(device)
        t0 = time.perf_counter()
        fused_dlion_step([p], [g], [m], lr=1e-4, group=solo)
        _sync(device)
        if i:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times) * params / numel


def measure(params, *, step_fn=None, ranks_per_node=None, reps=3, device=None):
    """Calibrate on the default process group (see the module docstring). Every rank must call
    it; rank 0 gets the inputs of ``predict`` (a dict), the others None."""
    params = model.parse_size(params, "params")
    started = time.perf_counter()
    if not (dist.is_available() and dist.is_initialized()):
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend)
        else:
            raise ValueError("--measure needs a process group: run it under torchrun, e.g. "
                             "torchrun --nproc-per-node 4 -m dlion_kernels.plan --measure "
                             "--params 124M")
    backend = str(dist.get_backend()).lower()
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend \
            else torch.device("cpu")
    n, L = layout(ranks_per_node)
    rank = dist.get_rank()
    if n < 2:
        raise ValueError("--measure needs at least 2 ranks to time the links")

    intra = _link(1, reps, device) if L > 1 else None
    inter = _link(L, reps, device) if n > L else None
    intra = intra or inter
    inter = inter or intra
    algorithm = "auto" if "nccl" in backend else "ring"
    cl = model.Cluster(n, L, model.Link(*intra), model.Link(*inter), algorithm)
    calibration = _collectives(cl, n, L, reps, device)

    if step_fn is not None:
        totals = []
        step_fn()  # warm-up
        for _ in range(reps):
            _sync(device)
            t0 = time.perf_counter()
            step_fn()
            _sync(device)
            totals.append((time.perf_counter() - t0) * 1e3)
        fwd = [t / 3 for t in totals]
        bwd = [t * 2 / 3 for t in totals]
    else:
        fwd, bwd = _default_compute(params, reps, device)
    solos = [dist.new_group([r]) for r in range(n)]  # every rank creates every group
    opt_ms = _optimizer_ms(params, reps, device, solos[rank])

    samples = torch.tensor([f + b for f, b in zip(fwd, bwd)], dtype=torch.float64)
    everyone = [torch.zeros_like(samples) for _ in range(n)]
    dist.all_gather(everyone, samples)
    allsamples = torch.cat(everyone)
    mine = torch.tensor([statistics.median(fwd), statistics.median(bwd), opt_ms],
                        dtype=torch.float64)
    dist.all_reduce(mine)  # means over ranks
    mine /= n
    if rank != 0:
        return None
    return {
        "ranks": n,
        "ranks_per_node": L,
        "inter_gbps": inter[1],
        "intra_gbps": intra[1],
        "latency_us": inter[0],
        "intra_latency_us": intra[0],
        "fwd_ms": float(mine[0]),
        "bwd_ms": float(mine[1]),
        "opt_ms": float(mine[2]),
        "jitter_ms": float(allsamples.std()) if allsamples.numel() > 1 else 0.0,
        "jitter_dist": "normal",
        "algorithm": algorithm,
        "calibration": calibration,
        "seconds": time.perf_counter() - started,  # what calibrating took, on rank 0
    }
