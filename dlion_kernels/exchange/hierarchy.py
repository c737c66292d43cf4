"""Hierarchical D-Lion (``hierarchy=L``): exact gradient mean inside a node, votes between nodes.

n ranks form N = n / L nodes of L consecutive ranks. Node k is ranks kL .. kL+L-1; rank r has
local rank l = r mod L. Process groups (built once per (world, L) and cached; every rank creates
every group in the same order, as ``new_group`` requires):

- intra-node group of node k: ranks kL .. kL+L-1 (fast links);
- inter-node group of local rank l: ranks l, l+L, .., l+(N-1)L, one rank per node (slow links).

Shard layout. The tensors are laid end to end in the block space of ``layout.py`` (32-element
blocks, every tensor starting on a block). With T blocks in all, the inter-node sub-shard is
S1 = shard_blocks(T, n) blocks and the node shard S = N * S1 blocks; the space is zero-padded to
L * S = n * S1 blocks and local rank l owns blocks [l S, (l+1) S). A shard is a range of blocks,
not a set of tensors: a tensor may straddle shards. Because S is a multiple of N, the inter-node
exchange of a node shard needs no further padding, and the L tallied node shards laid side by
side are exactly the flat aggregate of all T blocks.

One step on rank r (local rank l, node k):

1. every gradient is copied into a flat fp32 workspace of L S blocks (zeros elsewhere);
   ``reduce_scatter_tensor`` (sum) inside the node leaves rank r the node's fp32 sum for its
   shard, divided by L: the node-mean gradient, exact when the sum is;
2. non-finite check on the shard (OR, under an fp16 GradScaler, the rank's own overflow flag),
   agreed across nodes (inter-node all_gather of one word) and then inside the node (intra-node
   all_gather of [flag, step]): every rank takes the same decision, and ranks at different
   steps raise, before anything is modified;
3. local step on the shard with the rank's momentum shard (S * 32 fp32 elements, ~1/L of the
   model): packed votes of the shard;
4. the two-phase vote exchange of ``pipeline.py`` (one bucket: the shard; all_to_all with the
   [flag, step] header, tally, all_gather) on the inter-node group with the N nodes as voters;
5. intra-node ``all_gather_into_tensor`` of the packed aggregate shards (P_out bits per element);
   only then, after the step's last collective, the momentum shard is updated
   (m = b2 m + (1 - b2) g) and every rank applies the full aggregate to all of its parameters
   with n = N. A peer that dies in any collective leaves this rank's state as it was
   (``DistributedStepError`` naming the step and the collective, ``collectives.py``).

Step 5 gathers the packed aggregate instead of the updated parameters: it moves P_out bits per
element inside the node instead of 16 or 32, needs no parameter workspace for mixed dtypes, and
``apply`` is deterministic, so the parameters stay bit-identical on all n ranks. On the CPU it was
also the faster of the two (bench/bench_hierarchy_gather.py; numbers in docs/hierarchy.md).

Overlap (``overlap=True``, ``OverlapStep``): the same phases per bucket of the bucket engine
(``buckets.py``), during backward. Each bucket is its own block space laid out as above (S1_b =
shard_blocks(T_b, n), S_b = N S1_b; local rank l owns the bucket's blocks [l S_b, (l+1) S_b)),
so a parameter, which lies in one bucket, still has one contiguous range of momentum on a rank;
the rank's momentum buffer is its bucket shards end to end. Per bucket: 1. node reduce_scatter,
2.-4. the flag goes in the [flag, step] header of the inter-node all_to_all (no separate flag
collectives), local step, tally, inter-node all_gather; 5. node all_gather of the N received
headers followed by the aggregate shard, so every rank sees all n headers of every bucket.
Phases 1-4 run when the bucket is ready (the reduce-scatter synchronously: the local step needs
it); the tally, inter-node gather and node gather of bucket k are issued when bucket k+1 starts
(lag one, ``pipeline.py``, Ordering), in bucket order on every group, and waited for at step().
``step()`` (``Exchange.finish``) takes one device skip flag from all the headers; the momentum
update and the apply (pipeline's ``update_momentum`` and ``apply_rows``) obey it (a NaN on any
rank, or ranks on different steps, change nothing anywhere; the mismatch then raises), as the
flat overlap does. Results are bit for bit those without overlap: every element's vote, tie
bit and update are the same, and so is its node sum for L = 2 (for L > 2 the reduce_scatter may
add the L values in another order when the element lies in another rank's shard: identical when
the sums are exact). Bytes differ by each bucket's header words and padding.

The momentum is never gathered: a rank holds only its shard. The functional ``fused_dlion_step``
reads and writes only the shard's elements of the full-size ``exp_avgs`` it is given;
``DistributedLion`` keeps one flat fp32 buffer per rank and exposes per-parameter views of it as
``state[p]["exp_avg"]`` (1-D, possibly empty) with ``state[p]["exp_avg_range"]`` = (lo, hi), the
parameter's elements that the view covers.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..kernels import backends
from ..kernels.layout import BLOCK, block_offsets, shard_blocks
from .agree import explain_step as explain
from .checks import DTYPES, check_params, check_tensor
from .collectives import (
    DistributedStepError,
    as_timedelta,
    collective,
    reduce_scatter_into_tensor,
)
from .groups import cached, new_group, retire
from .header import HEADER_WORDS, NONFINITE, decide, make_header, settings_word
from .pipeline import (
    ABORTED,
    WORD_BYTES,
    BucketWork,
    Exchange,
    NonFiniteGradientError,
    Row,
    StepStats,
    all_gather,
    apply_rows,
    check_group_device,
    update_momentum,
)

_F32_BYTES = 4
# Names of the hierarchy's own collectives in errors (DistributedStepError) and fault tests; the
# inter-node exchange keeps pipeline.py's names (all_to_all_single(votes), all_gather(aggregate)).
REDUCE_SCATTER = "reduce_scatter_tensor(node gradient)"
FLAGS = "all_gather(node flags)"
HEADERS = "all_gather(node headers)"
NODE_GATHER = "all_gather(node aggregate)"
# the step's last collective, over all n ranks (``commit``)
COMMIT = "all_gather(commit)"


# ----------------------------------------------------------------------------- the option


def resolve_hierarchy(hierarchy) -> int:
    """Ranks per node L for the ``hierarchy`` option: None -> 1 (flat), int L >= 1, "node" ->
    $LOCAL_WORLD_SIZE. Does not look at the process group (see ``topology``)."""
    if hierarchy is None:
        return 1
    if isinstance(hierarchy, str):
        if hierarchy == "node":
            value = os.environ.get("LOCAL_WORLD_SIZE")
            if value is None or not value.isdigit() or int(value) < 1:
                raise ValueError(
                    'hierarchy="node" takes the ranks per node from $LOCAL_WORLD_SIZE (set by '
                    f"torchrun), which is {value!r}; pass hierarchy=L (an int) instead"
                )
            return int(value)
        if hierarchy == "auto":
            # DistributedLion resolves "auto" once, through the runtime model, before calling
            # this; a per-call step cannot afford the calibration.
            raise ValueError(
                'hierarchy="auto" is resolved once by DistributedLion (the runtime model '
                "calibrates then); for fused_dlion_step pass the L it chose "
                '(opt.ranks_per_node, or dlion_kernels.plan.auto.hierarchy(...)), "node" or None'
            )
    elif isinstance(hierarchy, int) and not isinstance(hierarchy, bool) and hierarchy >= 1:
        return hierarchy
    raise ValueError(
        f'hierarchy must be None, "node", or an int L >= 1 (ranks per node), got {hierarchy!r}'
    )


def check_world(group, ranks_per_node: int) -> None:
    """ValueError now, before any step, if the initialized world does not form nodes of L."""
    if ranks_per_node > 1 and dist.is_available() and dist.is_initialized():
        if group is not None and group != dist.group.WORLD:
            raise ValueError("hierarchy works on the default process group only: pass "
                             "group=None")
        n = dist.get_world_size()
        if n % ranks_per_node:
            raise ValueError(
                f"hierarchy: the {n} ranks do not form nodes of {ranks_per_node} ranks (n must "
                "be a multiple of the ranks per node L)"
            )


@dataclass(frozen=True)
class Topology:
    n: int
    ranks_per_node: int  # L
    nodes: int  # N
    node: int
    local: int
    intra: object  # process group of this rank's node
    inter: object  # process group of this rank's local rank across nodes
    whole: object = None  # a group of all n ranks the library made (``commit``)
    # the nodes the momentum shards are laid out for (``ShardLayout``): N, or 1 where N changes
    # from step to step (``quorum_topology``)
    layout_nodes: int | None = None


def topology(group, ranks_per_node: int, timeout=None) -> Topology:
    """The nodes of the default process group, with cached groups (collective on first call).
    The groups' timeout is ``timeout`` or else the default group's (``collectives.new_group``)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("hierarchy needs an initialized default process group (torchrun)")
    check_world(group, ranks_per_node)
    n, L = dist.get_world_size(), ranks_per_node

    def make():
        N = n // L
        intra = [new_group(range(k * L, (k + 1) * L), timeout) for k in range(N)]
        # with N == 1 these are one-rank groups: the exchange then runs without a collective
        inter = [new_group(range(j, n, L), timeout) for j in range(L)]
        return intra, inter, new_group(range(n), timeout)

    intra, inter, whole = cached("hierarchy", None, make, n, L, as_timedelta(timeout))
    rank = dist.get_rank()
    node, local = divmod(rank, L)
    return Topology(n, L, n // L, node, local, intra[node], inter[local], whole)


def quorum_topology(inter, nodes: int, node: int) -> Topology:
    """The topology of a replica of L ranks on torchft's quorum (``elastic.py``): the replica is
    the node (its own job: the default group holds its L ranks), ``inter`` the quorum's group
    of this rank's position (``nodes`` replicas, this one ``node``-th). The last collective
    (``commit``) runs inside the replica; torchft's ``should_commit`` decides between replicas.
    The momentum shards are laid out as for one node, so they stay put when the quorum's size
    changes (the inter-node exchange pads a node shard to N sub-shards instead)."""
    L, local = dist.get_world_size(), dist.get_rank()
    return Topology(nodes * L, L, nodes, node, local, dist.group.WORLD, inter, dist.group.WORLD,
                    layout_nodes=1)


def commit(topo: Topology, mine: torch.Tensor, step, timeout=None):
    """The step's last collective: every rank's [flags, step] (``mine``), all-gathered over all
    n ranks once this rank has everything it needs to apply. A collective of some ranks (a node,
    an inter-node group) completes whatever happens outside it, so with one last, a node could
    apply step t while a rank of another node stalled before its last collective; this one
    completes on no rank unless every rank has reached it, so a rank that dies or stalls at any
    collective of the step leaves every rank unapplied. Returns the n headers [1, n, 2] and the
    bytes this rank sent (between nodes, for the most part)."""
    ranks = dist.get_world_size(topo.whole) if topo.layout_nodes == 1 else topo.n
    if ranks == 1:
        return mine.view(1, 1, HEADER_WORDS), 0
    out = torch.empty(ranks * HEADER_WORDS, dtype=torch.int32, device=mine.device)
    collective(COMMIT, step, all_gather, out, mine.contiguous(), topo.whole, timeout=timeout)
    return out.view(1, ranks, HEADER_WORDS), (ranks - 1) * HEADER_WORDS * WORD_BYTES


def check_tensors(params, grads) -> None:
    """``checks.check_tensors`` without the momentum (a hierarchical optimizer keeps shards)."""
    check_params(params)
    for i, (p, g) in enumerate(zip(params, grads)):
        if g is not None:
            check_tensor("grads", i, g, p, DTYPES)


# ----------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class ShardLayout:
    """Where this rank's shard lies in the block space of the step's tensors (numels)."""

    numels: tuple
    offsets: tuple  # block offset of each tensor
    total: int  # T blocks
    sub: int  # S1: blocks per inter-node sub-shard
    shard: int  # S = N * S1: blocks per node shard
    start: int  # first block of this rank's shard

    @classmethod
    def build(cls, numels, topo: Topology) -> ShardLayout:
        numels = tuple(numels)
        offsets, total = block_offsets(numels)
        nodes = topo.layout_nodes or topo.nodes
        sub = shard_blocks(total, nodes * topo.ranks_per_node)
        shard = nodes * sub
        return cls(numels, tuple(offsets), total, sub, shard, topo.local * shard)

    def piece(self, i: int) -> tuple[int, int, int]:
        """(lo, hi, at): elements lo..hi of tensor i are shard elements at..at + hi - lo."""
        base = BLOCK * (self.offsets[i] - self.start)  # tensor i's element 0, shard-relative
        lo = min(max(0, -base), self.numels[i])
        hi = max(min(self.numels[i], BLOCK * self.shard - base), lo)
        return lo, hi, base + lo

    def block_range(self, first: int, last: int) -> tuple[int, int]:
        """Shard-relative blocks of tensors first..last-1 (a param group), clipped to the shard."""
        if first >= last:
            return 0, 0
        begin = self.offsets[first]
        end = self.offsets[last - 1] + -(-self.numels[last - 1] // BLOCK)
        lo = min(max(begin - self.start, 0), self.shard)
        return lo, max(min(end - self.start, self.shard), lo)


# ----------------------------------------------------------------------------- momentum


class FullMomentum:
    """The functional API's momentum: full-size exp_avgs, of which only the shard is used."""

    def __init__(self, exp_avgs):
        self.exp_avgs = list(exp_avgs)

    def shard(self, layout: ShardLayout, device) -> torch.Tensor:
        self.layout = layout
        buf = torch.zeros(layout.shard * BLOCK, dtype=torch.float32, device=device)
        for i, m in enumerate(self.exp_avgs):
            lo, hi, at = layout.piece(i)
            if hi > lo:
                buf[at : at + hi - lo].copy_(m.reshape(-1)[lo:hi])
        self.buf = buf
        return buf

    def commit(self) -> None:
        for i, m in enumerate(self.exp_avgs):
            lo, hi, at = self.layout.piece(i)
            if hi <= lo:
                continue
            if m.is_contiguous():
                m.view(-1)[lo:hi].copy_(self.buf[at : at + hi - lo])
            else:
                flat = m.reshape(-1).clone()
                flat[lo:hi] = self.buf[at : at + hi - lo]
                m.copy_(flat.view_as(m))


class ShardedMomentum:
    """``DistributedLion``'s momentum: one flat fp32 buffer of the rank's shard, and per-param
    views of it in the optimizer state (which ``state_dict`` saves, and which resume restores).

    With ``overlap=True`` the shard is the concatenation of the rank's shards of every bucket
    (``shard_buckets``); a parameter lies in one bucket, so its elements on this rank are still
    one contiguous range ``exp_avg_range``."""

    def __init__(self):
        self.states = []  # optimizer state dicts, one per tensor of the step, in order
        self.layout = None
        self.buf = None

    def shard(self, layout: ShardLayout, device) -> torch.Tensor:
        return self.shard_buckets([layout], [self.states], device)[0]

    def shard_buckets(self, layouts, states, device) -> list[torch.Tensor]:
        """The momentum shard of each bucket (``layouts[b]``, its tensors' ``states[b]``), as
        views of one buffer; checks every loaded range before anything is used."""
        flat = [s for part in states for s in part]
        current = all(
            "exp_avg" in s and s["exp_avg"].untyped_storage().data_ptr() == self._ptr()
            for s in flat
        )
        key = tuple(layouts)
        starts = [0]
        for layout in layouts:
            starts.append(starts[-1] + layout.shard * BLOCK)
        if key != self.layout or not current:
            buf = torch.zeros(starts[-1], dtype=torch.float32, device=device)
            views = []
            for layout, part, base in zip(layouts, states, starts):
                for i, state in enumerate(part):
                    lo, hi, at = layout.piece(i)
                    if "exp_avg" in state:  # a loaded (or earlier) shard: same range
                        saved = tuple(state.get("exp_avg_range", ()))
                        if saved != (lo, hi):
                            raise ValueError(
                                f"momentum shard {saved} of a parameter does not match this "
                                f"rank's shard ({lo}, {hi}): resume with the same world size, "
                                "hierarchy, overlap and bucket_mb (the momentum shard layout "
                                "of hierarchy follows the buckets with overlap=True, the whole "
                                "model without)")
                    views.append((state, base + at, hi - lo, (lo, hi)))
            for state, at, size, rng in views:  # nothing written before every range checked
                if "exp_avg" in state:
                    buf[at : at + size].copy_(state["exp_avg"].reshape(-1))
                state["exp_avg"] = buf[at : at + size]
                state["exp_avg_range"] = rng
            self.layout, self.buf = key, buf
        return [self.buf[a:b] for a, b in itertools.pairwise(starts)]

    def _ptr(self):
        return None if self.buf is None else self.buf.untyped_storage().data_ptr()

    def commit(self) -> None:
        pass  # the state views share the buffer


# ----------------------------------------------------------------------------- the step


def _node_mean_grad(tensors, grads, layout: ShardLayout, topo: Topology, step, timeout,
                    device) -> tuple[torch.Tensor, int]:
    """Phase 1: the node-mean fp32 gradient of this rank's shard of ``layout`` (grads laid out
    in a zero-padded workspace, intra-node reduce-scatter of the sums, / L), and the intra-node
    bytes it sent."""
    L, S = topo.ranks_per_node, layout.shard
    work = torch.zeros(L * S * BLOCK, dtype=torch.float32, device=device)
    for g, off, t in zip(grads, layout.offsets, tensors):
        if g is not None and t.numel() > 0:
            work[BLOCK * off : BLOCK * off + t.numel()].view(t.shape).copy_(g)
    grad = torch.empty(S * BLOCK, dtype=torch.float32, device=device)
    if L == 1:
        return grad.copy_(work), 0
    scatter = reduce_scatter_into_tensor()
    collective(REDUCE_SCATTER, step, scatter, grad, work,
               op=dist.ReduceOp.SUM, group=topo.intra, timeout=timeout)
    return grad.div_(L), (L - 1) * S * BLOCK * _F32_BYTES


def run_hierarchical_step(segments, momentum, *, ranks_per_node, mode, votes, group, backend,
                          step, nonfinite, timeout=None, found_inf=None,
                          problem=None, topo=None, gate=None) -> StepStats:
    """One hierarchical step for validated segments (their ``exp_avgs`` are not used: the
    momentum comes from ``momentum``, a FullMomentum or ShardedMomentum).

    ``found_inf``: a GradScaler's local overflow flag (a one-element tensor, nonzero = overflow;
    ``optim/amp.py``) or None. It joins the shard's non-finite flag before the flags travel, so
    an overflow on any rank skips the step on every rank; under a scaler a non-finite step is
    skipped, never raised (the scaler backs off instead), whatever ``nonfinite`` says.

    Every collective goes through ``collectives.collective`` / ``wait``: a dead or stalled peer
    raises ``DistributedStepError`` naming the step and the collective, bounded by ``timeout``
    (None: the groups' own timeout). Nothing is written (parameters, momentum shard) before the
    step's last collective has returned, so a failed step leaves this rank as it was.

    ``problem``: an error this rank found in its own input (the gradients then count as None):
    it takes part in every collective up to the flags', which tell every rank (``ABORTED``), and
    every rank raises the same error (``pipeline.explain``). Settings that differ between ranks
    (``header.settings_word`` in the last collective) raise the same error everywhere too.

    ``topo`` and ``gate``: a replica on torchft's quorum (``quorum_topology``, ``elastic.Gate``):
    a collective between replicas that fails is reported to the gate and the replica goes on
    with the collectives inside it, flagged as given up (so none of its ranks waits for this
    one), and the gate's ``commit`` is asked before anything is applied."""
    topo = topo or topology(group, ranks_per_node, timeout)
    try:
        return _hierarchical_step(topo, segments, momentum, mode=mode, votes=votes,
                                  backend=backend, step=step, nonfinite=nonfinite,
                                  timeout=timeout, found_inf=found_inf, problem=problem,
                                  gate=gate)
    except DistributedStepError:
        if gate is None:
            retire(topo.intra, topo.inter, topo.whole)  # work may be pending: never reuse
        raise


def _hierarchical_step(topo, segments, momentum, *, mode, votes, backend, step, nonfinite,
                       timeout, found_inf, problem, gate=None) -> StepStats:
    L, N = topo.ranks_per_node, topo.nodes
    tensors = [p for s in segments for p in s.params]
    grads_all = [g for s in segments for g in s.grads]
    numel = sum(t.numel() for t in tensors)
    device = tensors[0].device if tensors else torch.device("cpu")
    check_group_device(dist.group.WORLD, topo.n, device)
    name = backends.resolve(backend, device)
    # The inter-node exchange: the two-phase protocol of pipeline.py on this rank's inter-node
    # group (N voters), one bucket = this rank's shard of S = N * S1 blocks.
    ex = Exchange(device=device, mode=mode, votes=votes, group=topo.inter, backend=name,
                  step=step, nonfinite=nonfinite, timeout=timeout)
    stages, ternary = ex.stages, ex.ternary
    layout = ShardLayout.build((t.numel() for t in tensors), topo)
    S = layout.shard
    intra = inter = 0

    def stats(skipped=False):
        return StepStats(
            bytes_sent=intra + inter, bytes_received=intra + inter, numel=numel,
            world_size=topo.n, mode=mode, votes=votes, backend=name, skipped=skipped,
            intra_node_bytes_sent=intra, nodes=N, ranks_per_node=L)

    # 1. node-mean gradient of this rank's shard, fp32 sums
    grad, sent = _node_mean_grad(tensors, grads_all, layout, topo, step, timeout, device)
    intra += sent

    # 2. one decision for all n ranks, before anything is modified: a non-finite value in any
    # gradient reaches the sum of exactly one shard (NaN and inf propagate through the fp32 sum;
    # an overflow counts too). Across nodes first, then inside the node with the step number.
    flag = stages.nonfinite([grad])
    if found_inf is not None:  # the scaler's check of this rank's own (unscaled) gradients
        flag = flag | (found_inf.reshape(-1)[:1] != 0).to(device=device, dtype=torch.int32)
    flag = (flag != 0).to(torch.int32) | (ABORTED if problem is not None else 0)
    failed = False  # a collective between replicas failed (elastic: reported to the gate)
    if N > 1:
        flags = torch.empty(N, dtype=torch.int32, device=device)
        try:
            collective(FLAGS, step, all_gather, flags, flag, topo.inter, timeout=timeout)
            flag = ((flags & NONFINITE).amax() | (flags & ABORTED).amax()).view(1)
        except DistributedStepError as e:
            if gate is None:
                raise
            gate.fail(e)
            failed, flag = True, flag | ABORTED  # the replica's other ranks learn it below
        inter += (N - 1) * WORD_BYTES
    headers = make_header(flag & NONFINITE, step)
    headers[0:1] |= flag & ABORTED
    if L > 1:
        mine, headers = headers, torch.empty(L * HEADER_WORDS, dtype=torch.int32, device=device)
        collective(HEADERS, step, all_gather, headers, mine, topo.intra, timeout=timeout)
        intra += (L - 1) * HEADER_WORDS * WORD_BYTES
    # a rank that gave up: every rank knows it now, and raises the same error
    explain(headers.view(1, -1, HEADER_WORDS), problem, None, [topo.whole], step, timeout)
    if decide(headers):  # raises StepMismatchError alike on every rank
        if nonfinite == "raise" and found_inf is None:
            raise NonFiniteGradientError(
                "a gradient holds inf or NaN on at least one rank (or a node's gradient sum "
                "overflowed); nothing was updated on any rank (pass nonfinite='skip' to skip "
                "such steps instead)"
            )
        return stats(skipped=True)

    # 3-4. local step on the shard (one row per param group: each has its own betas), votes
    # between nodes; the [flag, step] header of every all_to_all chunk checks the steps of the
    # other nodes.
    exp_avg = momentum.shard(layout, device)
    rows, first = [], 0
    for s in segments:
        lo, hi = layout.block_range(first, first + len(s.params))
        first += len(s.params)
        if hi > lo:
            part = slice(BLOCK * lo, BLOCK * hi)
            rows.append(Row(grad[part], grad[part], exp_avg[part], lo, s))
    bucket = BucketWork(rows, S, ex)
    try:
        bucket.start()
        bucket.advance()
        bucket.wait()
    except DistributedStepError as e:
        if gate is None:
            raise
        gate.fail(e)  # the node's collectives below go on, flagged: nothing will be applied
        failed = True
        bucket.aggregate = torch.zeros(N * bucket.shard * ex.p_out, dtype=torch.int32,
                                       device=device)
    inter += ex.sent
    if not failed:
        decide(bucket.header)  # the other nodes' steps (their flags were checked above)

    # 5. the node's aggregate shards side by side are the flat aggregate. Gathered before the
    # momentum is written: a peer dying in this last collective leaves nothing half-applied.
    owned = bucket.aggregate
    if L > 1:
        aggregate = torch.empty(L * owned.numel(), dtype=torch.int32, device=device)
        collective(NODE_GATHER, step, all_gather, aggregate, owned, topo.intra, timeout=timeout)
        intra += (L - 1) * owned.numel() * WORD_BYTES
    else:
        aggregate = owned
    if bucket.shard * N != S:  # a node shard padded to N sub-shards (``quorum_topology``)
        aggregate = aggregate.view(L, -1)[:, : S * ex.p_out].reshape(-1)

    # 6. over all n ranks, once every rank has its aggregate: the step applies everywhere or
    # nowhere (``commit``)
    zero = torch.zeros(1, dtype=torch.int32, device=device)
    headers, sent = commit(topo, make_header(zero, step, settings_word(
        ABORTED if failed else 0, segments)), step, timeout)
    inter += sent
    if gate is not None and not gate.commit():  # torchft: not on every replica, nothing here
        return stats(skipped=True)
    # ranks that set other lr, betas or weight_decay: the same error everywhere, nothing applied
    explain(headers, None, segments, [topo.whole], step, timeout)

    # the momentum shard, then every parameter (x only: the rank's momentum is its shard)
    update_momentum(rows)
    momentum.commit()
    offsets = iter(layout.offsets)
    apply_rows(stages, [Row(p, None, None, next(offsets), s) for s in segments for p in s.params],
               aggregate, N, mode, ternary, skip=None)
    return stats()


# ----------------------------------------------------------------------------- overlap


class _NodeBucket(BucketWork):
    """A bucket of the overlapped hierarchical step: phase 1 (node-mean gradient of this rank's
    shard) at ``start``, then pipeline's stages on the inter-node group (check and local step on
    the shard, all_to_all, tally, all_gather), then a third stage, the node gather of the N
    headers received and the aggregate shard. After it ``header`` holds all n ranks' headers
    (rank order) and ``aggregate`` the bucket's full aggregate; ``apply`` updates the momentum
    shard and every parameter of the bucket."""

    stages = 2

    def __init__(self, owner: OverlapStep, params, grads, segments, layout: ShardLayout,
                 exp_avg):
        super().__init__([], layout.shard, owner.ex)
        self.owner, self.params, self.grads, self.segments = owner, params, grads, segments
        self.layout, self.exp_avg = layout, exp_avg
        # every parameter of the bucket, applied without momentum (the shard has it)
        self.param_rows = [Row(p, None, None, off, seg)
                           for p, off, seg in zip(params, layout.offsets, segments)]
        self.numel = sum(p.numel() for p in params)
        self.both = None  # the node gather's output, read once it is complete

    def start(self) -> None:
        owner, ex, layout = self.owner, self.ex, self.layout
        # 1. node-mean gradient of this rank's shard of the bucket, fp32 sums (a synchronous
        # collective in the node: the local step needs it)
        grad, sent = _node_mean_grad(self.params, self.grads, layout, owner.topo, ex.step,
                                     ex.timeout, ex.device)
        owner.intra += sent
        # 2-4. non-finite flag (in the header), local step, inter-node all_to_all: one row per
        # run of tensors of one param group (each has its own beta1)
        first = 0
        while first < len(self.params):
            last = first + 1
            while last < len(self.params) and self.segments[last] is self.segments[first]:
                last += 1
            lo, hi = layout.block_range(first, last)
            if hi > lo:
                part = slice(BLOCK * lo, BLOCK * hi)
                self.rows.append(Row(grad[part], grad[part], self.exp_avg[part], lo,
                                     self.segments[first]))
            first = last
        super().start()

    def advance(self) -> None:
        if self.stage == 0:
            super().advance()  # tally and inter-node all_gather
            return
        self.wait()
        self.stage += 1
        # 5. node gather: the N headers received, then the aggregate shard
        L = self.owner.topo.ranks_per_node
        owned = torch.cat([self.header.reshape(-1), self.aggregate])
        self.both = owned
        if L > 1:
            self.both = torch.empty(L * owned.numel(), dtype=torch.int32, device=owned.device)
            self.work = collective(NODE_GATHER, self.ex.step, all_gather, self.both, owned,
                                   self.owner.topo.intra, async_op=True)
            self.name = NODE_GATHER
            self.node_owned = owned  # alive until the gather is done
            self.owner.intra += (L - 1) * owned.numel() * WORD_BYTES

    def wait(self) -> None:
        super().wait()
        if self.stage == 2 and self.both is not None:
            L, N = self.owner.topo.ranks_per_node, self.owner.topo.nodes
            both, words = self.both.view(L, -1), N * HEADER_WORDS
            # rank order: node k' local l is rank k' L + l
            headers = both[:, :words].reshape(L, N, HEADER_WORDS).transpose(0, 1)
            self.header = headers.reshape(L * N, HEADER_WORDS)
            self.aggregate = both[:, words:].reshape(-1)  # the bucket's flat aggregate
            self.both = None

    def apply(self, skip) -> None:
        ex = self.ex
        ex.streams.used_on_current([r.grad for r in self.rows])
        # the momentum shard (kept as it was when skipped), then every parameter, x only
        update_momentum(self.rows, skip)
        apply_rows(ex.stages, self.param_rows, self.aggregate, self.owner.topo.nodes, ex.mode,
                   ex.ternary, skip)


class OverlapStep:
    """One hierarchical step with ``overlap=True``: ``add`` runs a bucket's phase 1 and starts
    its inter-node exchange (called during backward, bucket by bucket, the same order on every
    rank); its tally, inter-node all_gather and node gather are issued when bucket k+1 starts
    (``Exchange``, lag one: ``pipeline.py``, Ordering), and waited for at ``finish``.
    ``finish`` (``Exchange.finish``) waits, takes one skip flag on the device from every rank's
    header of every bucket, and only then updates the momentum shards and applies (nothing at
    all when skipped).

    Per bucket b (its own block space, ``buckets.py``) the layout is ``ShardLayout`` of the
    bucket's tensors: S1_b = shard_blocks(T_b, n), S_b = N S1_b; local rank l owns the bucket's
    blocks [l S_b, (l+1) S_b). The header words: every inter-node all_to_all chunk carries the
    sender's [flag, step] (``pipeline.py``); the node gather puts the N headers a rank received
    in front of its aggregate shard, so every rank of every node sees all n headers."""

    def __init__(self, topo: Topology, *, device, mode, votes, backend, step, nonfinite,
                 streams=None, timeout=None, segments=None):
        self.topo = topo
        check_group_device(dist.group.WORLD, topo.n, torch.device(device))
        # lag one on the topology's groups, also on gloo: issuing each of a bucket's three
        # collectives once the one before was complete, on second groups, left most of them to
        # step() and measured slower (2x2 at 10 Gbit/s, 4 interleaved rounds: 673 against 633
        # ms per step)
        self.ex = Exchange(device=device, mode=mode, votes=votes, group=topo.inter,
                           backend=backend, step=step, nonfinite=nonfinite, streams=streams,
                           timeout=timeout, segments=segments)
        self.ex.explainer, self.ex.explain_groups = explain, [topo.whole]  # one error
        self.ex.made_groups += [topo.intra, topo.inter, topo.whole]  # retired on a failure
        self.step, self.mode, self.votes = int(step), mode, votes
        self.intra = self.committed = 0

    @property
    def works(self) -> list:
        return self.ex.works

    def add(self, params, grads, segments, layout: ShardLayout, exp_avg) -> None:
        """One bucket: ``params`` with ``grads`` (None = zero) and each one's ``Segment``, laid
        out by ``layout``; ``exp_avg`` is the rank's momentum shard of the bucket."""
        self.ex.add_work(_NodeBucket(self, params, grads, segments, layout, exp_avg), grads)

    def abandon(self) -> None:
        """Issue and wait for the rest of this step's collectives; apply nothing."""
        self.ex.abandon()

    def give_up(self, problem=None) -> None:
        """This rank gives the step up (an error of its own, ``problem``): every collective runs
        as in ``finish``, the commit tells the other ranks (``ABORTED``), nothing is applied;
        every rank raises the same error (``Exchange.explain``)."""
        self.ex.problem = problem
        self.ex.finish(agree=self._commit, abort=True)

    def _commit(self, headers, word) -> torch.Tensor:
        """``Exchange.finish``'s agree: this rank's own header (non-finite flag OR-ed over the
        buckets, and the exchange's last word: ``ABORTED`` when it gives the step up, the
        settings digest) through ``commit``, the step's last collective."""
        own = headers[:, self.topo.node * self.topo.ranks_per_node + self.topo.local, :]
        flags = (own[:, 0] & NONFINITE).amax().view(1) | word
        mine = torch.cat([flags, own[:1, 1]]).to(torch.int32)
        gathered, sent = commit(self.topo, mine, self.step, self.ex.timeout)
        self.committed += sent
        return gathered

    def finish(self) -> StepStats:
        """Waits, decides for all buckets and all n ranks at once, and applies;
        ``self.verdict`` holds the decision (read on the host here)."""
        ex = self.ex
        stats = ex.finish(agree=self._commit)  # raises a step mismatch / NonFinite...
        self.verdict = ex.verdict
        return StepStats(
            bytes_sent=self.intra + ex.sent + self.committed,
            bytes_received=self.intra + ex.sent + self.committed,
            numel=stats.numel, world_size=self.topo.n, mode=self.mode, votes=self.votes,
            backend=ex.backend, skipped=stats.skipped, buckets=stats.buckets,
            intra_node_bytes_sent=self.intra, nodes=self.topo.nodes,
            ranks_per_node=self.topo.ranks_per_node)
