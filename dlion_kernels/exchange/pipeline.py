"""The D-Lion exchange, bucket by bucket: two collectives per bucket, started as soon as the
bucket's gradients are final and finished at ``step()``.

Per bucket (its own block space, ``buckets.py``; n ranks, rank r owns shard r of the blocks):

    start:   check (non-finite flag) -> local step (packed votes, momentum read only)
             -> send buffer [n, HEADER + shard * P_in] (chunk j = header + votes of shard j)
             -> all_to_all_single (async)
    reduce:  wait for it -> tally the owned shard -> all_gather of the packed aggregate (async)
    finish:  wait for the gathers -> one skip decision for all buckets -> apply
             (params and momentum; nothing at all when skipped)

The header is the step header of ``header.py`` (two int32 words, ``[flags, step]``), copied
into every chunk of the all_to_all payload. So after the first collective every rank holds
every rank's flags and step for this bucket: all ranks take the same skip/raise decision, and
ranks on different steps raise ``StepMismatchError`` instead of mixing steps. There is no third
collective; the header costs 8 bytes per peer per bucket. Momentum is written only by
``apply`` (kernel stages v2), which takes the skip flag as a device tensor, so a non-finite
gradient on any rank leaves every parameter and momentum of every rank unchanged even though the
votes of earlier buckets were exchanged during backward.

Ordering. gloo and NCCL pair a group's collectives by the order in which each rank issues
them, so every group must see its collectives in the same order on every rank. Every exchange
issues its buckets' stages as one fixed sequence on its one group, lag one: a2a(0), a2a(1),
gather(0), a2a(2), gather(1), ... (bucket k's tally and gather are issued when bucket k+1
starts, after waiting for bucket k's all_to_all), on every backend and for every caller: the
overlapped step of ``DistributedLion``, the DDP comm hook, hierarchy's buckets
(``hierarchy.OverlapStep``). On CUDA nothing waits on the host there (below), and the one fixed
order on one communicator is what NCCL asks of concurrent collectives. On gloo that wait is a
host wait inside the autograd hook that starts bucket k+1; a second gloo group for the gathers,
issued as soon as each all_to_all was complete, removed those waits but measured no faster
(docs/overlap.md), so the exchange makes none.

``finish`` issues what is left, in the same order, waiting where it must.

Streams (CUDA; on CPU every call below is a no-op and the same code runs):
- ``start`` runs where the gradient was produced (the autograd thread, its current stream S).
  It records an event on S and makes the side stream C wait on it (``C.wait_event``; the host
  does not wait). The check, the local step, the header copy and the all_to_all are issued on C,
  so NCCL's stream follows C, and backward goes on on S.
- ``advance`` runs on C too: ``work.wait()`` makes C (not the host) wait for NCCL; the tally and
  the all_gather follow on C. The tally is on the communication side.
- ``finish`` makes the caller's stream wait for C (``wait_stream``, an event) and applies there.
  Buffers cross streams with ``record_stream`` so the caching allocator does not reuse them
  early. The skip flag stays on the device for ``apply``; the host reads the header words once
  per step, at the end, to raise (``nonfinite="raise"``, a step mismatch) and to know whether
  the step counter advances. ``finish(defer=True)`` (what ``DistributedLion`` uses on CUDA when
  nothing must raise in this step: ``nonfinite="skip"`` or a GradScaler) does not read them: it
  queues a copy into pinned host memory behind an event and leaves the ``Verdict`` to be read
  later (at the next step, when the GPU is long past this one), so the step makes no
  device-to-host synchronisation at all.

CUDA graphs (one rank). A deferred step can be captured in a CUDA graph and replayed: the
exchange then takes the step counter as a device tensor (``StepCounter``), which the header's
step word and the tie rule read on the device and ``finish`` advances there (by one, unless the
step is skipped), so every replay is the next step. The decision of a captured step keeps the
device headers (the last replay's, when read) instead of copying them to the host. The launch
tables of the step's tensors must exist before capture: a step run once outside capture with
the same tensors builds them (``kernels/tables.py``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..kernels import backends
from ..kernels.layout import WORD_BYTES, aggregate_planes, shard_blocks, vote_planes
from .checks import DTYPES, check_tensor
from .collectives import DistributedStepError, collective, gather_into_tensor, rebuilt_error
from .collectives import wait as wait_work
from .groups import retire
from .header import (
    HEADER_WORDS,
    NONFINITE,
    decide,
    make_header,
    settings_differ,
    settings_word,
)


def capturing(device) -> bool:
    """Whether the current CUDA stream of ``device`` is being captured in a CUDA graph."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class StepCounter:
    """The step counter of one optimizer on its parameters' device (``value``, int64 [1]), for
    steps that a CUDA graph may capture: the header and the tie rule read it on the device, and
    each step advances it there (``Exchange.finish``: by one, unless skipped). The host's count
    stays the authority while no step has been captured; once one was, graphs may have advanced
    the device's, so the host takes it from there (``read``, outside capture)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.value = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.captured = False  # a step was captured: the device's count is the authority

    def start(self, step: int) -> int:
        """At a step's start, with the host's ``step``: the step this one is. Outside capture
        the device takes the host's count (a fill kernel, nothing read back) until a capture,
        and gives its own afterwards (one read); during capture the graph reads the device's
        count at every replay, so nothing is written."""
        if capturing(self.device):
            self.captured = True
            return step
        if self.captured:
            return self.read()
        self.value.fill_(step)
        return step

    def read(self) -> int:
        """The device's count (a host sync on CUDA; never during capture)."""
        return int(self.value.item())

    def reset(self, step: int) -> None:
        """Set the count (a loaded state); replays of a captured step go on from it."""
        self.value.fill_(step)

# Names of the two collectives in errors (DistributedStepError) and in the fault tests
A2A, GATHER = "all_to_all_single(votes)", "all_gather(aggregate)"
# An overlapped step's last collective: one word per rank, after step() has read the settings
VERDICT = "all_gather(verdict)"
# A second flag bit of the step header (``header.py``'s word 0, beside ``NONFINITE``): this rank
# gave up the step after an error of its own (bad input found after buckets were sent, a second
# backward). Every rank then skips the step; the others raise ``StepAbortedError``.
ABORTED = 2


class NonFiniteGradientError(FloatingPointError):
    """A gradient held inf or NaN on some rank; no rank changed anything."""


class StepAbortedError(RuntimeError):
    """Another rank gave up this step after an error of its own (it raised that error); no rank
    changed anything, and the process group stays usable. ``step`` and ``ranks`` (the ranks of
    the exchange's group that gave up) say which."""

    def __init__(self, step, ranks):
        self.step, self.ranks = step, list(ranks)
        super().__init__(
            f"D-Lion step {step}: rank(s) {self.ranks} of the exchange's group gave up the step "
            "after an error of their own (see their error); nothing was updated on any rank. "
            "The process group is still usable: fix the cause there and step again")

    def __reduce__(self):
        return rebuilt_error, (type(self), self.args, self.__dict__)


@dataclass(frozen=True)
class StepStats:
    """What one step did on this rank. Bytes are what this rank's collectives sent/received.

    The fields after ``buckets`` say more where a step has more to say, and keep their defaults
    elsewhere:

    - where the bytes went, when the voters are nodes or replicas of several ranks (hierarchy,
      FSDP2, a replica of several ranks on torchft): ``intra_node_bytes_sent`` is the part that
      stayed inside a node (a node's reduce-scatter and gathers, FSDP2's header gather, a
      replica's own agreement), ``inter_node_bytes_sent`` the rest; ``nodes`` and
      ``ranks_per_node`` (hierarchy: N voters of L ranks; ``world_size`` is then all n ranks),
      ``shards`` (FSDP2: the L ranks a replica is sharded over; ``numel`` counts this rank's
      local elements and ``world_size`` is the N replicas voting on them);
    - a step on torchft's quorum (``manager=``): ``participants`` (the replicas of this step,
      also ``world_size``), ``committed`` (what ``should_commit`` said; False: nothing was
      applied here, and ``skipped`` is True) and ``manager_step`` (the manager's step count
      after it). None without a manager.
    """

    bytes_sent: int
    bytes_received: int
    numel: int
    world_size: int
    mode: str | None
    votes: str | None
    backend: str | None
    skipped: bool = False
    buckets: int = 1
    intra_node_bytes_sent: int = 0
    nodes: int | None = None
    ranks_per_node: int = 1
    shards: int = 1
    participants: int | None = None
    committed: bool | None = None
    manager_step: int | None = None

    @property
    def inter_node_bytes_sent(self) -> int:
        """What went between nodes or replicas: all of ``bytes_sent`` on one flat group."""
        return self.bytes_sent - self.intra_node_bytes_sent

    @property
    def allreduce_fp32_bytes(self) -> int:
        """Bytes a ring all-reduce of fp32 gradients would send per rank: 2 (n-1)/n * 4d."""
        from ..accounting import ring_all_reduce_bytes

        return round(ring_all_reduce_bytes(self.world_size, 4 * self.numel))


@dataclass
class Segment:
    """Tensors that share hyper-parameters (a param group)."""

    params: list
    grads: list
    exp_avgs: list
    lr: float
    beta1: float
    beta2: float
    weight_decay: float


@dataclass
class Row:
    """One tensor of a bucket: contiguous param/grad/momentum, its block offset in the bucket,
    and the segment whose hyper-parameters apply to it. ``exp_avg`` None: a parameter applied
    without momentum (``apply_rows``)."""

    param: torch.Tensor
    grad: torch.Tensor | None
    exp_avg: torch.Tensor | None
    offset: int
    segment: Segment


# ----------------------------------------------------------------------------- helpers


def all_gather(output, input, group, async_op=False):
    """all_gather_into_tensor, under the name torch uses from 2.13 on (all_gather_single)."""
    gather = gather_into_tensor()
    return gather(output, input, group=group, async_op=async_op)


def resolve_group(group):
    if group is not None:
        return group, dist.get_world_size(group)
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD, dist.get_world_size()
    return None, 1


def check_group_device(group, n: int, device: torch.device) -> None:
    if n == 1:
        return
    # a group object that names its backend itself (elastic.py's view of torchft's group)
    name = str(getattr(group, "backend_name", None) or dist.get_backend(group)).lower()
    if device.type == "cpu" and name == "nccl":
        raise ValueError("CPU tensors need a gloo process group; this group uses NCCL")
    if device.type == "cuda" and "nccl" not in name:
        raise ValueError(f"CUDA tensors need an NCCL process group; this group uses {name}")


def by_dtype(items):
    """Group (tensor-or-None, ...) tuples by the dtype of their first tensor, keeping order."""
    groups: dict = {}
    for item in items:
        key = item[0].dtype if item[0] is not None else None
        groups.setdefault(key, []).append(item)
    if None in groups and len(groups) > 1:  # None gradients ride along with any launch
        first = next(k for k in groups if k is not None)
        groups[first] += groups.pop(None)
    return list(groups.values())


class Streams:
    """The side stream of the module docstring; every method is a no-op off CUDA."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.side = torch.cuda.Stream(device) if self.cuda else None
        self.device = device

    def side_waits_current(self) -> None:
        if self.cuda:
            self.side.wait_event(torch.cuda.current_stream(self.device).record_event())

    def on_side(self):
        return torch.cuda.stream(self.side) if self.cuda else contextlib.nullcontext()

    def current_waits_side(self) -> None:
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.side)

    def used_on_side(self, tensors) -> None:
        if self.cuda:
            for t in tensors:
                if t is not None:
                    t.record_stream(self.side)

    def used_on_current(self, tensors) -> None:
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            for t in tensors:
                t.record_stream(current)


# ----------------------------------------------------------------------------- one bucket


class BucketWork:
    """One bucket of one step: its buffers and the collective in flight.

    ``start`` issues the all_to_all (after the check and the local step); each ``advance`` waits
    for the collective in flight and issues the next stage (here one: the tally and the
    all_gather; hierarchy's node gather adds one), ``wait`` waits for the last one. ``stage``
    counts the stages issued after ``start``."""

    stages = 1

    def __init__(self, rows, blocks, ex: Exchange):
        self.rows, self.blocks, self.ex = rows, blocks, ex
        self.numel = sum(r.param.numel() for r in rows)
        self.shard = shard_blocks(blocks, ex.n)
        self.stage = 0
        self.work = self.name = None  # the collective in flight and its name

    def more(self) -> bool:
        """Whether a stage is left to issue."""
        return self.stage < self.stages

    def wait(self) -> None:
        """Wait for the collective in flight (CUDA: the side stream waits, not the host, unless
        a timeout is given)."""
        if self.work is not None:
            wait_work(self.work, self.ex.step, self.name, self.ex.timeout)
            self.work = None

    def advance(self) -> None:
        """Wait for the collective in flight and issue the next stage."""
        self.wait()
        self.stage += 1
        self.reduce()

    def start(self) -> None:
        ex, n, shard = self.ex, self.ex.n, self.shard
        rows = [r for r in self.rows if r.param.numel() > 0]  # empty tensors own no block
        device = ex.device
        flag = None
        if ex.found_inf is None:
            for part in by_dtype([(r.grad,) for r in rows if r.grad is not None]):
                found = ex.stages.nonfinite([g for (g,) in part])
                flag = found if flag is None else flag | found
        elif not ex.works:  # the caller's check covers every gradient: flag it once
            flag = (ex.found_inf.reshape(-1)[:1] != 0).to(device=device, dtype=torch.int32)
        if flag is None:
            flag = torch.zeros(1, dtype=torch.int32, device=device)
        votes = torch.zeros(n * shard * ex.p_in, dtype=torch.int32, device=device)
        for seg_rows in _by_segment(rows):
            beta1 = seg_rows[0].segment.beta1
            for part in by_dtype([(r.grad, r.exp_avg, r.offset) for r in seg_rows]):
                g, m, off = zip(*part)
                ex.stages.local_step(list(g), list(m), votes, list(off), beta1, ex.ternary)
        header = make_header(flag, ex.step, settings_word(0, ex.segments), ex.counter)
        if ex.aborted:
            header[0:1] |= ABORTED
        if n == 1:
            # nothing to send: the tally reads the votes where the local step wrote them (a
            # step of one rank launches as few kernels as it can: CUDA graphs replay each one)
            self.header, self.stacked = header.view(1, HEADER_WORDS), votes.view(1, -1)
            return
        width = HEADER_WORDS + shard * ex.p_in
        self.send = torch.empty(n, width, dtype=torch.int32, device=device)
        self.send[:, :HEADER_WORDS] = header
        self.send[:, HEADER_WORDS:] = votes.view(n, -1)
        self.received = torch.empty_like(self.send)
        self.work = collective(A2A, ex.step, dist.all_to_all_single, self.received.view(-1),
                               self.send.view(-1), group=ex.group, async_op=True)
        self.name = A2A
        ex.sent += (n - 1) * width * WORD_BYTES

    def reduce(self) -> None:
        """Stage 1, once the all_to_all is complete: tally the owned shard, gather the
        aggregate."""
        ex, n = self.ex, self.ex.n
        if n == 1:  # the header and the votes as ``start`` left them
            self.aggregate = torch.empty(self.shard * ex.p_out, dtype=torch.int32,
                                         device=ex.device)
            ex.stages.tally(self.stacked, self.aggregate, 1, ex.mode, ex.ternary, ex.tally_step)
            return
        self.header = self.received[:, :HEADER_WORDS]
        stacked = self.received[:, HEADER_WORDS:].contiguous()
        owned = torch.empty(self.shard * ex.p_out, dtype=torch.int32, device=ex.device)
        ex.stages.tally(stacked, owned, n, ex.mode, ex.ternary, ex.tally_step)
        self.aggregate = torch.empty(n * self.shard * ex.p_out, dtype=torch.int32,
                                     device=ex.device)
        self.work = collective(GATHER, ex.step, all_gather, self.aggregate, owned,
                               ex.group, async_op=True)
        self.name = GATHER
        self.owned = owned  # alive until the gather is done
        ex.sent += (n - 1) * self.shard * ex.p_out * WORD_BYTES

    def apply(self, skip) -> None:
        ex = self.ex
        apply_rows(ex.stages, self.rows, self.aggregate, ex.n, ex.mode, ex.ternary, skip)


def apply_rows(stages, rows, aggregate, n, mode, ternary, skip) -> None:
    """The protocol's apply, for ``rows`` laid out in ``aggregate``'s block space: x = x - lr
    (D + wd x) for each row's parameter and, for rows with a momentum, m = b2 m + (1 - b2) g in
    the same launch (rows with ``exp_avg`` None: x only, as hierarchy's, whose momentum is a
    shard: ``update_momentum``); nothing at all when ``skip`` (int32 [1] on the device) is set.
    One launch per param group and (parameter dtype, gradient dtype); None gradients ride along;
    a non-contiguous parameter is worked on through a copy written back."""
    rows = [r for r in rows if r.param.numel() > 0]  # empty tensors own no block
    for seg_rows in _by_segment(rows):
        s = seg_rows[0].segment
        for part in by_dtype([(r.param, r.grad, r.exp_avg, r.offset) for r in seg_rows]):
            for sub in by_dtype([(g, p, m, off) for p, g, m, off in part]):
                g, p, m, off = zip(*sub)
                work = [x if x.is_contiguous() else x.contiguous() for x in p]
                momentum = None if m[0] is None else list(m)
                stages.apply(work, list(g), momentum, aggregate, list(off), s.lr,
                             s.weight_decay, s.beta2, n, mode, ternary, skip=skip)
                for x, w in zip(p, work):
                    if w is not x:
                        x.copy_(w)


def update_momentum(rows, skip=None) -> None:
    """m = b2 m + (1 - b2) g in fp32 for ``rows`` whose momentum the apply does not update
    (``exp_avg`` of a row other than its parameter's own: hierarchy's shards); kept as it was
    where ``skip`` (device flag) is set."""
    for r in rows:
        device = r.exp_avg.device
        b2 = torch.full((), r.segment.beta2, dtype=torch.float32, device=device)
        omb2 = torch.full((), 1.0 - r.segment.beta2, dtype=torch.float32, device=device)
        new = b2 * r.exp_avg + omb2 * r.grad
        r.exp_avg.copy_(new if skip is None else torch.where(skip != 0, r.exp_avg, new))


def _by_segment(rows):
    """Consecutive rows grouped by segment (rows of one segment share hyper-parameters)."""
    groups: dict = {}
    for r in rows:
        groups.setdefault(id(r.segment), []).append(r)
    return list(groups.values())


# ----------------------------------------------------------------------------- one step


class Verdict:
    """What the gathered headers of one step decide, read on the host now or later.

    ``skip`` is the device flag the applies obeyed (None: no bucket). With ``defer`` on CUDA
    the headers travel to pinned host memory behind an event, and ``resolve()`` waits only for
    that event; otherwise they are read at once. ``resolve()`` raises ``StepMismatchError`` (the
    same on every rank) and, when ``nonfinite="raise"`` without a GradScaler, the
    ``NonFiniteGradientError``; it returns whether the step was skipped."""

    def __init__(self, headers, skip, nonfinite: str, scaled: bool, defer: bool, step=None):
        self.skip, self.nonfinite, self.scaled = skip, nonfinite, scaled
        self.step = step
        self.event = None
        if defer and capturing(headers.device):
            # captured: no copy or event in the graph; the device headers (rewritten by every
            # replay, kept alive by the graph's memory pool) are read when resolved
            self.headers = headers
        elif defer and headers.is_cuda:
            self.headers = torch.empty(headers.shape, dtype=headers.dtype, pin_memory=True)
            self.headers.copy_(headers, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.headers = headers if defer else headers.cpu()

    def resolve(self) -> bool:
        if self.event is not None:
            self.event.synchronize()
        words = self.headers.cpu().view(-1, self.headers.shape[-2], HEADER_WORDS)
        gave_up = sorted({r for b in words.tolist() for r, h in enumerate(b) if h[0] & ABORTED})
        if gave_up:
            raise StepAbortedError(self.step, gave_up)
        skipped = False
        for bucket_headers in words:  # raises StepMismatchError alike on every rank
            skipped |= decide(bucket_headers, self.step)
        if skipped and self.nonfinite == "raise" and not self.scaled:
            raise NonFiniteGradientError(
                "a gradient holds inf or NaN on at least one rank; nothing was updated on any "
                "rank (pass nonfinite='skip' to skip such steps instead)")
        return skipped



class Exchange:
    """The exchanges of one step, bucket by bucket.

    ``add(rows, blocks)`` starts a bucket and issues the stages left of the earlier ones (lag
    one, on ``group``: module docstring, Ordering); ``finish()`` issues what is left, waits, decides
    skip/raise for all buckets at once, applies and returns the step's ``StepStats``.
    ``timeout`` (seconds, a timedelta or None: the group's own) bounds each wait for a
    collective. Rows' segments are read at ``add`` for beta1 and at ``finish`` for lr, beta2
    and weight_decay (so an LR scheduler between backward and step takes effect).
    """

    def __init__(self, *, device, mode, votes, group, backend, step, nonfinite,
                 found_inf=None, streams: Streams | None = None, timeout=None,
                 segments=None, late: bool = False, counter=None):
        self.group, self.n = resolve_group(group)
        self.timeout = timeout
        self.device = torch.device(device)
        check_group_device(self.group, self.n, self.device)
        if capturing(self.device):
            if self.n > 1:
                raise ValueError("a D-Lion step is captured in a CUDA graph on one rank only "
                                 f"(world size 1); this exchange's group has {self.n} ranks")
            if nonfinite == "raise" and found_inf is None:
                raise ValueError("a D-Lion step captured in a CUDA graph reads nothing on the "
                                 "host, so it cannot raise on a non-finite gradient: pass "
                                 "nonfinite='skip' (the step is then skipped on the device)")
            if counter is None:
                raise ValueError("a D-Lion step captured in a CUDA graph needs its step counter "
                                 "on the device (an int64 tensor of one element): a step number "
                                 "given as an int would be the same at every replay")
        self.backend = backends.resolve(backend, self.device)
        self.stages = backends.get(self.backend)  # kernel stages v2 (docs/backends.md)
        self.mode, self.votes, self.nonfinite = mode, votes, nonfinite
        self.ternary = votes == "ternary"
        self.p_in, self.p_out = vote_planes(votes), aggregate_planes(mode, votes, self.n)
        self.step = None if step is None else int(step)  # None: only the counter knows it
        # the step counter on the device (int64 [1], ``StepCounter.value``): read by the header
        # and the tally, advanced by ``finish``; None: ``step`` is the counter
        self.counter = counter
        self.found_inf = found_inf  # GradScaler's overflow check replaces the scan (header.py)
        self.streams = streams if streams is not None else Streams(self.device)
        self.works: list[BucketWork] = []
        self.sent = 0
        self.write_back: list = []
        self.aborted = False  # this rank gave up the step: its later headers say ABORTED
        self.problem = None  # what made this rank give the step up (its own error)
        # every param group's settings (``header.settings_word``): in every header, as they
        # are when the bucket starts, and again at finish
        self.segments = segments
        # buckets started before step() (overlap, the DDP hook): the settings may change
        # between them and step(), so finish gathers one more word per rank (``VERDICT``)
        self.late = late
        # how and where the ranks explain a step given up or set apart: ``agree.explain_step``
        # over these groups (default: the exchange's group), set by the optimizer
        self.explainer, self.explain_groups = None, None
        # groups the library made that this step's collectives use: retired when one fails
        self.made_groups: list = []
        self.committed = None  # finish(commit=...)'s answer

    @property
    def tally_step(self):
        """The tie rule's step: the counter tensor (read on the device) or the int."""
        return self.counter if self.counter is not None else self.step

    @contextlib.contextmanager
    def _retiring(self):
        """A failed or timed-out collective may leave work pending on the library's groups (here
        or on a peer): retire them, so that no later exchange pairs with the stale work."""
        try:
            yield
        except DistributedStepError:
            retire(*self.made_groups)
            raise

    def row(self, param, grad, exp_avg, offset: int, segment: Segment) -> Row:
        """A bucket row; non-contiguous params/momenta are worked on through copies written
        back at finish, non-contiguous gradients through copies."""
        return Row(self._contiguous(param), None if grad is None else grad.contiguous(),
                   self._contiguous(exp_avg), offset, segment)

    def _contiguous(self, t):
        if t.is_contiguous():
            return t
        c = t.contiguous()
        self.write_back.append((t, c))
        return c

    def check_rows(self) -> None:
        """The gradients that the apply reads again (the momentum update) still fit their
        parameters: a gradient replaced on this rank between backward and ``step()`` raises
        ValueError/TypeError here, before the step's last collective (the caller gives the step
        up, so every rank learns it)."""
        for w in self.works:
            for i, r in enumerate(w.rows):
                if r.grad is not None:
                    check_tensor("grads", i, r.grad, r.param, DTYPES)

    def add(self, rows: list[Row], blocks: int) -> None:
        self.add_work(BucketWork(rows, blocks, self), [r.grad for r in rows])

    def add_aborted(self, blocks: int) -> None:
        """A bucket of ``blocks`` blocks that this rank cannot take part in (its input was found
        bad): sent with no votes and the ``ABORTED`` flag, so that every rank's collectives keep
        their sizes and order and every rank skips the step."""
        self.aborted = True
        self.add_work(BucketWork([], blocks, self), [])

    def add_work(self, work: BucketWork, inputs) -> None:
        """Start ``work`` (``inputs``: the tensors it reads that the caller's stream made), then
        move the earlier buckets on, lag one."""
        self.streams.side_waits_current()
        self.streams.used_on_side(inputs)
        with self._retiring(), self.streams.on_side():
            work.start()
            self.works.append(work)
            self._progress(len(self.works) - 1)

    def _progress(self, upto: int) -> None:
        """Issue the next stages of buckets ``[0, upto)``, one stage per bucket per pass, in
        bucket order, waiting for each collective in flight: a bucket never issues a stage that
        the bucket ahead of it has not issued, so every group sees its collectives in bucket
        order."""
        moved = True
        while moved:
            moved, ahead = False, None  # ahead: stages issued by the bucket ahead (None: all)
            for w in self.works[:upto]:
                if w.more() and (ahead is None or w.stage < ahead):
                    w.advance()
                    moved = True
                ahead = w.stage if w.more() else None

    def abandon(self) -> None:
        """Issue and wait for the rest of this step's collectives (so every rank's sequence
        stays matched) and apply nothing."""
        with self._retiring(), self.streams.on_side():
            self._progress(len(self.works))
            for w in self.works:
                w.wait()

    def finish(self, defer: bool = False, agree=None, abort: bool = False,
               commit=None) -> StepStats:
        """The step's end; ``self.verdict`` holds its decision. ``defer``: do not read it on the
        host (``Verdict``); the returned stats then say ``skipped=False`` until the caller
        resolves ``self.verdict``. ``agree``: None, or a function of the received headers
        [buckets, n, 2] and this rank's last word (an int32 [1] tensor: ``ABORTED`` when it
        gives the step up, and the settings digest as they are now) returning the headers to
        decide from, [buckets', n', 2] (gathered from ranks outside this group that must take
        the same decision: ``sharded.py``, ``hierarchy.py``). Without it, an exchange whose
        buckets started before ``step()`` (``late``) gathers that word over its group: the
        step's last collective, after the last thing a rank can find wrong. ``abort``: this
        rank gives up the step (an error of its own, ``self.problem``): every collective runs
        as in a normal finish (so every rank's sequence stays matched and the others learn
        it), and nothing is applied anywhere. ``commit``: None, or a function asked once every
        collective of the step has returned and before anything is applied (torchft's
        ``should_commit``, ``elastic.py``): False applies nothing on this rank and raises
        nothing (the step is reported skipped; ``self.committed`` keeps the answer).

        One decision: a rank that gave the step up, or ranks whose settings differ, make every
        rank raise the same error (``explain``), read on the host here unless deferred."""
        self.aborted |= abort
        with self._retiring(), self.streams.on_side():
            self._progress(len(self.works))
            for w in self.works:
                w.wait()
            if self.works:
                # [buckets, n, 2] (one bucket: a view, no copy)
                headers = (self.works[0].header.unsqueeze(0) if len(self.works) == 1 else
                           torch.stack([w.header for w in self.works]))
                if agree is not None or (self.late and self.n > 1):
                    # torch.full: a fill kernel (torch.tensor would copy from pageable host
                    # memory, a host sync on CUDA)
                    word = torch.full((1,), settings_word(ABORTED if self.aborted else 0,
                                                          self.segments),
                                      dtype=torch.int32, device=self.device)
                    if agree is not None:
                        headers = agree(headers, word)
                    else:
                        headers = torch.cat([headers, self._verdict_row(word, headers)])
            else:
                headers = torch.zeros(0, self.n, HEADER_WORDS, dtype=torch.int32,
                                      device=self.device)
            # One device flag for all buckets: any rank's non-finite gradient, a rank that gave
            # up, a rank at another step or with other settings skips every apply of every rank.
            # (Headers of one rank: its own flags alone can differ from nothing.)
            skip = None
            if self.works:
                skip = (headers[..., 0] & (NONFINITE | ABORTED)).amax()
                if headers.shape[-2] > 1:
                    skip = (skip | (headers[..., 1] != headers[0, 0, 1]).any()
                            | settings_differ(headers[..., 0]))
                skip = skip.view(1)
            if skip is not None and self.aborted:
                skip = torch.ones_like(skip)
        if commit is not None:
            self.committed = bool(commit())
            if not self.committed:  # nothing applied here, nothing raised: the step is dropped
                return StepStats(self.sent, self.sent, sum(w.numel for w in self.works), self.n,
                                 self.mode, self.votes, self.backend, skipped=True,
                                 buckets=len(self.works))
        if self.works and not defer:
            self.explain(headers)  # raises the same error on every rank, before any apply
        self.streams.current_waits_side()
        if self.counter is not None:  # the next step's count, on the device
            self.counter.add_(1 if skip is None else skip == 0)
        self.streams.used_on_current([w.aggregate for w in self.works] + [headers])
        for w in self.works:
            w.apply(skip)
        # the one host read per step, after the applies are issued (none when deferred)
        self.verdict = Verdict(headers, skip, self.nonfinite, self.found_inf is not None, defer,
                               self.step)
        if self.aborted:
            return StepStats(self.sent, self.sent, sum(w.numel for w in self.works), self.n,
                             self.mode, self.votes, self.backend, skipped=True,
                             buckets=len(self.works))
        skipped = False if defer else self.verdict.resolve()
        for original, copy in self.write_back:
            original.copy_(copy)
        numel = sum(w.numel for w in self.works)
        return StepStats(self.sent, self.sent, numel, self.n, self.mode, self.votes,
                         self.backend, skipped=skipped, buckets=len(self.works))

    def _verdict_row(self, word, headers) -> torch.Tensor:
        """Every rank's last ``word`` (``VERDICT``), as one more row of headers [1, n, 2]."""
        words = torch.empty(self.n, dtype=torch.int32, device=self.device)
        collective(VERDICT, self.step, all_gather, words, word, self.group,
                   timeout=self.timeout)
        self.sent += (self.n - 1) * WORD_BYTES
        return torch.stack([words, headers[0, :, 1]], dim=-1).view(1, self.n, HEADER_WORDS)

    def explain(self, headers) -> None:
        """``self.explainer`` (``agree.explain_step``) with this exchange's problem, settings,
        groups, step and timeout. Without one (the functional API, DiLoCo), nothing here: the
        verdict raises from the headers alone (``Verdict.resolve``)."""
        if self.explainer is not None:
            self.explainer(headers, self.problem, self.segments,
                           self.explain_groups or [self.group], self.step, self.timeout)


def run_buckets(segments, buckets, *, mode, votes, group, backend, step, nonfinite,
                found_inf=None, streams=None, counter=None) -> StepStats:
    """One step of already-validated ``segments`` exchanged as ``buckets``: a list of
    ``(blocks, [(segment index, tensor index, block offset), ...])``. ``counter``: the step
    counter on the device (``Exchange``); inside CUDA graph capture the decision is not read on
    the host (the returned stats say ``skipped=False``; the counter did not advance if it was)."""
    tensors = [t for s in segments for t in s.params]
    device = tensors[0].device if tensors else torch.device("cpu")
    ex = Exchange(device=device, mode=mode, votes=votes, group=group, backend=backend, step=step,
                  nonfinite=nonfinite, found_inf=found_inf, streams=streams, segments=segments,
                  counter=counter)
    for blocks, entries in buckets:
        rows = []
        for s, i, off in entries:
            seg = segments[s]
            rows.append(ex.row(seg.params[i], seg.grads[i], seg.exp_avgs[i], off, seg))
        ex.add(rows, blocks)
    return ex.finish(defer=capturing(device))
