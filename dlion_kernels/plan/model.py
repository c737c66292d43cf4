"""The runtime model: predicted time of one training step for every strategy the library runs.

Pure Python (no torch): it needs numbers, not tensors. Units: times in ms, link speeds in
Gbit/s (10^9 bit/s), sizes and bytes in powers of ten (``124M`` = 124 * 10^6; ``7B`` = ``7G`` =
7 * 10^9, as model sizes are written).

Cluster. n ranks in nodes of L consecutive ranks (N = n / L nodes). Two link classes, each an
alpha-beta link (``t = alpha + bytes / beta``):

- intra-node: every rank has ``intra_gbps`` into the node's fabric (NVLink, PCIe, loopback);
  ``DEFAULT_INTRA_GBPS`` (NVLink-class) when a node holds several ranks and none is given;
- inter-node: every node has ``inter_gbps`` to the switch (full duplex), SHARED by the streams
  of its L ranks that leave the node at the same time (8 NICs of 400 Gbit/s: 3200).

Collectives (the algorithms gloo and NCCL run; p ranks, S bytes, chunk c per step):

- ring all-reduce: 2 (p-1) steps of c = S/p; reduce-scatter and all-gather: p-1 steps each.
  A step takes alpha + c / beta of its slowest hop. A ring laid over consecutive ranks crosses
  each node boundary once, so a node's NIC carries one chunk per step per ring that crosses it.
- tree all-reduce (NCCL's double binary tree, pipelined): 2 ceil(log2 p) alpha + 2 S / beta.
  ``algorithm="auto"`` takes the faster of ring and tree for every all-reduce, as NCCL does.
- all_to_all_single (pairwise, all sends posted at once): one alpha, then the larger of the
  intra bytes over the rank's intra link and the node's inter bytes over its NIC.

A collective's time is ``lat_scale * latency terms + bw_scale * bandwidth terms`` (both scales 1
unless ``--measure`` fitted them on a real group: ``calibration``) ; the host's work on the bytes
the rank sends or sums at ``cpu_gbs`` GB/s (none by default; it matters for gloo on CPU cores)
overlaps the transfer (the bandwidth term is the larger of the two) but not the compute: it needs
the same cores, so it adds to the step even when the transfer hides behind backward.

Compute. fwd, bwd and optimizer (``opt_ms``: one pass of the optimizer over all parameters) per
rank, plus a random extra delay per rank and step (``jitter_ms``: uniform on [0, jitter] or
normal with sigma = jitter). A global collective waits for the slowest of n ranks, so its step
pays E[max of n delays]; a gossip group pays E[max of its g members] (the third factor of
Wang et al.'s decentralized-training paper).

Strategies and their overlap (B buckets of ``bucket_mb`` MiB of fp32 gradients, as DDP and the
bucket engine count them, ready at even
intervals during backward; one communication channel, buckets exchanged in order):

- ``lion-allreduce`` / ``lion-allreduce-bf16``: DDP, one all-reduce per bucket started when the
  bucket is ready; the optimizer runs after the last one. Exposed = comm end - backward end.
- ``dlion-<mode>``: local step, all_to_all_single of the packed votes, all_gather of the packed
  aggregate, apply; nothing overlapped (the wire format's bytes, plus the HEADER_WORDS int32
  words of the non-finite flag and step counter that ride in every all_to_all chunk).
- ``dlion-<mode>-overlap``: the same per bucket during backward (the local step of a bucket joins
  the backward stream); apply after the last bucket.
- ``dlion-<mode>-hier[-overlap]`` (hierarchy=L, L > 1): intra-node reduce-scatter of the fp32
  gradients, the vote exchange among the N node voters on 1/L of the elements (the node's L
  inter groups share its NIC), intra-node all-gather of the packed aggregate (as the library
  does; ``hier_gather="params"``: of the parameter shards); the local step on 1/L, the apply
  on all elements, x only, and the momentum update on 1/L (the whole apply on 1/L with gathered
  parameters).
- ``fsdp-allreduce[-bf16]`` and ``fsdp-dlion[-overlap]`` (FSDP2, L > 1):
  FSDP2 in nodes of L, each bucket one FSDP unit. Forward: each unit's parameter shards are
  all-gathered in the node (prefetched one unit ahead on the one channel) before its compute;
  backward: gathered again, then the unit's gradients reduce-scattered in the node (fp32; bf16
  for HSDP's ``-bf16``), and then HSDP all-reduces the shard among the N replicas (the L
  replicate groups share the node's NIC) while D-Lion votes on it (``-overlap``: per unit
  during backward; else once after backward, on all d / L local elements), with the header
  gather inside the node (8 N bytes from each of the L - 1 peers). Optimizer on d / L.
- ``decentralized-<topology>-accum-adamw``: per bucket, a gossip all-reduce in the step's
  groups, overlapping a whole iteration of compute: step = max(compute + wait of the group,
  gossip time). Each topology's schedule is averaged over its period.

- ``diloco-dlion`` / ``diloco-nesterov`` (local steps): every inner step is compute
  alone; every H / P inner steps one fragment of d / P elements syncs (H = ``sync_every``, P =
  ``fragments``): D-Lion's exchange of it among all n ranks, or an fp32 all-reduce, plus one
  optimizer-like pass over it (the outer step). Per inner step: compute + the sync's exposed
  time and outer pass divided by H / P. With ``overlap_steps`` tau > 0 the exchange runs during
  the next tau inner steps: exposed = max(0, comm - tau x compute) plus the host's work (it needs
  the cores), and for D-Lion its all_gather in full (issued at the apply step). The ranks wait at
  a sync for the slowest one's H / P steps of jitter: uniform on [0, J] per step gives J / 2 +
  J / sqrt(12) e_n / sqrt(H / P) per inner step, normal (mean 0, sigma J) J e_n / sqrt(H / P),
  e_n the expected maximum of n standard normals (the sums' normal approximation). Times, bytes
  and ``comm_ms`` are per inner step (a sync's divided by H / P); ``options`` gives one sync's
  (``sync_ms``, ``sync_bytes``). ``diloco-dlion-ef`` and ``diloco-dlion-ef-decay`` (the
  residual decayed at every sync) send what ``diloco-dlion`` sends, and
  ``diloco-dlion-ef-scale`` adds an all_gather of one fp32 per tensor; their outer pass counts
  1.5 passes (the residual read and written) and their state the fp32 residual.
  ``diloco-sparseloco``: an all_gather of every rank's list, the 8-byte header, 8 bytes per
  tensor and, per kept element (1/64 of them), a 16-bit offset and a 2-bit value; 2 passes
  (accumulate and top-k, decode).

Every row but the decentralized ones also gives the memory a rank holds for parameters,
gradients and optimizer state (fp32 momentum, Lion's or D-Lion's; a DDP row's optimizer is
Lion): d of each (momentum d / L under ``hierarchy``), 1/L of each under FSDP2; DiLoCo's
state is the inner AdamW's two moments, theta_bar and the outer momentum. The
decentralized rows leave it None (it depends on the optimizer run in each bucket).

Every row is named by the slug of the strategy it predicts (``dlion_kernels/strategies.py``,
whose ``Strategy.row`` says which row predicts each strategy: ``adamw-allreduce`` shares
``lion-allreduce``'s exchange, and a topology's ``accum-lion`` and ``adamw`` strategies its
``accum-adamw`` row); ``rank_strategies`` predicts named strategies. The ``diloco-*`` rows are
per inner step of a different training (fewer syncs, another loss per step): ``best`` ranks them
only among themselves.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import asdict, dataclass, field

from ..accounting import (
    BUCKET_MB,
    LOCAL_STEP_BYTES,
    STEP_BYTES,
    X_ONLY_APPLY_BYTES,
    fsdp_unit_bytes,
)
from ..kernels.layout import (
    BLOCK,
    HEADER_WORDS,
    WORD_BYTES,
    aggregate_planes,
    shard_blocks,
    vote_planes,
)
from ..strategies import STRATEGIES
from ..strategies import get as get_strategy
from ..topologies import TOPOLOGIES, period, problem, schedule

MODES = ("vote", "average")
JITTER_DISTS = ("uniform", "normal")
ALGORITHMS = ("auto", "ring", "tree")
COLLECTIVES = ("all_reduce", "all_to_all", "all_gather", "reduce_scatter")

# Bytes per fp32 element of D-Lion's fused stages (accounting.py: local step 8.125, tally 0.25,
# apply 20.125, a whole step 28.5) split opt_ms between before the exchange (the local step)
# and after it (tally and apply).
LOCAL_FRACTION = LOCAL_STEP_BYTES / STEP_BYTES
APPLY_FRACTION = 1.0 - LOCAL_FRACTION
# Hierarchical D-Lion applies to every element x only (x read and written, the aggregate: 8.125)
# and updates the momentum of its shard alone (the rest of an apply: g read, m read and written).
X_ONLY_FRACTION = X_ONLY_APPLY_BYTES / STEP_BYTES
OPT_BYTES_PER_PARAM = STEP_BYTES  # default opt_ms: one fused D-Lion step (28.5) at mem_gbs

_SUFFIXES = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "B": 1e9, "T": 1e12}  # B: billions
# A rank's link inside a multi-GPU node when none is given: NVLink-class, 300 GB/s per direction
# (A100's NVLink; H100's is 450 GB/s = 3600 Gbit/s, PCIe 4.0 x16 about 200 Gbit/s). Defaulting to
# the inter-node rate instead would rank FSDP2 and hierarchy behind an fp32 all-reduce on any
# node of 8 GPUs whose user left the option out.
DEFAULT_INTRA_GBPS = 2400.0
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]?)\s*$")


# ----------------------------------------------------------------------------- inputs


def parse_size(value, name: str = "size") -> int:
    """``124M`` -> 124_000_000, ``1.3G`` and ``1.3B`` -> 1_300_000_000, ``4096`` -> 4096 (powers
    of ten)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number or a string like '124M', got {value!r}")
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        if not m:
            raise ValueError(f"{name}: cannot read {value!r}; use a number with an optional "
                             f"suffix K, M, G (or B), T (powers of ten), e.g. '124M', '7B'")
        unit = m.group(2).upper()
        if unit not in _SUFFIXES:
            raise ValueError(f"{name}: unknown unit {m.group(2)!r} in {value!r}; allowed "
                             f"suffixes are K, M, G (or B: billions), T (powers of ten)")
        number = float(m.group(1)) * _SUFFIXES[unit]
    else:
        raise TypeError(f"{name} must be a number or a string like '124M', got "
                        f"{type(value).__name__}")
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return round(number)


def _number(value, name: str, *, positive: bool = False, integer: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if integer and int(value) != value:
        raise ValueError(f"{name} must be a whole number, got {value}")
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value}")
    return int(value) if integer else float(value)


@dataclass(frozen=True)
class Link:
    """An alpha-beta link: ``latency_us`` per message, ``gbps`` Gbit/s."""

    latency_us: float
    gbps: float

    @property
    def alpha_ms(self) -> float:
        return self.latency_us / 1e3

    def bytes_ms(self, nbytes: float) -> float:
        return nbytes * 8.0 / (self.gbps * 1e9) * 1e3


@dataclass(frozen=True)
class Calibration:
    """Multipliers per collective kind, fitted by ``--measure``: time = lat_scale * latency
    terms + bw_scale * bandwidth terms (gloo's reductions on a CPU, protocol overheads)."""

    lat_scale: dict = field(default_factory=dict)
    bw_scale: dict = field(default_factory=dict)

    def scale(self, kind: str, lat: float, bw: float) -> float:
        return self.lat_scale.get(kind, 1.0) * lat + self.bw_scale.get(kind, 1.0) * bw


@dataclass(frozen=True)
class Cluster:
    n: int
    L: int
    intra: Link
    inter: Link
    algorithm: str = "auto"
    calibration: Calibration = Calibration()
    cpu_gbs: float | None = None  # host work per byte a rank sends or reduces (gloo on CPUs)

    def host_ms(self, nbytes: float) -> float:
        return 0.0 if self.cpu_gbs is None else nbytes / (self.cpu_gbs * 1e9) * 1e3

    @property
    def nodes(self) -> int:
        return self.n // self.L

    def node(self, rank: int) -> int:
        return rank // self.L


@dataclass
class Cost:
    """One collective (or a sum of them): time and bytes this rank sends, by link class."""

    ms: float = 0.0
    intra_bytes: float = 0.0
    inter_bytes: float = 0.0
    algorithm: str = ""
    host_ms: float = 0.0  # of ms, the host's own work (cpu_gbs): it needs the cores

    def __add__(self, other: Cost) -> Cost:
        parts = [a for a in (self.algorithm + "+" + other.algorithm).split("+") if a]
        algo = "+".join(dict.fromkeys(parts))  # each algorithm once, in order
        return Cost(self.ms + other.ms, self.intra_bytes + other.intra_bytes,
                    self.inter_bytes + other.inter_bytes, algo, self.host_ms + other.host_ms)

    def times(self, k: float) -> Cost:
        return Cost(self.ms * k, self.intra_bytes * k, self.inter_bytes * k, self.algorithm,
                    self.host_ms * k)

    @property
    def bytes(self) -> float:
        return self.intra_bytes + self.inter_bytes


# ----------------------------------------------------------------------------- collectives


@dataclass(frozen=True)
class Group:
    """Where a group's p ranks sit: ``nodes`` nodes with ``per_node`` members each, and
    ``streams`` concurrent rings crossing each of those nodes' NICs (groups that run at once)."""

    p: int
    nodes: int
    per_node: int
    streams: int = 1


def _step(cl: Cluster, g: Group, chunk: float) -> tuple[float, float]:
    """(latency, bandwidth) ms of one ring step moving ``chunk`` bytes along every hop."""
    lat, bw = 0.0, 0.0
    if g.per_node > 1:
        lat, bw = cl.intra.alpha_ms, cl.intra.bytes_ms(chunk)
    if g.nodes > 1:
        lat = max(lat, cl.inter.alpha_ms)
        bw = max(bw, cl.inter.bytes_ms(chunk * g.streams))
    return lat, bw


def _ring_bytes(g: Group, total: float) -> tuple[float, float]:
    """Split what each rank of a ring sends (``total``) into intra and inter bytes: of the
    per_node ranks of a node, one sends across the node boundary (averaged over the node)."""
    if g.nodes <= 1:
        return total, 0.0
    inter = total / g.per_node
    return total - inter, inter


def ring_steps(cl: Cluster, g: Group, steps: int, chunk: float, kind: str,
               reduced: float = 0.0) -> Cost:
    """``steps`` ring steps of ``chunk`` bytes; ``reduced``: bytes this rank also sums."""
    if g.p <= 1 or steps == 0:
        return Cost(algorithm="none")
    lat, bw = _step(cl, g, chunk)
    # The host's work on one chunk overlaps the transfer of the next (pipelined ring).
    host = cl.host_ms(steps * chunk + reduced)
    bw = max(cl.calibration.scale(kind, 0.0, steps * bw), host)
    ms = cl.calibration.scale(kind, steps * lat, 0.0) + bw
    intra, inter = _ring_bytes(g, steps * chunk)
    return Cost(ms, intra, inter, "ring", host)


def all_reduce(cl: Cluster, g: Group, nbytes: float) -> Cost:
    """All-reduce of ``nbytes`` per rank: ring, tree, or the faster (``auto``)."""
    if g.p <= 1:
        return Cost(algorithm="none")
    ring = ring_steps(cl, g, 2 * (g.p - 1), nbytes / g.p, "all_reduce",
                      reduced=(g.p - 1) / g.p * nbytes)
    if cl.algorithm == "ring":
        return ring
    lat, bw = _step(cl, g, nbytes)
    depth = math.ceil(math.log2(g.p))
    host = cl.host_ms(3 * nbytes)
    ms = cl.calibration.scale("all_reduce", 2 * depth * lat, 0.0) + max(
        cl.calibration.scale("all_reduce", 0.0, 2 * bw), host)
    intra, inter = _ring_bytes(g, 2.0 * nbytes)
    tree = Cost(ms, intra, inter, "tree", host)
    if cl.algorithm == "tree" or tree.ms < ring.ms:
        return tree
    return ring


def all_gather(cl: Cluster, g: Group, shard_bytes: float) -> Cost:
    """Ring all-gather; every rank contributes ``shard_bytes``."""
    return ring_steps(cl, g, g.p - 1, shard_bytes, "all_gather")


def reduce_scatter(cl: Cluster, g: Group, nbytes: float) -> Cost:
    """Ring reduce-scatter of ``nbytes`` per rank into p shards."""
    return ring_steps(cl, g, g.p - 1, nbytes / g.p, "reduce_scatter",
                      reduced=(g.p - 1) / g.p * nbytes)


def all_to_all(cl: Cluster, g: Group, shard_bytes: float) -> Cost:
    """all_to_all_single: every rank sends ``shard_bytes`` to each of the p - 1 others."""
    if g.p <= 1:
        return Cost(algorithm="none")
    intra = (g.per_node - 1) * shard_bytes
    inter = (g.p - g.per_node) * shard_bytes
    lat, bw = 0.0, 0.0
    if intra:
        lat, bw = cl.intra.alpha_ms, cl.intra.bytes_ms(intra)
    if inter:  # the node's NIC carries the inter bytes of its per_node ranks, of every stream
        lat = max(lat, cl.inter.alpha_ms)
        bw = max(bw, cl.inter.bytes_ms(inter * g.per_node * g.streams))
    host = cl.host_ms(intra + inter)
    ms = cl.calibration.scale("all_to_all", lat, 0.0) + max(
        cl.calibration.scale("all_to_all", 0.0, bw), host)
    return Cost(ms, intra, inter, "pairwise", host)


# ----------------------------------------------------------------------------- stragglers


@functools.lru_cache(maxsize=4096)
def expected_max(k: int, jitter_ms: float, dist: str = "uniform") -> float:
    """E[max of k independent delays]: uniform on [0, J] gives J k / (k + 1); normal with
    sigma = J gives J times the expected maximum of k standard normals."""
    if jitter_ms == 0 or k < 1:
        return 0.0
    if dist == "uniform":
        return jitter_ms * k / (k + 1)
    if k == 1:
        return 0.0
    # E[max] = integral of x k phi(x) Phi(x)^(k-1) dx, trapezoid on [-10, 10].
    steps, lo, hi = 4000, -10.0, 10.0
    h = (hi - lo) / steps
    total = 0.0
    for i in range(steps + 1):
        x = lo + i * h
        pdf = math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
        cdf = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        w = 0.5 if i in (0, steps) else 1.0
        total += w * x * k * pdf * cdf ** (k - 1)
    return jitter_ms * total * h


# ----------------------------------------------------------------------------- byte counts


def dlion_exchange(cl: Cluster, g: Group, numel: float, tensors: int, mode: str) -> Cost:
    """The two-phase exchange of ``numel`` elements among the p voters of ``g``: every rank
    owns ceil(blocks / p) blocks; all_to_all_single of its votes, all_gather of its tally."""
    if g.p <= 1:
        return Cost(algorithm="none")
    blocks = math.ceil(numel / BLOCK) + max(0, tensors - 1)  # <= 31 padding bits per tensor
    shard = shard_blocks(blocks, g.p)
    up = (shard * vote_planes("binary") + HEADER_WORDS) * WORD_BYTES
    down = shard * aggregate_planes(mode, "binary", g.p) * WORD_BYTES
    return all_to_all(cl, g, up) + all_gather(cl, g, down)


# ----------------------------------------------------------------------------- overlap


def bucket_timeline(ready: list[float], comm: list[float]) -> float:
    """Time the last bucket's exchange ends: one channel, buckets in order, bucket k starts
    when it is ready and its predecessor is done."""
    end = 0.0
    for r, c in zip(ready, comm):
        end = max(end, r) + c
    return end


# ----------------------------------------------------------------------------- rows


@dataclass
class Row:
    """One strategy's predicted step. Times in ms, bytes per rank per step (sent)."""

    strategy: str
    step_ms: float
    compute_ms: float  # fwd + bwd + optimizer on one rank, no waiting
    wait_ms: float  # expected wait for the slowest rank the strategy synchronises with
    comm_ms: float  # time of all its collectives if run alone
    exposed_comm_ms: float  # what of comm_ms the step waits for
    bytes_per_rank: float
    intra_bytes_per_rank: float
    inter_bytes_per_rank: float
    buckets: int
    algorithm: str
    options: dict  # how to run it: kind, mode, overlap, hierarchy, topology, dtype
    # what a rank holds (bytes), None where the row does not fix it (decentralized)
    param_bytes_per_rank: float | None = None
    grad_bytes_per_rank: float | None = None
    state_bytes_per_rank: float | None = None

    @property
    def memory_bytes_per_rank(self) -> float | None:
        """Parameters + gradients + optimizer state, or None."""
        parts = (self.param_bytes_per_rank, self.grad_bytes_per_rank, self.state_bytes_per_rank)
        return None if None in parts else sum(parts)

    def as_dict(self) -> dict:
        return dict(asdict(self), memory_bytes_per_rank=self.memory_bytes_per_rank)


def _counts(sizes: list[int]) -> list[tuple[int, int]]:
    """(size, how many buckets have it): buckets differ by at most one element."""
    out: dict[int, int] = {}
    for s in sizes:
        out[s] = out.get(s, 0) + 1
    return list(out.items())


def _bucket_sizes(numel: int, bucket_elems: int) -> list[int]:
    if numel == 0:
        return [0]
    count = max(1, math.ceil(numel / bucket_elems))
    base, extra = divmod(numel, count)
    return [base + (1 if k < extra else 0) for k in range(count)]


@dataclass(frozen=True)
class _Work:
    d: int
    tensors: int
    fwd: float
    bwd: float
    opt: float
    jitter: float
    dist: str
    bucket_elems: int
    grad_bytes: int
    param_bytes: int
    hier_gather: str = "aggregate"


def _ddp_row(cl, w, name, wire_bytes):
    g = Group(cl.n, cl.nodes, cl.L)
    sizes = _bucket_sizes(w.d, w.bucket_elems)
    memo = {s: all_reduce(cl, g, s * wire_bytes) for s, _ in _counts(sizes)}
    costs = [memo[s] for s in sizes]
    wait = expected_max(cl.n, w.jitter, w.dist)
    start = w.fwd + wait
    ready, acc = [], 0
    for s in sizes:
        acc += s
        ready.append(start + w.bwd * acc / max(w.d, 1))
    end = bucket_timeline(ready, [c.ms for c in costs])
    total = sum(costs, Cost())
    # The host's work for the collectives needs the cores that compute: it cannot hide.
    end = max(end, start + w.bwd + total.host_ms)
    exposed = max(0.0, end - (start + w.bwd))
    step = start + w.bwd + exposed + w.opt
    return Row(name, step, w.fwd + w.bwd + w.opt, wait, total.ms, exposed, total.bytes,
               total.intra_bytes, total.inter_bytes, len(sizes), costs[0].algorithm,
               {"kind": "allreduce", "dtype": "fp32" if wire_bytes == 4 else "bf16"},
               *_memory(w, 1, 1))


def _memory(w, shards: int, momentum_shards: int) -> tuple[float, float, float]:
    """(parameter, gradient, fp32 momentum) bytes per rank, the first two split over
    ``shards`` ranks, the momentum over ``momentum_shards``."""
    return (w.d * w.param_bytes / shards, w.d * w.grad_bytes / shards,
            4.0 * w.d / momentum_shards)


def _dlion_row(cl, w, mode, overlap, L):
    """Flat (L = 1) or hierarchical (L > 1) D-Lion, overlapped per bucket or not."""
    n = cl.n
    hier = L > 1
    voters = n // L
    wait = expected_max(n, w.jitter, w.dist)
    opt = w.opt / L  # sharded local step and apply inside the node
    intra_g = Group(L, 1, L)
    # The L inter groups (one per local rank) run at once through the node's NIC.
    inter_g = Group(voters, voters, 1, streams=L) if hier else Group(n, cl.nodes, cl.L)
    sizes = _bucket_sizes(w.d, w.bucket_elems) if overlap else [w.d]
    tensors = max(1, math.ceil(w.tensors / len(sizes)))

    def bucket_cost(s):
        c = dlion_exchange(cl, inter_g, s / L, tensors, mode)
        if hier:
            c = reduce_scatter(cl, intra_g, s * w.grad_bytes) + c
            if w.hier_gather == "params":  # the updated parameter shards, storage dtype
                c = c + all_gather(cl, intra_g, s / L * w.param_bytes)
            else:  # the packed aggregate shards; every rank applies all of it
                words = math.ceil(s / BLOCK / L) * aggregate_planes(mode, "binary", voters)
                c = c + all_gather(cl, intra_g, words * WORD_BYTES)
        return c

    memo = {s: bucket_cost(s) for s, _ in _counts(sizes)}
    costs = [memo[s] for s in sizes]
    total = sum(costs, Cost())
    local, apply = opt * LOCAL_FRACTION, opt * APPLY_FRACTION
    if hier and w.hier_gather != "params":
        apply = w.opt * X_ONLY_FRACTION + opt * (APPLY_FRACTION - X_ONLY_FRACTION)
    start = w.fwd + wait
    if overlap:
        ready, acc = [], 0
        for s in sizes:
            acc += s
            ready.append(start + (w.bwd + local) * acc / max(w.d, 1))
        end = bucket_timeline(ready, [c.ms for c in costs])
        compute_end = start + w.bwd + local
        end = max(end, compute_end + total.host_ms)  # host work cannot hide (see _ddp_row)
        exposed = max(0.0, end - compute_end)
        step = compute_end + exposed + apply
    else:
        exposed = total.ms
        step = start + w.bwd + local + exposed + apply
    name = f"dlion-{mode}" + ("-hier" if hier else "") + ("-overlap" if overlap else "")
    algo = costs[0].algorithm
    return Row(name, step, w.fwd + w.bwd + local + apply, wait, total.ms, exposed, total.bytes,
               total.intra_bytes, total.inter_bytes, len(sizes), algo,
               {"kind": "dlion", "mode": mode, "votes": "binary", "overlap": overlap,
                "hierarchy": L}, *_memory(w, 1, L))


def _fsdp_row(cl, w, sync: str, *, wire_bytes: int = 4, mode: str = "vote",
              overlap: bool = False):
    """FSDP2 in nodes of L = cl.L (module docstring): ``sync`` "allreduce" (HSDP, the replica
    all-reduce in ``wire_bytes`` per element) or "dlion" (the N replicas vote)."""
    L, N = cl.L, cl.nodes
    intra_g = Group(L, 1, L)
    inter_g = Group(N, N, 1, streams=L)  # the node's L replicate groups share its NIC
    sizes = _bucket_sizes(w.d, w.bucket_elems)
    tensors = max(1, math.ceil(w.tensors / len(sizes)))
    reduce_bytes = wire_bytes if sync == "allreduce" else 4
    gather = {s: all_gather(cl, intra_g, s / L * w.param_bytes) for s, _ in _counts(sizes)}
    # Between nodes, per unit once its backward is done: HSDP's all-reduce of the shard among
    # the N replicas, or D-Lion's exchange of it (overlap)
    across = {s: all_reduce(cl, inter_g, s / L * wire_bytes) if sync == "allreduce"
              else dlion_exchange(cl, inter_g, s / L, tensors, mode) if overlap else Cost()
              for s, _ in _counts(sizes)}

    def after(s):  # a unit's collectives once its backward is done
        return reduce_scatter(cl, intra_g, s * reduce_bytes) + across[s]

    done = {s: after(s) for s, _ in _counts(sizes)}
    votes = headers = Cost()
    if sync == "dlion":
        headers = all_gather(cl, intra_g, N * HEADER_WORDS * WORD_BYTES)
        if not overlap:
            votes = dlion_exchange(cl, inter_g, w.d / L, w.tensors, mode)
    # Bytes: FSDP2's collectives in the node by their byte model (every unit gathered twice);
    # between nodes what the replica all-reduce (ring, or tree where the cluster runs tree) or
    # D-Lion's exchange sends.
    fsdp = sum(fsdp_unit_bytes(s / L, s / L * w.param_bytes, L, N, reduce_bytes=reduce_bytes)[0]
               for s in sizes)
    other = sum((across[s] for s in sizes), Cost()) + votes + headers
    intra, inter = fsdp + other.intra_bytes, other.inter_bytes
    opt = w.opt / L
    local = opt * LOCAL_FRACTION if sync == "dlion" else 0.0
    wait = expected_max(cl.n, w.jitter, w.dist)
    start = wait
    # One channel, collectives in issue order. Forward: unit k's compute waits for its gather
    # (``ready``); the next unit's gather is issued as it starts.
    chan = ready = start + gather[sizes[0]].ms
    comp = start
    for k, s in enumerate(sizes):
        begin = max(comp, ready)
        if k + 1 < len(sizes):
            chan = ready = max(chan, begin) + gather[sizes[k + 1]].ms
        comp = begin + w.fwd * s / max(w.d, 1)
    # backward (units in reverse): gathered again, computed, then the unit's collectives
    back = sizes[::-1]
    chan = ready = max(chan, comp) + gather[back[0]].ms
    for k, s in enumerate(back):
        begin = max(comp, ready)
        if k + 1 < len(back):
            chan = ready = max(chan, begin) + gather[back[k + 1]].ms
        comp = begin + (w.bwd + (local if overlap else 0.0)) * s / max(w.d, 1)
        chan = max(chan, comp) + done[s].ms
    total = sum((gather[s].times(2) + done[s] for s in sizes), Cost()) + votes + headers
    compute_end = comp if overlap else comp + local
    end = max(chan, compute_end + total.host_ms) + votes.ms + headers.ms
    apply = opt * APPLY_FRACTION if sync == "dlion" else opt
    step = end + apply
    compute = w.fwd + w.bwd + opt
    if sync == "allreduce":
        name = "fsdp-allreduce" if wire_bytes == 4 else "fsdp-allreduce-bf16"
        options = {"kind": "fsdp", "sync": sync, "dtype": "fp32" if wire_bytes == 4 else "bf16"}
    else:
        name = "fsdp-dlion" + ("-overlap" if overlap else "")  # vote: FSDP2's one mode
        options = {"kind": "fsdp", "sync": sync, "mode": mode, "votes": "binary",
                   "overlap": overlap}
    return Row(name, step, compute, wait, total.ms, step - compute - wait, intra + inter,
               intra, inter, len(sizes), "+".join(
                   dict.fromkeys(a for a in total.algorithm.split("+") if a)), options,
               *_memory(w, L, L))


# ----------------------------------------------------------------------------- local steps


# DiLoCo's outer steps the model predicts (row ``diloco-<outer>``): the plain 1-bit vote, the
# fp32 Nesterov step, the vote with error feedback (decayed, or with a per-tensor scale),
# SparseLoCo
DILOCO_OUTERS = ("dlion", "nesterov", "dlion-ef", "dlion-ef-decay", "dlion-ef-scale",
                 "sparseloco")
# SparseLoCo's default density (top 64 of every run of 4096 elements) and its passes over the
# fragment at a sync (the accumulator, top-k and the dense decode of every rank's values): 2
SPARSELOCO_DENSITY = 64 / 4096
# the outer pass of the vote with error feedback reads p and writes the residual as well: 1.5
# optimizer-like passes (the decay scales the residual in that same pass)
OUTER_PASSES = {"dlion": 1.0, "nesterov": 1.0, "dlion-ef": 1.5, "dlion-ef-decay": 1.5,
                "dlion-ef-scale": 1.5, "sparseloco": 2.0}


def _diloco_row(cl, w, outer, H, P, tau):
    """DiLoCo with one of ``DILOCO_OUTERS`` as the outer step (see the module docstring)."""
    g = Group(cl.n, cl.nodes, cl.L)
    numel, tensors, k = w.d / P, max(1, math.ceil(w.tensors / P)), H // P
    hidden = tau * (w.fwd + w.bwd + w.opt)  # the inner steps the exchange runs behind
    if outer.startswith("dlion"):
        blocks = math.ceil(numel / BLOCK) + max(0, tensors - 1)
        shard = shard_blocks(blocks, cl.n) if cl.n > 1 else 0
        up = all_to_all(cl, g, (shard * vote_planes("binary") + HEADER_WORDS) * WORD_BYTES)
        down = all_gather(cl, g, shard * aggregate_planes("vote", "binary", cl.n) * WORD_BYTES)
        if outer == "dlion-ef-scale":  # one fp32 scale per tensor and rank, gathered
            down = down + all_gather(cl, g, 4 * tensors)
        comm = up + down
        exposed = max(0.0, up.ms - hidden) + up.host_ms + down.ms if tau else comm.ms
    elif outer == "sparseloco":  # every rank's (16-bit offset, 2-bit value) list, gathered
        kept = math.ceil(numel * SPARSELOCO_DENSITY)
        comm = all_gather(cl, g, HEADER_WORDS * WORD_BYTES + 8 * tensors + 2 * kept
                          + math.ceil(kept / 4))
        exposed = max(0.0, comm.ms - hidden) + comm.host_ms if tau else comm.ms
    else:
        comm = all_reduce(cl, g, 4 * numel)
        exposed = max(0.0, comm.ms - hidden) + comm.host_ms if tau else comm.ms
    exposed = min(exposed, comm.ms)
    outer_ms = OUTER_PASSES[outer] * w.opt / P  # fused passes over the fragment
    # the slowest rank's k steps of jitter, per inner step (normal approximation of the sums)
    spread = expected_max(cl.n, 1.0, "normal") / math.sqrt(k)
    wait = w.jitter * ((0.5 + spread / math.sqrt(12)) if w.dist == "uniform" else spread)
    compute = w.fwd + w.bwd + w.opt
    step = compute + wait + (exposed + outer_ms) / k
    per = comm.times(1.0 / k)
    # state: the inner AdamW's two fp32 moments, theta_bar, the outer momentum (SparseLoCo's
    # accumulator) and error feedback's residual (fp32)
    state = 8.0 * w.d + w.d * w.param_bytes + 4.0 * w.d + (4.0 * w.d if "-ef" in outer else 0)
    return Row(f"diloco-{outer}", step, compute + outer_ms / k, wait, per.ms, exposed / k,
               per.bytes, per.intra_bytes, per.inter_bytes, 1, comm.algorithm,
               {"kind": "diloco", "outer": outer, "sync_every": H, "fragments": P,
                "overlap_steps": tau, "sync_ms": comm.ms, "sync_bytes": comm.bytes},
               w.d * w.param_bytes, w.d * w.grad_bytes, state)


# ----------------------------------------------------------------------------- topologies


def _gossip_step(cl: Cluster, groups, nbytes: float) -> Cost:
    """All groups of one step all-reduce ``nbytes`` at once: the slowest group's time, the
    mean bytes per rank. Rings of different groups leaving one node share its NIC."""
    streams: dict[int, int] = {}
    layout = []
    for grp in groups:
        nodes = sorted({cl.node(r) for r in grp})
        layout.append((grp, nodes))
        if len(nodes) > 1:
            for a in nodes:
                streams[a] = streams.get(a, 0) + 1
    slowest, intra, inter, seen = Cost(), 0.0, 0.0, {}
    for grp, nodes in layout:
        per_node = max(sum(1 for r in grp if cl.node(r) == a) for a in nodes)
        s = max((streams.get(a, 1) for a in nodes), default=1)
        key = (len(grp), len(nodes), per_node, s)
        if key not in seen:
            seen[key] = all_reduce(cl, Group(*key), nbytes)
        c = seen[key]
        if c.ms > slowest.ms or not slowest.algorithm:
            slowest = c
        intra += c.intra_bytes * len(grp)
        inter += c.inter_bytes * len(grp)
    return Cost(slowest.ms, intra / cl.n, inter / cl.n, slowest.algorithm, slowest.host_ms)


def _gossip_wait(cl: Cluster, groups, w: _Work) -> float:
    """Mean over ranks of the expected wait for the slowest member of the rank's group."""
    return sum(expected_max(len(g), w.jitter, w.dist) * len(g) for g in groups) / cl.n


def _decentralized_row(cl, w, topology, gossip_bytes):
    sizes = _bucket_sizes(w.d, w.bucket_elems)
    steps = [schedule(topology, cl.n, cl.L, t) for t in range(period(topology, cl.n, cl.L))]
    total, wait = Cost(), 0.0
    for groups in steps:
        for s, count in _counts(sizes):
            total = total + _gossip_step(cl, groups, s * gossip_bytes).times(count)
        wait += _gossip_wait(cl, groups, w)
    total = total.times(1.0 / len(steps))
    wait /= len(steps)
    compute = w.fwd + w.bwd + w.opt
    # The gossip of iteration t has all of iteration t+1's compute to hide behind.
    step = max(compute + wait + total.host_ms, total.ms)
    exposed = step - (compute + wait)
    algo = "+".join(sorted({a for a in total.algorithm.split("+") if a}))
    # accum-adamw's slug: the topology's other optimizers run the same gossip (strategies.py)
    return Row(f"decentralized-{topology}-accum-adamw", step, compute, wait, total.ms, exposed,
               total.bytes, total.intra_bytes, total.inter_bytes, len(sizes), algo,
               {"kind": "decentralized", "topology": topology,
                "gossip_dtype": "fp32" if gossip_bytes == 4 else "bf16"})


# ----------------------------------------------------------------------------- predict


def _dtype_bytes(value, name):
    table = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}
    if value not in table:
        raise ValueError(f"{name} must be one of fp32, bf16, fp16, got {value!r}")
    return table[value]


def predict(params, ranks, ranks_per_node=1, *, inter_gbps, intra_gbps=None, latency_us=30.0,
            intra_latency_us=None, fwd_ms, bwd_ms, opt_ms=None, mem_gbs=1000.0, jitter_ms=0.0,
            jitter_dist="uniform", bucket_mb=BUCKET_MB, tensors=1, grad_dtype="fp32",
            param_dtype="fp32", gossip_dtype="fp32", algorithm="auto", modes=("vote",),
            topologies=None, strategies=None, calibration=None, cpu_gbs=None,
            hier_gather="aggregate", sync_every=8, fragments=1, overlap_steps=0) -> list[Row]:
    """Predicted step of every strategy, fastest first (see the module docstring).

    ``params``: parameter count (int or '124M'); ``ranks``: n; ``ranks_per_node``: L;
    ``inter_gbps``: each node's link to the others; ``intra_gbps``: each rank's link inside the
    node (default: ``DEFAULT_INTRA_GBPS``, NVLink-class, when ``ranks_per_node`` > 1; with one rank
    per node nothing crosses it); ``latency_us`` /
    ``intra_latency_us``: per message (intra default 5 us, at most latency_us); ``fwd_ms``,
    ``bwd_ms``: compute per step and rank; ``opt_ms``: one optimizer pass over all parameters
    (default: ``OPT_BYTES_PER_PARAM``, the 28.5 bytes per parameter of one fused D-Lion step,
    at ``mem_gbs`` GB/s); ``jitter_ms``: extra delay per rank and step, ``jitter_dist``
    'uniform' on [0, jitter] or 'normal' with that sigma;
    ``topologies``: None = every topology that fits (others are left out), or a list (one that
    does not fit raises ValueError); ``strategies``: keep only these names; ``cpu_gbs``: host
    processing rate per rank for the bytes a collective sends or sums (None: free, as with
    NCCL/RDMA; gloo on CPU cores shared by several ranks needs it); ``hier_gather``: what
    hierarchical D-Lion gathers inside the node, 'aggregate' (the packed aggregate, as the
    library does) or 'params' (the updated parameter shards); ``sync_every``, ``fragments``,
    ``overlap_steps``: DiLoCo's H, P and tau for the ``diloco-*`` rows (H a multiple of P,
    tau < H / P).
    """
    d = parse_size(params, "params")
    n = _number(ranks, "ranks", positive=True, integer=True)
    L = _number(ranks_per_node, "ranks_per_node", positive=True, integer=True)
    if n % L:
        raise ValueError(f"ranks ({n}) must be a multiple of ranks_per_node ({L})")
    inter_gbps = _number(inter_gbps, "inter_gbps", positive=True)
    if intra_gbps is None:
        intra_gbps = DEFAULT_INTRA_GBPS if L > 1 else inter_gbps
    intra_gbps = _number(intra_gbps, "intra_gbps", positive=True)
    latency_us = _number(latency_us, "latency_us")
    if intra_latency_us is None:
        intra_latency_us = min(5.0, latency_us)
    intra_latency_us = _number(intra_latency_us, "intra_latency_us")
    fwd_ms = _number(fwd_ms, "fwd_ms")
    bwd_ms = _number(bwd_ms, "bwd_ms")
    mem_gbs = _number(mem_gbs, "mem_gbs", positive=True)
    opt_ms = d * OPT_BYTES_PER_PARAM / (mem_gbs * 1e9) * 1e3 if opt_ms is None else \
        _number(opt_ms, "opt_ms")
    jitter_ms = _number(jitter_ms, "jitter_ms")
    if jitter_dist not in JITTER_DISTS:
        raise ValueError(f"jitter_dist must be one of {', '.join(JITTER_DISTS)}, "
                         f"got {jitter_dist!r}")
    bucket_mb = _number(bucket_mb, "bucket_mb", positive=True)
    tensors = _number(tensors, "tensors", positive=True, integer=True)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    modes = (modes,) if isinstance(modes, str) else tuple(modes)
    for m in modes:
        if m not in MODES:
            raise ValueError(f"modes: unknown mode {m!r}; allowed: {', '.join(MODES)}")
    grad_bytes = _dtype_bytes(grad_dtype, "grad_dtype")
    param_bytes = _dtype_bytes(param_dtype, "param_dtype")
    gossip_bytes = _dtype_bytes(gossip_dtype, "gossip_dtype")
    if topologies is None:
        topos = [t for t in TOPOLOGIES if problem(t, n, L) is None]
    else:
        topos = [topologies] if isinstance(topologies, str) else list(topologies)
        for t in topos:
            reason = problem(t, n, L)
            if reason:
                raise ValueError(f"topologies: {reason}")

    if cpu_gbs is not None:
        cpu_gbs = _number(cpu_gbs, "cpu_gbs", positive=True)
    if isinstance(calibration, dict):  # as --measure --json prints it
        calibration = Calibration(dict(calibration.get("lat_scale", {})),
                                  dict(calibration.get("bw_scale", {})))
    if calibration is not None and not isinstance(calibration, Calibration):
        raise TypeError(f"calibration must be a Calibration, a dict or None, got "
                        f"{type(calibration).__name__}")
    cl = Cluster(n, L, Link(intra_latency_us, intra_gbps), Link(latency_us, inter_gbps),
                 algorithm, calibration or Calibration(), cpu_gbs)
    H = _number(sync_every, "sync_every", positive=True, integer=True)
    P = _number(fragments, "fragments", positive=True, integer=True)
    tau = _number(overlap_steps, "overlap_steps", integer=True)
    if H % P:
        raise ValueError(f"sync_every ({H}) must be a multiple of fragments ({P})")
    if tau >= H // P:
        raise ValueError(f"overlap_steps must be < sync_every / fragments = {H // P}, got {tau}")
    if hier_gather not in ("aggregate", "params"):
        raise ValueError(f"hier_gather must be 'aggregate' or 'params', got {hier_gather!r}")
    w = _Work(d, tensors, fwd_ms, bwd_ms, opt_ms, jitter_ms, jitter_dist,
              max(1, int(bucket_mb * 2**20 / grad_bytes)), grad_bytes, param_bytes, hier_gather)

    rows = [_ddp_row(cl, w, "lion-allreduce", 4), _ddp_row(cl, w, "lion-allreduce-bf16", 2)]
    for mode in modes:
        for overlap in (False, True):
            rows.append(_dlion_row(cl, w, mode, overlap, 1))
            if 1 < L:
                rows.append(_dlion_row(cl, w, mode, overlap, L))
                if mode == "vote":  # the one mode the registry runs on FSDP2
                    rows.append(_fsdp_row(cl, w, "dlion", mode=mode, overlap=overlap))
    if 1 < L:
        rows += [_fsdp_row(cl, w, "allreduce", wire_bytes=b) for b in (4, 2)]
    rows += [_decentralized_row(cl, w, t, gossip_bytes) for t in topos]
    rows += [_diloco_row(cl, w, outer, H, P, tau) for outer in DILOCO_OUTERS]
    if strategies is not None:
        wanted = [strategies] if isinstance(strategies, str) else list(strategies)
        names = {r.strategy for r in rows}
        unknown = [s for s in wanted if s not in names]
        if unknown:
            raise ValueError(f"strategies: {unknown} not among the strategies for this cluster: "
                             f"{', '.join(sorted(names))}")
        rows = [r for r in rows if r.strategy in wanted]
    rows.sort(key=lambda r: (r.step_ms, r.bytes_per_rank))
    return rows


def per_inner_step(row: Row) -> bool:
    """Whether the row's times are per inner step of local-step training (``diloco-*``), which
    syncs every H / P steps: not comparable with a training step of the other strategies."""
    return row.options.get("kind") == "diloco"


def best(rows: list[Row]) -> str:
    """The slug of the fastest row among those timed per training step; the ``diloco-*`` rows
    (per inner step) are ranked only when no other row is given."""
    if not rows:
        raise ValueError("rows is empty: nothing to choose from")
    ranked = [r for r in rows if not per_inner_step(r)] or rows
    return min(ranked, key=lambda r: (r.step_ms, r.bytes_per_rank)).strategy


# ----------------------------------------------------------------------------- callers


def rank_strategies(params, ranks, ranks_per_node=1, *, allowed=None,
                    **inputs) -> list[tuple[str, Row]]:
    """(slug, predicted row) of the named strategies (``dlion_kernels.strategies``) that can run
    on this cluster, fastest first. ``allowed``: slugs (None: every strategy the model
    predicts but local steps, ``diloco-*``, which change the training itself: fewer syncs, a
    different loss per step; name them to compare them); strategies that one row predicts
    (``adamw-allreduce`` and ``lion-allreduce``) appear once: as the row's own slug when it is
    allowed, else as the first of the others in ``allowed`` order. ``inputs``: the rest of
    predict()'s keyword arguments (modes, topologies and strategies follow from ``allowed``)."""
    n = _number(ranks, "ranks", positive=True, integer=True)
    L = _number(ranks_per_node, "ranks_per_node", positive=True, integer=True)
    if allowed is None:
        names = [s.slug for s in STRATEGIES.values()
                 if s.row is not None and s.family != "diloco"]
    else:
        names = [allowed] if isinstance(allowed, str) else list(allowed)
    by_row: dict[str, str] = {}
    for slug in names:
        strategy = get_strategy(slug)
        if strategy.row is None:
            raise ValueError(f"allowed: the runtime model has no row for {slug!r}; modelled: "
                             + ", ".join(s.slug for s in STRATEGIES.values() if s.row))
        if strategy.problem(n, L) is None and (strategy.row not in by_row
                                               or slug == strategy.row):
            by_row[strategy.row] = slug
    if not by_row:
        raise ValueError(f"allowed: none of {names} can run on {n} ranks in nodes of {L}")
    chosen = [get_strategy(slug) for slug in by_row.values()]
    modes = tuple(dict.fromkeys(s.options["mode"] for s in chosen if "mode" in s.options))
    topos = list(dict.fromkeys(s.options["topology"] for s in chosen if "topology" in s.options))
    rows = predict(params, n, L, modes=modes or ("vote",), topologies=topos,
                   strategies=list(by_row), **inputs)
    return [(by_row[r.strategy], r) for r in rows]


def choose_strategy(params, ranks, ranks_per_node=1, *, allowed=None,
                    **inputs) -> tuple[str, Row]:
    """The fastest of ``rank_strategies``: (its slug, its predicted row); for the demo's
    ``--strategy auto``."""
    return rank_strategies(params, ranks, ranks_per_node, allowed=allowed, **inputs)[0]


def choose_hierarchy(n, ranks_per_node, params, *, mode="vote", overlap=False, **inputs) -> int:
    """``DistributedLion(hierarchy="auto")``: L when hierarchical D-Lion is predicted faster
    than flat D-Lion with the same mode and overlap, else 1."""
    L = _number(ranks_per_node, "ranks_per_node", positive=True, integer=True)
    if L == 1:
        return 1
    suffix = "-overlap" if overlap else ""
    flat, hier = f"dlion-{mode}{suffix}", f"dlion-{mode}-hier{suffix}"
    rows = {r.strategy: r for r in predict(params, n, L, modes=(mode,), topologies=[],
                                           strategies=[flat, hier], **inputs)}
    return L if rows[hier].step_ms < rows[flat].step_ms else 1


def inputs_from_json(path: str) -> dict:
    """predict()'s keyword arguments (links, compute, calibration) from the JSON that
    ``python -m dlion_kernels.plan --measure --json`` printed, without params, ranks and
    ranks_per_node: e.g. ``choose_hierarchy(n, L, params, **inputs_from_json(path))``."""
    import json

    with open(path) as f:
        doc = json.load(f)
    inputs = dict(doc.get("inputs", {}))
    for key in ("params", "ranks", "ranks_per_node", "modes", "topologies"):
        inputs.pop(key, None)
    if "measured" in doc and "calibration" in doc["measured"]:
        inputs["calibration"] = doc["measured"]["calibration"]
    return inputs
