"""DiLoCo's outer steps, one interface: D-Lion's plain 1-bit step, D-Lion with options (error
feedback, a per-tensor scale, thresholded ternary votes), DiLoCo's fp32 Nesterov and SparseLoCo.

``diloco.py`` keeps the schedule (fragments, ``overlap_steps``, theta_bar, the merge) and, at a
fragment's sync, calls its outer step the same way whatever it is, with or without FSDP2, a
manager or streaming:

    sync = outer.start(fragment, grad, step, group)   # d_i; the collectives start (async)
    ...                                                # overlap_steps inner steps, or none
    result = sync.finish(decision)                     # waits, decides, applies (or not)
    sync.abandon()                                     # instead: completes them, applies nothing

``start`` takes the fragment (its flat fp32 theta_bar and outer momentum, views per tensor),
the pseudo-gradient d_i = theta_bar - theta_i, the tie rule's step and the process group of this
sync (the replicas' group, or a torchft quorum's: ``elastic.ManagerGroup``). ``finish`` takes a
``Decision``: how the sync decides beyond its group (FSDP2: over the whole mesh; a replica of
several ranks on torchft: inside the replica) and whether it applies (torchft's
``should_commit``, asked once every collective has returned). It returns a ``SyncResult``: whether
the sync was skipped (a non-finite pseudo-gradient somewhere, ``nonfinite="skip"``, or not
committed) and the bytes. With nothing applied, theta_bar and every outer state stay as they
were.

The math of each (``diloco.py`` for the plain D-Lion step and Nesterov, ``outer_options.py`` for
the options and SparseLoCo) is written where its options are; the arithmetic here follows it
exactly, so that a sync gives the same theta_bar, bit for bit, on every path.

Outer state beyond theta_bar and the momentum slot of each fragment: the error-feedback
residuals of ``DLionOuterOptions(error_feedback=True)`` (``residuals``, saved with
``state_dict``). What a healing replica copies: the momentum slot is private to a replica for
D-Lion (its own outer momentum) and SparseLoCo (its error-feedback accumulator), shared for
Nesterov (u follows the mean pseudo-gradient, the same on every replica: ``shared_momentum``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from ..accounting import gossip_bytes_per_step
from ..exchange import sharded
from ..exchange.collectives import collective, wait
from ..exchange.header import StepMismatchError, decide, make_header
from ..exchange.pipeline import (
    Exchange,
    NonFiniteGradientError,
    Row,
    Segment,
    all_gather,
    resolve_group,
)
from ..kernels.layout import HEADER_WORDS
from .outer_options import DLionOuterOptions, SparseLoCoOptions

ALL_REDUCE = "all_reduce(pseudo-gradient)"
# FSDP2: the non-finite flag of Nesterov's mean and every rank's steps, agreed over the mesh
FLAGS = "all_reduce(mesh non-finite flags)"
SCALES = "all_gather(outer scales)"
SPARSE = "all_gather(sparse pseudo-gradients)"
_HEADER_BYTES = 4 * HEADER_WORDS


@dataclass(frozen=True)
class SyncResult:
    """What one sync did on this rank: ``skipped`` (nothing applied), the bytes it sent and
    received (``intra``: the part that stayed inside a node or replica), the kernel backend."""

    skipped: bool
    sent: int
    received: int
    intra: int = 0
    backend: str | None = None


class Decision:
    """How one sync ends beyond its own group: ``sharding`` (FSDP2: the mesh whose ranks all
    decide alike), ``replica`` (torchft: the mesh is this replica's own ranks; the replicas are
    the quorum's), ``commit`` (torchft's ``should_commit``: asked once every collective of the
    sync has returned, before anything is applied; None: always)."""

    def __init__(self, step: int, *, sharding=None, replica: bool = False, commit=None,
                 timeout=None, label: str = "", applied: str = ""):
        self.step, self.sharding, self.replica = step, sharding, replica
        self.commit, self.timeout = commit, timeout
        self.label, self.applied = label, applied

    def agreement(self):
        """``Exchange.finish(agree=)`` for the sync's headers (None: its group decides alone)."""
        if self.sharding is None:
            return None
        return sharded.ShardAgreement(self.sharding, self.step, self.timeout,
                                      replica=self.replica)

    def committed(self) -> bool:
        return True if self.commit is None else bool(self.commit())

    def nonfinite(self, mean: torch.Tensor, steps: list[int]) -> tuple[bool, int]:
        """Nesterov's decision from its mean pseudo-gradient and the replicas' inner steps (its
        all-reduce's words): whether a non-finite value is anywhere (FSDP2: on any rank of the
        mesh, or of the replica), and the bytes that cost this rank. Raises
        ``StepMismatchError`` on every rank when the steps differ; nothing was applied."""
        flag = torch.isfinite(mean).all().logical_not().to(torch.int32).view(1)
        table, intra = [steps], 0
        if self.sharding is not None and self.replica:
            # the flag and every replica's step as headers, decided inside the replica
            headers = torch.stack([flag.expand(len(steps)),
                                   torch.tensor(steps, dtype=torch.int32)], 1).to(mean.device)
            agreement = self.agreement()
            words = agreement(headers.unsqueeze(0)).view(-1, HEADER_WORDS).cpu()
            flag, intra = words[:, :1].amax().view(1) & 1, agreement.sent
            table = [words[:, 1].tolist()]
        elif self.sharding is not None and self.sharding.shards > 1:
            mesh = sharded.mesh_group(self.sharding, self.step, self.timeout)
            me, M = dist.get_rank(mesh), dist.get_world_size(mesh)
            words = torch.full((1 + M * len(steps),), -1, dtype=torch.int32)
            words[0] = int(flag)
            words[1 + me * len(steps):][: len(steps)] = torch.tensor(steps, dtype=torch.int32)
            words = words.to(mean.device)
            sharded.mesh_collective(self.sharding, self.step, FLAGS, dist.all_reduce, words,
                                    op=dist.ReduceOp.MAX, timeout=self.timeout,
                                    label=self.label, applied=self.applied)
            flag, table = words[:1].cpu(), words[1:].view(M, -1).tolist()
            intra = round(gossip_bytes_per_step(words.numel(), 4, M))
        if len({s for row in table for s in row}) > 1:
            raise StepMismatchError(
                f"DiLoCo sync: the ranks are at different inner steps: {table} (per replica"
                f"{', one row per rank of the mesh' if len(table) > 1 else ''}); nothing of "
                "this sync was applied on any rank (theta_bar, the outer momenta and the "
                "parameters are as before this step()). "
                "Every rank must load the state saved at the same inner step and call step() "
                "the same number of times")
        return bool(flag), intra


def _rank_and_size(group) -> tuple[int, int]:
    pg, n = resolve_group(group)
    return (pg.rank() if n > 1 else 0), n


class OuterStep:
    """The interface (module docstring). ``diloco``: the DiLoCo whose settings and fragments
    the step reads (``outer_lr``, ``outer_betas``, ``mode``, ``votes``, ``backend``,
    ``nonfinite``, ``timeout``, ``streams``, ``fragment_states``)."""

    name = ""
    shared_momentum = False

    def __init__(self, diloco):
        self.diloco = diloco
        self.fragments = diloco.fragment_states

    def start(self, fragment, grad: torch.Tensor, step: int, group):
        raise NotImplementedError

    def residuals(self) -> list:
        """One flat fp32 error-feedback residual per fragment, None where there is none."""
        return [None] * len(self.fragments)

    def private(self) -> list:
        """This rank's own outer state (a healing replica's ``heal_momentum`` acts on it)."""
        momenta = [] if self.shared_momentum else [f.momentum for f in self.fragments]
        return momenta + [r for r in self.residuals() if r is not None]

    def shared(self) -> list:
        """Outer state every replica holds alike besides theta_bar (copied on heal)."""
        return [f.momentum for f in self.fragments] if self.shared_momentum else []

    # checkpoints: the state beyond theta_bar and the momentum slot (None: none)

    def state_dict(self) -> dict | None:
        return None

    def check_state(self, saved) -> None:
        if saved is not None:
            raise ValueError(f"state_dict was saved with outer_options {saved.get('options')!r}; "
                             "this DiLoCo has none")

    def load_state_dict(self, saved) -> None:
        pass


# ----------------------------------------------------------------------------- D-Lion, plain


class DLionStep(OuterStep):
    """``outer="dlion"`` without options: the D-Lion step of ``diloco.py``'s docstring, on the
    exchange's fused stages (theta_bar and the momentum updated in the apply)."""

    name = "dlion"

    def start(self, fragment, grad, step, group):
        d = self.diloco
        ex = Exchange(device=fragment.theta.device, mode=d.mode, votes=d.votes, group=group,
                      backend=d.backend, step=step, nonfinite=d.nonfinite, streams=d.streams,
                      timeout=d.timeout)
        ex.add([ex.row(x, g, m, off, fragment.segment) for x, g, m, off in zip(
            fragment.views(fragment.theta), fragment.views(grad),
            fragment.views(fragment.momentum), fragment.offsets)], fragment.blocks)
        return _ExchangeSync(ex)


class _ExchangeSync:
    def __init__(self, ex: Exchange):
        self.exchange, self.backend = ex, ex.backend

    def abandon(self) -> None:
        self.exchange.abandon()

    def finish(self, decision: Decision) -> SyncResult:
        agreement = decision.agreement()
        stats = self.exchange.finish(agree=agreement, commit=decision.commit)
        intra = 0 if agreement is None else agreement.sent
        return SyncResult(stats.skipped, stats.bytes_sent + intra, stats.bytes_sent + intra,
                          intra, self.backend)


class WithOptions(OuterStep):
    """An outer step with ``outer_options``: its options and residuals are checkpointed."""

    options = None

    def state_dict(self) -> dict:
        return {"options": asdict(self.options), "kind": type(self.options).__name__,
                "residual": [None if r is None else r.clone() for r in self.residuals()]}

    def check_state(self, saved) -> None:
        mine = {"options": asdict(self.options), "kind": type(self.options).__name__}
        if not isinstance(saved, dict) or {k: saved.get(k) for k in mine} != mine:
            got = None if not isinstance(saved, dict) else saved.get("options")
            raise ValueError(f"state_dict was saved with outer_options {got!r}, this DiLoCo "
                             f"has {mine['options']!r} ({mine['kind']})")
        residual = saved.get("residual")
        want = self.residuals()
        if not isinstance(residual, (list, tuple)) or len(residual) != len(want) or not all(
                (r is None) == (w is None) and (r is None or (
                    isinstance(r, torch.Tensor) and r.dtype == torch.float32 and r.dim() == 1
                    and r.numel() == w.numel())) for r, w in zip(residual, want)):
            raise ValueError("state_dict's outer_options residual must hold one flat float32 "
                             "tensor per fragment (of its elements) where error feedback is on, "
                             "None elsewhere")

    def load_state_dict(self, saved) -> None:
        for mine, r in zip(self.residuals(), saved["residual"]):
            if mine is not None:
                mine.copy_(r)


# ----------------------------------------------------------------------------- D-Lion, options


class DLionOptionsStep(WithOptions):
    """``outer="dlion"`` with ``DLionOuterOptions`` (``outer_options.py``'s docstring): p_i and
    c_i in torch, the vote on the exchange's stages (applied with lr 1 and no momentum to a zero
    buffer, which then holds -D), the scales' all_gather beside it, then theta_bar, e_i and m_i
    in torch."""

    name = "dlion-options"

    def __init__(self, diloco, options: DLionOuterOptions):
        super().__init__(diloco)
        self.options = options
        self.residual = [torch.zeros_like(f.theta) if options.error_feedback else None
                         for f in self.fragments]
        # the exchange only votes: c = 0 * m + 1 * p, x = 0 - 1 * (D + 0 x), m kept (b2 = 1)
        self.segment = Segment([], [], [], 1.0, 0.0, 1.0, 0.0)

    def residuals(self) -> list:
        return self.residual

    def start(self, fragment, grad, step, group):
        b1 = self.diloco.outer_betas[0]
        e = self.residual[fragment.index]
        p = grad + e if e is not None else grad
        c = fragment.momentum * b1
        c += p * (1.0 - b1)
        if self.options.threshold > 0:
            for view in fragment.views(c):
                bound = view.abs().mean() * self.options.threshold
                view.masked_fill_(view.abs() < bound, 0.0)
        return _DLionOptionsSync(self, fragment, p, c, step, group)



class _DLionOptionsSync:
    def __init__(self, step_: DLionOptionsStep, fragment, p, vote_input, step, group):
        d = step_.diloco
        self.outer, self.fragment, self.p, self.step = step_, fragment, p, step
        self.zero = torch.zeros_like(p)  # becomes -D
        scratch = torch.zeros_like(p)
        ex = Exchange(device=p.device, mode=d.mode, votes=d.votes, group=group,
                      backend=d.backend, step=step, nonfinite=d.nonfinite,
                      streams=d.streams, timeout=d.timeout)
        rows = [Row(x, g, m, off, step_.segment) for x, g, m, off in zip(
            fragment.views(self.zero), fragment.views(vote_input), fragment.views(scratch),
            fragment.offsets)]
        ex.add(rows, fragment.blocks)
        self.exchange, self.backend = ex, ex.backend
        self.work, self.scales, self.scale_bytes = None, None, 0
        if step_.options.scale:
            mine = torch.stack([v.abs().mean() if v.numel() else v.new_zeros(())
                                for v in fragment.views(p)])
            n = ex.n
            self.scales = torch.empty(n * mine.numel(), dtype=torch.float32, device=p.device)
            if n == 1:
                self.scales.copy_(mine)
            else:
                self.work = collective(SCALES, step, all_gather, self.scales, mine, ex.group,
                                       async_op=True)
                self.scale_bytes = (n - 1) * mine.numel() * 4
            self.mine = mine  # alive until the gather is done

    def _wait(self) -> None:
        if self.work is not None:
            work, self.work = self.work, None
            wait(work, self.step, SCALES, self.outer.diloco.timeout)

    def abandon(self) -> None:
        self.exchange.abandon()
        self._wait()

    def finish(self, decision: Decision) -> SyncResult:
        agreement = decision.agreement()
        try:
            self._wait()  # every collective of the sync before the commit
        finally:
            stats = self.exchange.finish(agree=agreement, commit=decision.commit)
        if not stats.skipped:
            self._apply()
        intra = 0 if agreement is None else agreement.sent
        sent = stats.bytes_sent + self.scale_bytes + intra
        return SyncResult(stats.skipped, sent, sent, intra, self.backend)

    def _apply(self) -> None:
        d, fragment, outer = self.outer.diloco, self.fragment, self.outer
        n = self.exchange.n
        u = torch.neg(self.zero)  # D
        if self.scales is not None:
            rows = self.scales.view(n, -1)
            s = rows[0].clone()
            for r in range(1, n):  # rank order: the same sum on every rank
                s += rows[r]
            s /= n
            for k, view in enumerate(fragment.views(u)):
                view.mul_(s[k])
        lr, wd = d.outer_lr, d.outer_weight_decay
        step = u + fragment.theta * wd if wd else u
        fragment.theta.sub_(step * lr)
        e = outer.residual[fragment.index]
        if e is not None:
            torch.sub(self.p, u * lr, out=e)
            if outer.options.ef_decay < 1.0:  # each rank's own drift, bounded
                e.mul_(outer.options.ef_decay)
        b2 = d.outer_betas[1]
        fragment.momentum.mul_(b2)
        fragment.momentum.add_(self.p * (1.0 - b2))


# ----------------------------------------------------------------------------- Nesterov


class NesterovStep(OuterStep):
    """``outer="nesterov"`` (DiLoCo): the mean pseudo-gradient by one fp32 all-reduce (a sum,
    then a division by n) carrying every replica's inner step, then torch.optim.SGD(momentum=mu,
    nesterov=True)'s update, tensor by tensor."""

    name = "nesterov"
    shared_momentum = True

    def start(self, fragment, grad, step, group):
        return _NesterovSync(self, fragment, grad, step, group)


class _NesterovSync:
    backend = None

    def __init__(self, outer: NesterovStep, fragment, grad, step, group):
        self.outer, self.fragment, self.step = outer, fragment, step
        self.group = resolve_group(group)[0]
        me, self.n = _rank_and_size(group)
        # the pseudo-gradient stays apart from the buffer being reduced (a checkpoint inside
        # the window saves it); the step words ride along (``_step_words``)
        self.summed, self.work = grad, None
        if self.n > 1:
            self.summed = torch.cat([grad, _step_words(step, me, self.n, grad.device)])
            d = outer.diloco
            self.work = collective(ALL_REDUCE, step, dist.all_reduce, self.summed,
                                   group=self.group, async_op=True, label=d.label,
                                   applied=d.applied)

    def _wait(self) -> None:
        if self.work is not None:
            work, self.work = self.work, None
            d = self.outer.diloco
            wait(work, self.step, ALL_REDUCE, d.timeout, label=d.label, applied=d.applied)

    def abandon(self) -> None:
        self._wait()

    def finish(self, decision: Decision) -> SyncResult:
        self._wait()
        d, fragment, n = self.outer.diloco, self.fragment, self.n
        mean = self.summed[: fragment.numel]
        steps = _steps(self.summed[fragment.numel:]) if n > 1 else [self.step % 2**31]
        mean = mean.div_(n) if n > 1 else mean
        skipped, intra = decision.nonfinite(mean, steps)
        sent = round(gossip_bytes_per_step(self.summed.numel(), 4, n)) + intra
        if not decision.committed():
            return SyncResult(True, sent, sent, intra)
        if skipped and d.nonfinite == "raise":
            raise NonFiniteGradientError("a pseudo-gradient holds inf or NaN")
        if not skipped:
            u, mu = fragment.views(fragment.momentum), d.outer_momentum
            g = fragment.views(mean)
            torch._foreach_mul_(u, mu)
            torch._foreach_add_(u, g)
            update = torch._foreach_add(g, u, alpha=mu)
            torch._foreach_add_(fragment.views(fragment.theta), update, alpha=-d.outer_lr)
        return SyncResult(skipped, sent, sent, intra)


def _step_words(step: int, me: int, n: int, device) -> torch.Tensor:
    """Nesterov's step header: 2 n fp32 words added to the all-reduce, this rank's inner step
    (mod 2**31, as D-Lion's header) in its two slots as two 16-bit halves, zeros elsewhere: the
    sum holds every rank's step exactly."""
    words = torch.zeros(2 * n, dtype=torch.float32)
    step %= 2**31
    words[2 * me:][:2] = torch.tensor([step >> 16, step & 0xFFFF])
    return words.to(device)


def _steps(words: torch.Tensor) -> list[int]:
    pairs = words.view(-1, 2).to(torch.int64).tolist()
    return [hi << 16 | lo for hi, lo in pairs]


# ----------------------------------------------------------------------------- SparseLoCo


class SparseLoCoStep(WithOptions):
    """``outer="sparseloco"`` (``outer_options.py``'s docstring); the accumulator is the
    fragment's momentum slot."""

    name = "sparseloco"

    def __init__(self, diloco, options: SparseLoCoOptions):
        super().__init__(diloco)
        self.options = options
        self.layouts = [self._layout(f) for f in self.fragments]

    def _layout(self, fragment):
        """(elements kept per tensor, their total, the bytes of one rank's payload)."""
        kept = [self.options.kept(k) for k in fragment.numels]
        total = sum(kept)
        T = len(kept)
        size = _HEADER_BYTES + 8 * T + 2 * total + -(-total // 4)
        return kept, total, size

    def payload_bytes(self, fragment) -> int:
        """Bytes of one rank's payload for ``fragment``."""
        return self.layouts[fragment.index][2]

    def start(self, fragment, grad, step, group):
        return _SparseSync(self, fragment, grad, step, group)

    def compress(self, acc_view: torch.Tensor):
        return sparse_compress(acc_view, self.options.chunk, self.options.topk)



def sparse_compress(acc_view: torch.Tensor, chunk: int, topk: int):
    """(kept offsets in the tensor (int64, run by run), their 2-bit codes (uint8), the two
    magnitudes (fp32 [2])) of one tensor's accumulator (flat)."""
    C, k = chunk, topk
    numel = acc_view.numel()
    full, rest = divmod(numel, C)
    idx = []
    if full:
        runs = acc_view[: full * C].view(full, C)
        top = torch.topk(runs.abs(), k, dim=1).indices
        base = torch.arange(full, device=acc_view.device).unsqueeze(1) * C
        idx.append((top + base).reshape(-1))
    if rest:
        tail = acc_view[full * C:]
        kr = -(-k * rest // C)
        idx.append(torch.topk(tail.abs(), kr).indices + full * C)
    index = torch.cat(idx) if idx else torch.zeros(0, dtype=torch.int64,
                                                    device=acc_view.device)
    values = acc_view[index]
    mag = values.abs()
    s = mag.mean() if mag.numel() else mag.new_zeros(())
    high = mag >= s
    levels = torch.stack([_mean_or_zero(mag[~high]), _mean_or_zero(mag[high])])
    codes = (values < 0).to(torch.uint8) | (high.to(torch.uint8) << 1)
    return index, codes, levels


def _mean_or_zero(t: torch.Tensor) -> torch.Tensor:
    return t.mean() if t.numel() else t.new_zeros(())


def decode_values(codes: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """fp32 values of 2-bit codes (bit 0: negative, bit 1: the upper magnitude)."""
    mag = torch.where((codes & 2) != 0, levels[1], levels[0])
    return torch.where((codes & 1) != 0, -mag, mag)


def _pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """2-bit codes, 4 per byte (element j in bits 2 (j mod 4))."""
    pad = (-codes.numel()) % 4
    c = torch.cat([codes, codes.new_zeros(pad)]).view(-1, 4)
    return c[:, 0] | (c[:, 1] << 2) | (c[:, 2] << 4) | (c[:, 3] << 6)


def _unpack_codes(packed: torch.Tensor, count: int) -> torch.Tensor:
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & 3).reshape(-1)[:count]


def _starts(numels) -> list:
    out, at = [], 0
    for k in numels:
        out.append(at)
        at += k
    return out


class _SparseSync:
    """One SparseLoCo sync: the payload's all_gather in flight, then the apply."""

    backend = None

    def __init__(self, outer: SparseLoCoStep, fragment, grad, step, group):
        self.outer, self.fragment, self.step = outer, fragment, step
        size = outer.layouts[fragment.index][2]
        self.acc = fragment.momentum * outer.options.ef_decay
        self.acc += grad
        self.sent_values = torch.zeros_like(self.acc)
        flag = torch.isfinite(grad).all().logical_not().to(torch.int32).view(1)
        magnitudes, indices, codes = [], [], []
        for view, start in zip(fragment.views(self.acc), _starts(fragment.numels)):
            flat = view.reshape(-1)
            index, code, levels = outer.compress(flat)
            run = index % outer.options.chunk
            indices.append(run.to(torch.int16))
            codes.append(code)
            magnitudes.append(levels)
            self.sent_values[start + index] = decode_values(code, levels)
        # [header | T magnitude pairs (fp32) | K run offsets (int16) | K 2-bit codes]
        payload = torch.cat([make_header(flag, step).view(torch.uint8),
                             torch.cat(magnitudes).view(torch.uint8),
                             torch.cat(indices).view(torch.uint8),
                             _pack_codes(torch.cat(codes))])
        self.payload = payload  # alive until the gather is done
        self.n = _rank_and_size(group)[1]
        self.gathered = torch.empty(self.n * size, dtype=torch.uint8, device=self.acc.device)
        self.work, self.sent = None, 0
        if self.n == 1:
            self.gathered.copy_(payload)
        else:
            self.work = collective(SPARSE, step, all_gather, self.gathered, payload,
                                   resolve_group(group)[0], async_op=True)
            self.sent = (self.n - 1) * size

    def _wait(self) -> None:
        if self.work is not None:
            work, self.work = self.work, None
            wait(work, self.step, SPARSE, self.outer.diloco.timeout)

    def abandon(self) -> None:
        self._wait()

    def finish(self, decision: Decision) -> SyncResult:
        self._wait()
        d, fragment = self.outer.diloco, self.fragment
        kept, total, size = self.outer.layouts[fragment.index]
        rows = self.gathered.view(self.n, size)
        # contiguous: with one rank the slice keeps the row's stride, which view() refuses
        headers = rows[:, :_HEADER_BYTES].clone(memory_format=torch.contiguous_format)
        headers = headers.view(torch.int32).view(self.n, HEADER_WORDS)
        agreement, intra = decision.agreement(), 0
        if agreement is not None:
            headers = agreement(headers.unsqueeze(0)).reshape(-1, HEADER_WORDS)
            intra = agreement.sent
        sent = self.sent + intra
        if not decision.committed():
            return SyncResult(True, sent, sent, intra)
        skipped = decide(headers)
        if skipped and d.nonfinite == "raise":
            raise NonFiniteGradientError("a pseudo-gradient holds inf or NaN on at least one rank")
        if not skipped:
            mean = self._decode(rows, kept, total)
            lr, wd = d.outer_lr, d.outer_weight_decay
            step = mean + fragment.theta * wd if wd else mean
            fragment.theta.sub_(step * lr)
            torch.sub(self.acc, self.sent_values, out=fragment.momentum)
        return SyncResult(skipped, sent, sent, intra)

    def _decode(self, rows, kept, total) -> torch.Tensor:
        """The mean of the ranks' sent values: each decoded dense, summed in rank order, / n."""
        fragment, options = self.fragment, self.outer.options
        C, T = options.chunk, len(kept)
        total_sum, device = torch.zeros_like(self.acc), self.acc.device
        run_bases = []
        for numel, k in zip(fragment.numels, kept):
            full, rest = divmod(numel, C)
            per = [options.topk] * full + ([k - full * options.topk] if rest else [])
            run_bases.append(torch.repeat_interleave(
                torch.arange(len(per), dtype=torch.int64, device=device) * C,
                torch.tensor(per, dtype=torch.int64, device=device)))
        starts = _starts(fragment.numels)
        for r in range(self.n):
            row = rows[r]
            at = _HEADER_BYTES
            levels = row[at: at + 8 * T].clone().view(torch.float32).view(T, 2)
            at += 8 * T
            runs = row[at: at + 2 * total].clone().view(torch.int16).to(torch.int64)
            at += 2 * total
            codes = _unpack_codes(row[at:], total)
            dense = torch.zeros_like(self.acc)
            pos = 0
            for t, (k, base, start) in enumerate(zip(kept, run_bases, starts)):
                index = start + base + runs[pos: pos + k]
                dense[index] = decode_values(codes[pos: pos + k], levels[t])
                pos += k
            total_sum += dense
        return total_sum / self.n


def make(outer: str, options, diloco) -> OuterStep:
    """The outer step ``diloco`` runs: ``outer`` with its checked ``options`` (None: plain)."""
    if outer == "nesterov":
        return NesterovStep(diloco)
    if outer == "sparseloco":
        return SparseLoCoStep(diloco, options)
    if options is not None:
        return DLionOptionsStep(diloco, options)
    return DLionStep(diloco)


__all__ = ["Decision", "OuterStep", "SyncResult", "make"]
