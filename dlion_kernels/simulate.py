"""k workers of a data-parallel job simulated in one process, on the library's own kernel stages:
per-step Distributed Lion, DiLoCo's outer steps, and the fp32 all-reduce the baselines use.

Why: the quality of a 1-bit vote depends on the number of voters, and a job of 64 or 1000
replicas is costly to start just to see the loss. Here every worker is a slice of a tensor: its
gradient (or its local parameters), its momentum and its residual are its own, the parameters
(theta_bar for DiLoCo) are shared, and each step runs the same arithmetic as the multi-process
job, in the same order, so the result is bit-identical to it on gloo
(``python_tests/test_simulate.py`` checks that at k = 2, 3 and 4 for every step below):

- ``SimulatedDLion``: ``DistributedLion``'s step. Each worker's local step
  packs its votes into row w of a [k, blocks x planes] buffer (the backend's ``local_step``, one
  launch for all workers), the backend's ``tally`` counts the k rows at once (the multi-process
  exchange tallies the same rows shard by shard: the tally is per element, so the words are the
  same), and ``apply`` updates the shared parameters with worker 0's momentum, then each other
  worker's momentum (applied to a scratch copy of the parameters, which is dropped: the apply
  kernel is the one place the momentum update is written, so every backend keeps its own
  rounding). The binary tie rule's step is the step counter from 0, as the optimizer's.
- ``SimulatedDiLoCo``: ``DiLoCo``'s sync with ``outer`` "dlion" (plain, or with
  error feedback, its decay, a per-tensor scale, a ternary threshold), "nesterov" or
  "sparseloco"; one fragment, no overlap. Pseudo-gradients d_w = theta_bar - theta_w in fp32;
  the D-Lion steps run the stages above (with the options, on a zero buffer that receives -D, as
  ``DiLoCo`` does), sums over workers run in rank order (the scale's mean |p|, SparseLoCo's
  decoded values), and Nesterov's mean is the all-reduce's sum (below), divided by k.
- ``all_reduce_sum`` / ``all_reduce_mean``: the sum over workers in the order torch's gloo
  backend adds them. Its ring all-reduce cuts the buffer into 2k or more segments (at most 1 MiB
  each, a whole number per rank) and k consecutive chunks of them; chunk c is summed along the
  ring, from rank c - 1 down to rank c: ((x[c-1] + x[c-2]) + ...) + x[c]. That is not rank order
  from k = 3 on, and fp32 addition is not associative, so the order matters for bit-identity.
  NCCL's order is its own; on a GPU the simulation keeps gloo's.

Bytes (``StepStats`` / ``SimSyncStats``): what each rank of the real job sends, by the formulas
the exchange, ``DiLoCo`` and ``accounting.py`` use; every rank sends and receives the same count.

Memory: k momenta (and residuals) of d fp32 elements, plus, for DiLoCo, the workers' own
parameters (the caller's). Speed: the stages run once for all workers (the apply once per
worker); the models' forward and backward are the caller's (a loop over workers, or ``vmap``).

Any device: the tensors' device picks the backend (``backend=None``: the best there), CPU or
one GPU, unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .accounting import ring_all_reduce_bytes
from .exchange.checks import check_hyperparameters, check_options
from .exchange.pipeline import NonFiniteGradientError, StepStats
from .kernels import backends
from .local_steps import outer as outer_steps
from .local_steps import outer_options as outer_options_
from .kernels.layout import (
    HEADER_WORDS,
    WORD_BYTES,
    aggregate_planes,
    block_offsets,
    num_blocks,
    shard_blocks,
    vote_planes,
)

# gloo's ring all-reduce: the most bytes of one segment (gloo's kMaxSegmentSize)
GLOO_MAX_SEGMENT_BYTES = 1 << 20
OUTERS = ("dlion", "nesterov", "sparseloco")
_F32 = torch.float32
_SPARSE_HEADER_BYTES = HEADER_WORDS * WORD_BYTES


# ----------------------------------------------------------------------------- sums over workers


def ring_chunks(numel: int, workers: int, element_size: int = 4) -> list[tuple[int, int, int]]:
    """gloo's ring all-reduce of ``numel`` elements over ``workers`` ranks, as (start, stop,
    first rank) per chunk: the chunk's elements are summed from the first rank down the ring
    (first, first - 1, ..., first + 1, mod ``workers``). Empty chunks are left out."""
    if workers < 2 or numel == 0:
        return [(0, numel, 0)] if numel else []
    total = numel * element_size
    max_segment = element_size * max(1, GLOO_MAX_SEGMENT_BYTES // element_size)
    segments = max(-(-total // max_segment), 2 * workers)
    segments = -(-segments // workers) * workers
    per_rank = segments // workers
    segment_bytes = -(-total // segments)
    segment_bytes = -(-segment_bytes // element_size) * element_size
    chunk = per_rank * segment_bytes // element_size
    out = []
    for c in range(workers):
        start, stop = c * chunk, min((c + 1) * chunk, numel)
        if start < stop:
            out.append((start, stop, (c - 1) % workers))
    return out


def all_reduce_sum(stacked: torch.Tensor, order: str = "gloo") -> torch.Tensor:
    """The sum over dim 0 of ``stacked`` [k, numel] (a new tensor), added in the order of gloo's
    ring all-reduce of a flat buffer of ``numel`` elements (``order="gloo"``, the module
    docstring) or in rank order, 0 first (``order="rank"``)."""
    if stacked.dim() != 2:
        raise ValueError(f"stacked must be [workers, numel], got shape {tuple(stacked.shape)}")
    k, numel = stacked.shape
    if order == "rank" or k == 1:
        out = stacked[0].clone()
        for r in range(1, k):
            out += stacked[r]
        return out
    if order != "gloo":
        raise ValueError(f"order must be 'gloo' or 'rank', got {order!r}")
    out = torch.empty(numel, dtype=stacked.dtype, device=stacked.device)
    for start, stop, first in ring_chunks(numel, k, stacked.element_size()):
        part = out[start:stop]
        part.copy_(stacked[first, start:stop])
        for j in range(1, k):
            part += stacked[(first - j) % k, start:stop]
    return out


def all_reduce_mean(stacked: torch.Tensor, order: str = "gloo") -> torch.Tensor:
    """``all_reduce_sum`` divided by the number of workers (a sum all-reduce, then / n)."""
    return all_reduce_sum(stacked, order).div_(stacked.shape[0])


# ----------------------------------------------------------------------------- layout


class _Layout:
    """Tensors of given shapes laid end to end (flat fp32 buffers, one view per tensor) and in
    the exchange's block space (one bucket: ``layout.block_offsets``)."""

    def __init__(self, shapes):
        self.shapes = [torch.Size(s) for s in shapes]
        self.numels = [s.numel() for s in self.shapes]
        self.numel = sum(self.numels)
        self.offsets, self.blocks = block_offsets(self.numels)
        self.starts = []
        at = 0
        for k in self.numels:
            self.starts.append(at)
            at += k

    def views(self, flat: torch.Tensor) -> list:
        return [flat[s: s + k].view(shape)
                for s, k, shape in zip(self.starts, self.numels, self.shapes)]


def _exchange_bytes(blocks: int, n: int, p_in: int, p_out: int) -> int:
    """What one rank sends (and receives) in the exchange of one bucket: the all_to_all of the
    header and its votes, the all_gather of the tallied shard (``pipeline.BucketWork``)."""
    if n == 1:
        return 0
    shard = shard_blocks(blocks, n)
    return (n - 1) * (HEADER_WORDS + shard * p_in) * WORD_BYTES \
        + (n - 1) * shard * p_out * WORD_BYTES


class _Votes:
    """The three stages for k workers: votes of every worker, the tally, the apply."""

    def __init__(self, layout: _Layout, k: int, mode: str, votes: str, backend: str,
                 device):
        self.layout, self.k, self.mode, self.votes = layout, k, mode, votes
        self.ternary = votes == "ternary"
        self.p_in, self.p_out = vote_planes(votes), aggregate_planes(mode, votes, k)
        self.backend = backend
        self.stages = backends.get(backend)
        self.device = device
        self.bytes = _exchange_bytes(layout.blocks, k, self.p_in, self.p_out)

    def nonfinite(self, grads_by_worker) -> bool:
        """Whether any worker's gradient holds inf or NaN (the exchange's header flag)."""
        flat = [g for gs in grads_by_worker for g in gs if g is not None and g.numel()]
        if not flat:
            return False
        by_dtype: dict = {}
        for g in flat:
            by_dtype.setdefault(g.dtype, []).append(g.contiguous())
        return any(int(self.stages.nonfinite(gs)[0]) for gs in by_dtype.values())

    def aggregate(self, grads_by_worker, momenta_by_worker, beta1: float,
                  step: int) -> torch.Tensor:
        """The packed aggregate of the workers' votes on c = b1 m + (1 - b1) g."""
        L, k = self.layout, self.k
        stacked = torch.zeros(k, L.blocks * self.p_in, dtype=torch.int32, device=self.device)
        grads, moms, offs = [], [], []
        for w in range(k):
            for t, (g, m) in enumerate(zip(grads_by_worker[w], momenta_by_worker[w])):
                if m.numel() == 0:
                    continue  # an empty tensor owns no block
                grads.append(None if g is None else g.contiguous())
                moms.append(m)
                offs.append(w * L.blocks + L.offsets[t])
        for part in _by_dtype(grads, moms, offs):
            g, m, off = zip(*part)
            self.stages.local_step(list(g), list(m), stacked.view(-1), list(off), beta1,
                                   self.ternary)
        out = torch.empty(L.blocks * self.p_out, dtype=torch.int32, device=self.device)
        self.stages.tally(stacked, out, k, self.mode, self.ternary, step)
        return out

    def apply(self, aggregate, params, grads_by_worker, momenta_by_worker, *, lr: float,
              weight_decay: float, beta2: float, scratch, others: bool = True) -> None:
        """x = x - lr (D + wd x) on the shared ``params`` with worker 0's momentum update, then
        every other worker's momentum update (applied to ``scratch``, a throwaway copy), unless
        ``others`` is False (their momenta are thrown away too)."""
        L = self.layout
        live = [t for t, n in enumerate(L.numels) if n > 0]
        offs = [L.offsets[t] for t in live]
        for w in range(self.k if others else 1):
            xs = [params[t] if w == 0 else scratch[t] for t in live]
            gs = [grads_by_worker[w][t] for t in live]
            ms = [momenta_by_worker[w][t] for t in live]
            for part in _by_dtype(gs, list(zip(xs, ms)), offs, key=lambda xm: xm[0].dtype):
                g, xm, off = zip(*part)
                x, m = zip(*xm)
                work = [p if p.is_contiguous() else p.contiguous() for p in x]
                self.stages.apply(work, [None if t is None else t.contiguous() for t in g],
                                  list(m), aggregate, list(off), lr, weight_decay, beta2,
                                  self.k, self.mode, self.ternary)
                for p, c in zip(x, work):
                    if c is not p:
                        p.copy_(c)


def _by_dtype(grads, others, offsets, key=None):
    """(grad, other, offset) triples grouped by the gradient's dtype (None gradients ride with
    the first group; ``key(other)``: also by that, the parameter's dtype), in order: one stage
    launch per group, as the exchange does."""
    groups: dict = {}
    for g, o, off in zip(grads, others, offsets):
        k = None if key is None else key(o)
        groups.setdefault((k, None if g is None else g.dtype), []).append((g, o, off))
    for k in {k for k, d in groups if d is None}:
        first = next((kk for kk in groups if kk[0] == k and kk[1] is not None), None)
        if first is not None:
            groups[first] += groups.pop((k, None))
    return list(groups.values())


def _resolve(workers, mode, votes, backend, nonfinite, device) -> str:
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")
    check_options(mode, votes, backend, nonfinite)
    return backends.resolve(backend, torch.device(device))


# ----------------------------------------------------------------------------- per step


class SimulatedDLion:
    """``DistributedLion`` (one param group, no overlap) on ``workers`` simulated workers.

    params: the shared parameters (updated in place, as on every rank). Each worker keeps its
    own fp32 momentum (``momenta(w)``, zeros at first). ``step(grads)`` takes one list of
    gradients per worker (tensors shaped like ``params``, any float dtype the library takes,
    None = zero) and returns the ``StepStats`` a rank of the real job would report (bytes,
    world size, mode, votes, backend). ``nonfinite``: "raise" (NonFiniteGradientError, nothing
    changed) or "skip" (nothing changed) when any worker's gradient holds inf or NaN.
    With one worker and ``votes="ternary"`` this is Lion.
    """

    def __init__(self, params, workers: int, *, lr: float, betas=(0.9, 0.99),
                 weight_decay: float = 0.0, mode: str = "vote", votes: str = "binary",
                 backend: str | None = None, nonfinite: str = "raise"):
        self.params = list(params)
        if not self.params:
            raise ValueError("params is empty")
        self.beta1, self.beta2 = check_hyperparameters(lr, betas, weight_decay)
        device = self.params[0].device
        name = _resolve(workers, mode, votes, backend, nonfinite, device)
        self.lr, self.weight_decay = float(lr), float(weight_decay)
        self.workers, self.nonfinite = workers, nonfinite
        self.layout = _Layout([p.shape for p in self.params])
        self.flat_momenta = torch.zeros(workers, self.layout.numel, dtype=_F32, device=device)
        self._momenta = [self.layout.views(self.flat_momenta[w]) for w in range(workers)]
        self.votes = _Votes(self.layout, workers, mode, votes, name, device)
        self._scratch = None
        self.steps = 0  # the tie rule's step of the next step, as the optimizer's counter

    def momenta(self, w: int) -> list:
        """Worker w's momentum, one fp32 view per parameter."""
        return self._momenta[w]

    @torch.no_grad()
    def step(self, grads) -> StepStats:
        grads = [list(g) for g in grads]
        if len(grads) != self.workers or any(len(g) != len(self.params) for g in grads):
            raise ValueError(f"grads must hold {self.workers} lists of {len(self.params)} "
                             "tensors (one list per worker)")
        v = self.votes
        skipped = v.nonfinite(grads)
        if skipped and self.nonfinite == "raise":
            raise NonFiniteGradientError(
                "a gradient holds inf or NaN on at least one worker; nothing was updated")
        if not skipped:
            aggregate = v.aggregate(grads, self._momenta, self.beta1, self.steps)
            if self._scratch is None and self.workers > 1:
                self._scratch = [torch.zeros_like(p) for p in self.params]
            v.apply(aggregate, self.params, grads, self._momenta, lr=self.lr,
                    weight_decay=self.weight_decay, beta2=self.beta2, scratch=self._scratch)
            self.steps += 1
        return StepStats(v.bytes, v.bytes, self.layout.numel, self.workers, v.mode, v.votes,
                         v.backend, skipped=skipped)


# ----------------------------------------------------------------------------- DiLoCo


@dataclass(frozen=True)
class SimSyncStats:
    """One sync, with ``dk.SyncStats``' fields (one fragment, no overlap: ``applied_step`` is
    ``step``): the bytes a rank of the real job sends and receives, by the same formulas."""

    step: int
    applied_step: int
    fragment: int
    outer: str
    numel: int
    world_size: int
    bytes_sent: int
    bytes_received: int
    skipped: bool = False
    mode: str | None = None
    votes: str | None = None
    backend: str | None = None

    @property
    def allreduce_fp32_bytes(self) -> int:
        """What a ring all-reduce of the fp32 pseudo-gradients sends per rank."""
        return round(ring_all_reduce_bytes(self.world_size, 4 * self.numel))


def _field(options, name, default):
    """An option's value from a checked ``DLionOuterOptions``/``SparseLoCoOptions`` or None."""
    return default if options is None else getattr(options, name, default)


class SimulatedDiLoCo:
    """``dk.DiLoCo`` (one fragment, ``overlap_steps=0``) on k simulated workers.

    worker_params: one list of parameters per worker (each worker's model, identical at the
        start: checked), or ``stacked=``: one tensor [k, *shape] per parameter, row w being
        worker w's (what ``torch.func.vmap`` trains). The inner steps are the caller's; call
        ``step()`` after every worker's inner step (every ``sync_every``-th call syncs).
    outer, outer_lr, outer_betas, outer_weight_decay, outer_momentum, mode, votes, backend,
        nonfinite: ``DiLoCo``'s (outer_lr has no default here: pass the one you study).
    outer_options: ``DiLoCo``'s: None for its default (for "dlion" error feedback halved at
        every sync), a ``dk.DLionOuterOptions`` or ``dk.SparseLoCoOptions`` or a dict of its
        fields; ``DLionOuterOptions()`` (every option off) is the plain step.

    ``theta_bar`` (flat fp32, views by ``theta_bar_views()``), ``momentum`` [k, d] (Nesterov:
    one row, shared), ``residual`` [k, d] or None, ``bytes_sent`` (every sync added up) and
    ``last_stats`` mirror ``DiLoCo``'s.
    """

    def __init__(self, worker_params=None, sync_every: int = 1, outer: str = "dlion", *,
                 stacked=None, outer_lr: float, outer_betas=(0.9, 0.99),
                 outer_weight_decay: float = 0.0, outer_momentum: float = 0.9,
                 mode: str = "vote", votes: str = "binary", outer_options=None,
                 backend: str | None = None, nonfinite: str = "raise"):
        if (worker_params is None) == (stacked is None):
            raise ValueError("pass either worker_params (one list per worker) or stacked")
        if stacked is not None:
            self.stacked = list(stacked)
            if not self.stacked or any(t.dim() < 1 for t in self.stacked):
                raise ValueError("stacked must hold tensors [workers, *shape]")
            k = self.stacked[0].shape[0]
            if any(t.shape[0] != k for t in self.stacked):
                raise ValueError("every stacked tensor must have the same number of rows")
            self.worker_params = [[t[w] for t in self.stacked] for w in range(k)]
        else:
            self.stacked = None
            self.worker_params = [list(ps) for ps in worker_params]
            k = len(self.worker_params)
            if k < 1 or any(len(ps) != len(self.worker_params[0]) for ps in self.worker_params):
                raise ValueError("worker_params must hold one equal-length list per worker")
        if outer not in OUTERS:
            raise ValueError(f"outer must be one of {OUTERS}, got {outer!r}")
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every must be an int >= 1, got {sync_every!r}")
        self.beta1, self.beta2 = check_hyperparameters(outer_lr, outer_betas,
                                                       outer_weight_decay)
        if not 0.0 <= outer_momentum < 1.0:
            raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum!r}")
        first = self.worker_params[0]
        device = first[0].device
        self.backend = _resolve(k, mode, votes, backend, nonfinite, device)
        self.workers, self.sync_every, self.outer = k, sync_every, outer
        self.outer_lr, self.outer_weight_decay = float(outer_lr), float(outer_weight_decay)
        self.outer_momentum, self.mode, self.votes = float(outer_momentum), mode, votes
        self.nonfinite = nonfinite
        self.layout = L = _Layout([p.shape for p in first])
        self.theta_bar = torch.cat([p.detach().reshape(-1).float() for p in first])
        for w, ps in enumerate(self.worker_params[1:], 1):
            if not torch.equal(torch.cat([p.detach().reshape(-1).float() for p in ps]),
                               self.theta_bar):
                raise ValueError(f"worker {w} does not start from worker 0's parameters")
        rows = 1 if outer == "nesterov" else k
        self.momentum = torch.zeros(rows, L.numel, dtype=_F32, device=device)
        # the options as DiLoCo resolves them (None: its default; all off: the plain step)
        options = outer_options_.check(outer, outer_options, votes)
        self.error_feedback = outer == "dlion" and _field(options, "error_feedback", False)
        self.ef_decay = float(_field(options, "ef_decay", 1.0))
        self.scale = outer == "dlion" and _field(options, "scale", False)
        self.threshold = float(_field(options, "threshold", 0.0)) if outer == "dlion" else 0.0
        self.options = outer == "dlion" and options is not None
        self.chunk = int(_field(options, "chunk", 4096))
        self.topk = int(_field(options, "topk", 64))
        self.residual = torch.zeros(k, L.numel, dtype=_F32, device=device) \
            if self.error_feedback else None
        self._votes = _Votes(L, k, mode, votes, self.backend, device) if outer == "dlion" \
            else None
        self.inner_step = 0
        self.bytes_sent = 0
        self.last_stats: SimSyncStats | None = None

    def theta_bar_views(self) -> list:
        return self.layout.views(self.theta_bar)

    # ------------------------------------------------------------------------- steps

    @torch.no_grad()
    def step(self) -> SimSyncStats | None:
        """After every worker's inner step: the outer step every ``sync_every`` calls."""
        t = self.inner_step + 1
        stats = None
        if t % self.sync_every == 0:
            stats = self.sync(t)
        self.inner_step = t
        return stats

    def local(self) -> torch.Tensor:
        """Every worker's parameters, flat fp32, [k, d] (a new tensor)."""
        if self.stacked is not None:
            return torch.cat([t.detach().reshape(self.workers, -1).float()
                              for t in self.stacked], dim=1)
        return torch.stack([torch.cat([p.detach().reshape(-1).float() for p in ps])
                            for ps in self.worker_params])

    def set_params(self) -> None:
        """theta_i = theta_bar on every worker (rounded to the parameters' dtype)."""
        views = self.theta_bar_views()
        if self.stacked is not None:
            for t, v in zip(self.stacked, views):
                t.detach().copy_(v.unsqueeze(0).expand_as(t))
            return
        for ps in self.worker_params:
            torch._foreach_copy_([p.detach() for p in ps], views)

    @torch.no_grad()
    def sync(self, step: int) -> SimSyncStats:
        """One sync at inner step ``step`` (the tie rule's step)."""
        grads = self.local()
        torch.sub(self.theta_bar.unsqueeze(0).expand_as(grads), grads, out=grads)  # d_w
        if self.outer == "nesterov":
            skipped, sent = self._nesterov(grads)
        elif self.outer == "sparseloco":
            skipped, sent = self._sparseloco(grads, step)
        elif self.options:
            skipped, sent = self._dlion_options(grads, step)
        else:
            skipped, sent = self._dlion(grads, step)
        self.set_params()
        d_lion = self.outer == "dlion"
        self.last_stats = SimSyncStats(
            step=step, applied_step=step, fragment=0, outer=self.outer, numel=self.layout.numel,
            world_size=self.workers, bytes_sent=sent, bytes_received=sent, skipped=skipped,
            mode=self.mode if d_lion else None, votes=self.votes if d_lion else None,
            backend=self.backend if d_lion else None)
        self.bytes_sent += sent
        return self.last_stats

    def _skip(self, flagged: bool) -> bool:
        if flagged and self.nonfinite == "raise":
            raise NonFiniteGradientError(
                "a pseudo-gradient holds inf or NaN on at least one worker; nothing was updated")
        return flagged

    # D-Lion, plain: the exchange's stages with theta_bar as the parameters

    def _dlion(self, grads, step):
        L, v, k = self.layout, self._votes, self.workers
        g = [L.views(grads[w]) for w in range(k)]
        m = [L.views(self.momentum[w]) for w in range(k)]
        if self._skip(v.nonfinite(g)):
            return True, v.bytes
        aggregate = v.aggregate(g, m, self.beta1, step)
        theta = self.theta_bar_views()
        scratch = [torch.zeros_like(x) for x in theta] if k > 1 else None
        v.apply(aggregate, theta, g, m, lr=self.outer_lr, weight_decay=self.outer_weight_decay,
                beta2=self.beta2, scratch=scratch)
        return False, v.bytes

    # D-Lion with options (error feedback, its decay, a scale, a threshold)

    def _dlion_options(self, grads, step):
        L, v, k = self.layout, self._votes, self.workers
        p = grads.add_(self.residual) if self.residual is not None else grads  # p_w, in place
        c = self.momentum * self.beta1
        c += p * (1.0 - self.beta1)
        if self.threshold > 0:
            for w in range(k):
                for view in L.views(c[w]):
                    bound = view.abs().mean() * self.threshold
                    view.masked_fill_(view.abs() < bound, 0.0)
        scale_bytes = (k - 1) * len(L.numels) * 4 if self.scale else 0
        cv = [L.views(c[w]) for w in range(k)]
        if self._skip(v.nonfinite(cv)):
            return True, v.bytes + scale_bytes
        # the exchange only votes: c' = 0 m + 1 c, x = 0 - 1 (D + 0 x), m kept (b2 = 1). Its
        # momentum is a zero scratch that the local step only reads (one for every worker) and
        # that nothing reads after the apply: only worker 0's apply runs (it sets x)
        scratch_m = L.views(torch.zeros_like(self.theta_bar))
        aggregate = v.aggregate(cv, [scratch_m] * k, 0.0, step)
        zero = torch.zeros_like(self.theta_bar)
        zv = L.views(zero)
        v.apply(aggregate, zv, cv, [scratch_m] * k, lr=1.0, weight_decay=0.0, beta2=1.0,
                scratch=None, others=False)
        u = torch.neg(zero)  # D
        if self.scale:
            mine = torch.stack([torch.stack([x.abs().mean() if x.numel() else x.new_zeros(())
                                             for x in L.views(p[w])]) for w in range(k)])
            s = all_reduce_sum(mine, order="rank") / k
            for t, view in enumerate(L.views(u)):
                view.mul_(s[t])
        lr, wd = self.outer_lr, self.outer_weight_decay
        update = u + self.theta_bar * wd if wd else u
        self.theta_bar.sub_(update * lr)
        if self.residual is not None:
            torch.sub(p, (u * lr).unsqueeze(0).expand_as(p), out=self.residual)
            if self.ef_decay < 1.0:
                self.residual.mul_(self.ef_decay)
        self.momentum.mul_(self.beta2)
        self.momentum.add_(p * (1.0 - self.beta2))
        return False, v.bytes + scale_bytes

    # Nesterov: the all-reduce's sum (with the step words), / k; SGD-nesterov per tensor

    def _nesterov(self, grads):
        k, L = self.workers, self.layout
        if k > 1:
            # the all-reduce's buffer holds 2 k step words after the pseudo-gradient: they
            # change where gloo's chunks fall, not the sum of the pseudo-gradient
            words = torch.zeros(k, 2 * k, dtype=_F32, device=grads.device)
            mean = all_reduce_sum(torch.cat([grads, words], dim=1))[: L.numel].div_(k)
            sent = round(ring_all_reduce_bytes(k, 4 * (L.numel + 2 * k)))
        else:
            mean, sent = grads[0].clone(), 0
        if self._skip(not bool(torch.isfinite(mean).all())):
            return True, sent
        mu, lr = self.outer_momentum, self.outer_lr
        d, u = L.views(mean), L.views(self.momentum[0])
        torch._foreach_mul_(u, mu)
        torch._foreach_add_(u, d)
        update = torch._foreach_add(d, u, alpha=mu)
        torch._foreach_add_(self.theta_bar_views(), update, alpha=-lr)
        return False, sent

    # SparseLoCo: top-k per run of the accumulator, 2-bit values, error feedback

    def sparse_kept(self, numel: int) -> int:
        full, rest = divmod(numel, self.chunk)
        return full * self.topk + (-(-self.topk * rest // self.chunk) if rest else 0)

    def sparse_payload_bytes(self) -> int:
        """One rank's payload: header, two magnitudes per tensor, a 16-bit offset and a 2-bit
        code per kept element."""
        kept = sum(self.sparse_kept(n) for n in self.layout.numels)
        return _SPARSE_HEADER_BYTES + 8 * len(self.layout.numels) + 2 * kept + -(-kept // 4)

    def _compress(self, acc: torch.Tensor) -> torch.Tensor:
        """The values one tensor's accumulator (flat) sends, dense (zeros elsewhere): what
        ``DiLoCo``'s SparseLoCo step selects and decodes."""
        index, codes, levels = outer_steps.sparse_compress(acc, self.chunk, self.topk)
        out = torch.zeros_like(acc)
        out[index] = outer_steps.decode_values(codes, levels)
        return out

    def _sparseloco(self, grads, step):
        k, L = self.workers, self.layout
        size = self.sparse_payload_bytes()
        sent = (k - 1) * size
        acc = self.momentum * self.ef_decay
        acc += grads
        flagged = not bool(torch.isfinite(grads).all())
        if self._skip(flagged):
            return True, sent
        values = torch.zeros_like(acc)
        for w in range(k):
            for a, out in zip(L.views(acc[w]), L.views(values[w])):
                out.view(-1).copy_(self._compress(a.reshape(-1)))
        total = torch.zeros_like(self.theta_bar)
        for w in range(k):  # rank order
            total += values[w]
        mean = total / k
        lr, wd = self.outer_lr, self.outer_weight_decay
        update = mean + self.theta_bar * wd if wd else mean
        self.theta_bar.sub_(update * lr)
        torch.sub(acc, values, out=self.momentum)
        return False, sent


def dlion_step_bytes(numel_per_tensor, workers: int, mode: str = "vote",
                     votes: str = "binary") -> int:
    """Bytes one rank sends (and receives) in one ``DistributedLion`` step (no overlap) of
    tensors of these sizes over ``workers`` ranks."""
    blocks = sum(num_blocks(n) for n in numel_per_tensor)
    return _exchange_bytes(blocks, workers, vote_planes(votes),
                           aggregate_planes(mode, votes, workers))


def sparseloco_sync_bytes(numel_per_tensor, workers: int, chunk: int = 4096,
                          topk: int = 64) -> int:
    """Bytes one rank sends (and receives) in one SparseLoCo sync: (n - 1) payloads."""
    kept = 0
    for n in numel_per_tensor:
        full, rest = divmod(n, chunk)
        kept += full * topk + (-(-topk * rest // chunk) if rest else 0)
    T = len(list(numel_per_tensor))
    return (workers - 1) * (_SPARSE_HEADER_BYTES + 8 * T + 2 * kept + -(-kept // 4))


__all__ = ["SimulatedDLion", "SimulatedDiLoCo", "SimSyncStats", "all_reduce_sum",
           "all_reduce_mean", "ring_chunks", "dlion_step_bytes", "sparseloco_sync_bytes",
           "GLOO_MAX_SEGMENT_BYTES"]
