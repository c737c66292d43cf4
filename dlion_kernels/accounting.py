"""Bytes a rank sends in the collectives D-Lion does not run itself, and the bytes of memory
D-Lion's fused stages move, without torch.

D-Lion's own exchange counts what it sends (``StepStats``). The gradient all-reduce it replaces,
gossip averaging and FSDP2's collectives are run by torch.distributed, which counts nothing, so
every report of their bytes (the optimizer's ``allreduce_fp32_bytes``, the strategies built by
``build/``, the demos, the runtime model in ``plan/``) uses these formulas, for the ring
algorithms gloo runs (and NCCL's ring). Bytes are per rank, sent.

- All-reduce of S bytes over p ranks: a reduce-scatter and an all-gather of S / p chunks, each
  p - 1 steps: 2 (p - 1) / p * S.
- FSDP2, one unit (module sharded on L ranks of a node, N replicas of each shard): every rank
  holds a shard of s elements (padded); per step it all-gathers the parameters in forward and
  again in backward (the root module once: its parameters stay unsharded in between), sending its
  shard to each of the L - 1 peers each time, and reduce-scatters the unit's L s gradient
  elements, sending (L - 1) s of them; with HSDP the N replicas also all-reduce the shard of
  gradients across nodes.
- D-Lion's fused stages (kernel stages v2), bytes of memory traffic per fp32 element: the local
  step reads g and m and writes one vote bit (8.125); the tally reads one vote plane and writes
  one aggregate plane (0.25, one voter); apply reads x, g, m and the aggregate bit and writes x
  and m (20.125); a whole step 28.5. Apply on x only (no momentum: ``exp_avgs=None``) reads and
  writes x and reads the aggregate bit (8.125). ``bench/bench_kernels.py`` times each stage
  against these counts; the runtime model charges the optimizer by them.
"""

from __future__ import annotations

import math

# D-Lion's fused stages, bytes of memory traffic per element (kernel stages v2); the momentum
# is fp32 whatever the parameters' dtype
_F32, _BIT = 4, 1 / 8


# Bucket size, MiB: DDP's default, which D-Lion's overlap buckets, the gossip buckets and the
# runtime model follow (one number for all of them)
BUCKET_MB = 25.0


def local_step_bytes(grad_bytes: float = _F32) -> float:
    """The local step, per element: g (``grad_bytes``) and m read, the vote bit written."""
    return grad_bytes + _F32 + _BIT


def tally_bytes(voters: int = 1, planes: int = 1) -> float:
    """The tally, per element: each voter's vote plane read, ``planes`` aggregate planes
    written."""
    return (voters + planes) * _BIT


def apply_bytes(param_bytes: float = _F32, grad_bytes: float = _F32, planes: int = 1) -> float:
    """Apply, per element: x (``param_bytes``) and m read and written, g (``grad_bytes``) read,
    ``planes`` aggregate planes read (0: torch's own Lion step, which reads no vote)."""
    return 2 * param_bytes + grad_bytes + 2 * _F32 + planes * _BIT


LOCAL_STEP_BYTES = local_step_bytes()  # 8.125
TALLY_BYTES = tally_bytes()  # 0.25: one voter
APPLY_BYTES = apply_bytes()  # 20.125
STEP_BYTES = LOCAL_STEP_BYTES + TALLY_BYTES + APPLY_BYTES  # 28.5: one whole D-Lion step
X_ONLY_APPLY_BYTES = 2 * _F32 + _BIT  # apply without momentum: x read and written, aggregate


def ring_all_reduce_bytes(ranks: int, nbytes: float) -> float:
    """What one rank sends in a ring all-reduce of ``nbytes`` (its buffer) over ``ranks`` ranks:
    2 (ranks - 1) / ranks * nbytes; 0 on one rank."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be an int >= 1, got {ranks!r}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    return 2 * (ranks - 1) / ranks * nbytes


def fsdp_unit_bytes(shard_elems: float, shard_param_bytes: float, ranks_per_node: int,
                    nodes: int, *, reduce_bytes: int, gathers: int = 2,
                    replicas_all_reduce: bool = False) -> tuple[float, float]:
    """(bytes inside the node, bytes between nodes) one rank sends per step in FSDP2's own
    collectives for one unit.

    shard_elems: the rank's shard of the unit's parameters, in elements (padded as FSDP2 pads).
    shard_param_bytes: that shard's bytes in the parameters' dtypes (what the all-gather moves).
    ranks_per_node: L, the ranks one shard dimension spans (inside a node).
    nodes: N, the replicas of each shard (one per node).
    reduce_bytes: bytes per gradient element on the wire (4 fp32, 2 bf16).
    gathers: all-gathers of the parameters per step (2: forward and backward; the root 1).
    replicas_all_reduce: HSDP: the N replicas all-reduce the gradient shard between nodes.
    """
    if ranks_per_node < 1 or nodes < 1:
        raise ValueError(f"ranks_per_node and nodes must be >= 1, got {ranks_per_node!r} and "
                         f"{nodes!r}")
    if gathers not in (1, 2):
        raise ValueError(f"gathers must be 1 or 2, got {gathers!r}")
    intra = (ranks_per_node - 1) * (gathers * shard_param_bytes + shard_elems * reduce_bytes)
    inter = ring_all_reduce_bytes(nodes, reduce_bytes * shard_elems) if replicas_all_reduce \
        else 0.0
    return intra, inter


def gossip_bytes_per_step(numel: int, element_size: int, group_size: int) -> float:
    """Bytes a rank sends per step for a ring all-reduce of ``numel`` elements of
    ``element_size`` bytes in a group of ``group_size`` ranks (a gossip round, DiLoCo's
    Nesterov sync)."""
    return ring_all_reduce_bytes(group_size, numel * element_size)


def ddp_all_reduce_bytes(ranks: int, numel: int, *, wire_bytes: int = 4,
                         ranks_per_node: int | None = None) -> tuple[int, int | None]:
    """(bytes sent, bytes sent to other nodes or None) per step of DDP's gradient all-reduce of
    ``numel`` elements over ``ranks`` ranks: one ring in ``wire_bytes`` per element, or with
    ``ranks_per_node`` = L (the hierarchical hook, fp32) a reduce-scatter and an all-gather in
    the node (together the bytes of a ring all-reduce over L) plus the ring all-reduce of the
    1 / L shard across the ranks / L nodes."""
    if ranks_per_node is None:
        return round(ring_all_reduce_bytes(ranks, wire_bytes * numel)), None
    L = ranks_per_node
    inter = round(ring_all_reduce_bytes(ranks // L, 4 * numel / L))
    return round(ring_all_reduce_bytes(L, 4 * numel)) + inter, inter


def fsdp_shard_elems(param, ranks_per_node: int) -> int:
    """Elements of a parameter's local shard as FSDP2 pads it: ceil(rows / L) rows (a tensor,
    or anything with ``shape``, ``dim()`` and ``numel()``)."""
    rows = param.shape[0] if param.dim() else 1
    return math.ceil(rows / ranks_per_node) * (param.numel() // rows if rows else 0)


def fsdp_model_bytes(units, model, ranks_per_node: int, nodes: int, reduce_bytes: int,
                     hsdp: bool) -> tuple[int, int]:
    """(bytes inside the node, bytes between nodes) a rank sends per step in FSDP2's own
    collectives for ``model`` sharded unit by unit (``units``: the modules sharded before the
    root), ``fsdp_unit_bytes`` per unit with its shard padded as FSDP2 pads it, the root
    gathered once (its parameters stay unsharded between forward and backward); the gradients
    in ``reduce_bytes`` per element; ``hsdp``: the replicas all-reduce the gradient shards.
    Checked against the counted collectives in python_tests/test_build.py."""
    L, N = ranks_per_node, nodes
    own = {id(p) for u in units for p in u.parameters()}
    root = [p for p in model.parameters() if id(p) not in own]
    intra = inter = 0
    for params, gathers in [(list(u.parameters()), 2) for u in units] + [(root, 1)]:
        shard = sum(fsdp_shard_elems(p, L) for p in params)
        gathered = sum(fsdp_shard_elems(p, L) * p.element_size() for p in params)
        a, b = fsdp_unit_bytes(shard, gathered, L, N, reduce_bytes=reduce_bytes, gathers=gathers,
                               replicas_all_reduce=hsdp)
        intra, inter = intra + round(a), inter + round(b)
    return intra, inter
