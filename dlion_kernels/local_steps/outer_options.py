"""Options for ``DiLoCo``'s outer step: error feedback, a per-tensor scale and thresholded ternary
votes for the 1-bit D-Lion outer step, and SparseLoCo as a baseline outer step.

Both run at a sync in place of the plain outer step and keep its contract: the same start and
finish points (so fragments, overlap_steps and the failure rules work as for the plain step), the
same theta_bar on every rank, bit for bit, and nothing modified when a collective fails or a
pseudo-gradient holds inf or NaN on any rank. With no options (the default) none of this runs.

D-Lion outer options (``outer="dlion", outer_options=DLionOuterOptions(...)``)
------------------------------------------------------------------------------

Rank i has its pseudo-gradient d_i = theta_bar - theta_i (fp32), its outer momentum m_i and, with
``error_feedback``, its residual e_i (fp32, zeros at first). With b1, b2 = ``outer_betas``,
lr = ``outer_lr``, wd = ``outer_weight_decay``:

    p_i = d_i + e_i  with error_feedback, else d_i      what rank i asks theta_bar to move
    c_i = b1 m_i + (1 - b1) p_i
    v_i = vote(c_i)               binary: +1 where c > 0, else -1; ternary: sign(c), and with
                                  threshold tau > 0 an element abstains (0) where
                                  |c| < tau * mean|c| over its tensor on this rank
    D   = aggregate(v_1 .. v_n)   the exchange's vote or average (mode, votes), as without options
    s_k = (mean|p_1| + .. + mean|p_n|) / n over tensor k, with ``scale`` (summed in rank order);
          1 without
    u   = s_k D                   per element of tensor k
    theta_bar = theta_bar - lr (u + wd theta_bar)
    e_i = gamma (p_i - lr u)      with error_feedback: what the applied step did not carry, in
                                  pseudo-gradient units; gamma = ``ef_decay`` (1: no decay)
    m_i = b2 m_i + (1 - b2) p_i

That is D-Lion's outer step with p_i in place of d_i, and the step scaled per tensor. A
pseudo-gradient is a displacement (theta_bar - theta_i), and the step theta_bar takes is the
displacement lr s_k D, so e_i is what rank i asked for and theta_bar did not move: it is measured
against the aggregate applied on every rank, not against the rank's own vote. Averaged over
ranks, mean_i e_i after a sync is mean_i (d_i + e_i) minus the step applied, so over syncs the
applied steps add up to the sum of the mean pseudo-gradients minus the current mean residual: a
vote that rounds an element the wrong way, a tie or an abstention is paid back at later syncs,
as long as the steps can keep up (lr s_k at least about the typical |d| per sync). What each
rank asked for apart from the others (d_i minus the ranks' mean) also stays in its e_i and adds
up sync after sync, a random walk that grows until it drowns the rank's new pseudo-gradient in
its vote; ``ef_decay`` gamma < 1 bounds it (to about 1 / (1 - gamma) syncs' worth) at the price
of paying back only that much of a vote's rounding. Without
``scale`` a sign step moves every element by lr, so lr must be of the order of |d| per sync (as
for the plain step); with ``scale`` the step has the ranks' mean |p| per tensor, and lr is about
1 (lr = 1 with ``mode="average"`` and unanimous votes is the plain mean of the pseudo-gradients'
magnitudes).

How it runs: p_i, c_i (and the threshold) are cheap elementwise torch operations; the votes, the two
collectives, the tally and the decode of D are the exchange's fused stages
(``exchange/pipeline.py`` ``Exchange``), applied with lr 1 and no momentum to a zero buffer, which
then holds -D. The scale is one ``all_gather`` of T fp32 words (T = tensors of the fragment),
issued with the exchange and waited for at its finish; theta_bar, e_i and m_i are then updated by
torch elementwise operations. No new hot loop: every backend's stages serve.

Bytes per sync and rank (n ranks, d elements, T tensors): the exchange's, as without options
(``docs/wire-format.md``: vote/binary 2 (n-1)/n d/8 plus padding; a threshold needs ternary votes,
whose wire is 2 bits each way for vote, so twice vote/binary's), plus 4 T (n-1) with ``scale``.
Error feedback and the threshold add nothing on the wire.

Memory per rank: theta_bar and m (8 bytes per element, as without options), plus e (4 bytes per
element) with error feedback; at a sync, p (with error feedback), c, the zero buffer and a
scratch momentum (4 bytes each per element of the syncing fragment) while the exchange runs.

SparseLoCo (``outer="sparseloco"``; Sarfi et al., arXiv 2508.15706), the baseline
----------------------------------------------------------------------------------

Reimplemented from the paper's description. Each rank's outer momentum slot holds its error
feedback accumulator a_i (zeros at first). With beta = ``ef_decay``, C = ``chunk``, k = ``topk``:

    a_i = beta a_i + d_i
    q_i = Q(TopK(a_i))    each tensor is cut into runs of C elements (the last one shorter); a
                          run of r elements keeps its ceil(k r / C) largest |a| (torch.topk);
                          Q sends each kept value as 2 bits: its sign, and whether |a| >= s,
                          s = the mean |a| of the tensor's kept values; the two magnitudes are
                          the means of the kept |a| below s and from s up (0 when none), one
                          pair of fp32 per tensor and rank
    a_i = a_i - q_i       what was not sent stays in the accumulator (error feedback)
    theta_bar = theta_bar - lr ((q_1 + .. + q_n) / n + wd theta_bar)    (summed in rank order)

The ranks exchange their (index, code) lists and magnitudes with one ``all_gather`` (every rank
decodes every rank's list), prefixed by the same 8-byte step header as the D-Lion exchange, so a
non-finite pseudo-gradient on any rank skips (or raises) on every rank alike.

Bytes per sync and rank: (n - 1) (8 + 8 T + 2 K + ceil(K / 4)), K = the elements kept (about
k / C of d): indices travel as 16-bit offsets in their run (so C <= 32768), values as 2 bits. At
the paper's density (k / C = 64 / 4096) that is about 18/64 = 0.28 bit per element per peer;
an all_gather grows with n where the D-Lion exchange's 2 (n-1)/n d/8 does not.

Memory per rank: theta_bar and a_i (8 bytes per element); at a sync the new accumulator, this
rank's sent values, the sum of the decoded values and one rank's decoded values (4 bytes each
per element of the fragment).

Neither option set runs on an FSDP2-sharded model (``device_mesh=``): refused at construction.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch

from ..exchange.collectives import collective, wait
from ..exchange.header import decide, make_header
from ..exchange.pipeline import (
    Exchange,
    NonFiniteGradientError,
    Row,
    Segment,
    StepStats,
    all_gather,
    resolve_group,
)
from ..kernels.layout import HEADER_WORDS

SCALES = "all_gather(outer scales)"
SPARSE = "all_gather(sparse pseudo-gradients)"
_HEADER_BYTES = 4 * HEADER_WORDS
_MAX_CHUNK = 32768  # offsets in a run travel as int16


def _real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value)


@dataclass(frozen=True)
class DLionOuterOptions:
    """Options of the 1-bit D-Lion outer step (module docstring): ``error_feedback`` (a per-rank
    fp32 residual of what the applied step did not carry), ``scale`` (each tensor's step takes
    the ranks' mean |p|, one fp32 per tensor and rank on the wire), ``threshold`` (tau >= 0:
    with ternary votes, elements with |p| < tau * mean|p| of their tensor abstain) and
    ``ef_decay`` (gamma in (0, 1]: the residual is multiplied by gamma at every sync; needs
    ``error_feedback``). All off: the plain step. ``error_feedback=True, ef_decay=0.5`` came
    within 1% of DiLoCo-Nesterov's loss in the outer study of docs/diloco.md."""

    error_feedback: bool = False
    scale: bool = False
    threshold: float = 0.0
    ef_decay: float = 1.0

    def __post_init__(self):
        for name in ("error_feedback", "scale"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"DLionOuterOptions.{name} must be a bool, got "
                                f"{getattr(self, name)!r}")
        if not _real(self.threshold) or self.threshold < 0:
            raise ValueError(f"DLionOuterOptions.threshold must be a finite number >= 0, got "
                             f"{self.threshold!r}")
        if not _real(self.ef_decay) or not 0.0 < self.ef_decay <= 1.0:
            raise ValueError(f"DLionOuterOptions.ef_decay must be a number in (0, 1], got "
                             f"{self.ef_decay!r}")
        if self.ef_decay < 1.0 and not self.error_feedback:
            raise ValueError("DLionOuterOptions.ef_decay < 1 needs error_feedback=True")

    @property
    def active(self) -> bool:
        return self.error_feedback or self.scale or self.threshold > 0


@dataclass(frozen=True)
class SparseLoCoOptions:
    """SparseLoCo's settings (module docstring): ``chunk`` C (elements per run, <= 32768), ``topk``
    k kept per full run (1 <= k <= C), ``ef_decay`` beta in [0, 1]. Defaults: C = 4096, k = 64
    (1.56% of the elements), beta = 0.95, our reading of the paper's main setting."""

    chunk: int = 4096
    topk: int = 64
    ef_decay: float = 0.95

    def __post_init__(self):
        if not isinstance(self.chunk, int) or isinstance(self.chunk, bool) \
                or not 1 <= self.chunk <= _MAX_CHUNK:
            raise ValueError(f"SparseLoCoOptions.chunk must be an int in [1, {_MAX_CHUNK}], got "
                             f"{self.chunk!r}")
        if not isinstance(self.topk, int) or isinstance(self.topk, bool) \
                or not 1 <= self.topk <= self.chunk:
            raise ValueError(f"SparseLoCoOptions.topk must be an int in [1, chunk={self.chunk}], "
                             f"got {self.topk!r}")
        if not _real(self.ef_decay) or not 0.0 <= self.ef_decay <= 1.0:
            raise ValueError(f"SparseLoCoOptions.ef_decay must be a number in [0, 1], got "
                             f"{self.ef_decay!r}")

    def kept(self, numel: int) -> int:
        """Elements kept of a tensor of ``numel`` elements."""
        full, rest = divmod(numel, self.chunk)
        return full * self.topk + (-(-self.topk * rest // self.chunk) if rest else 0)


def check(outer: str, options, votes: str, sharded: bool):
    """The options as a dataclass (None: none), after checking they fit ``outer``; ValueError or
    TypeError naming ``outer_options`` otherwise."""
    if options is None and outer != "sparseloco":
        return None
    if options is None:
        options = SparseLoCoOptions()
    kind = {"dlion": DLionOuterOptions, "sparseloco": SparseLoCoOptions}.get(outer)
    if kind is None:
        raise ValueError(f"outer_options applies to outer='dlion' or 'sparseloco', not "
                         f"outer={outer!r}")
    if isinstance(options, dict):
        try:
            options = kind(**options)
        except TypeError as e:
            raise TypeError(f"outer_options for outer={outer!r}: {e}") from None
    if not isinstance(options, kind):
        raise TypeError(f"outer_options for outer={outer!r} must be a {kind.__name__} or a dict "
                        f"of its fields, got {type(options).__name__}")
    if isinstance(options, DLionOuterOptions):
        if options.threshold > 0 and votes != "ternary":
            raise ValueError("outer_options threshold > 0 needs votes='ternary' (an element "
                             "abstains by voting 0), got votes=" + repr(votes))
        if not options.active:
            return None  # all off: the plain step
    if sharded:
        raise ValueError("outer_options and outer='sparseloco' are not supported on an "
                         "FSDP2-sharded model (device_mesh=)")
    return options


def runtime(diloco):
    """The object that runs ``diloco``'s outer step with its options, or None (the plain step)."""
    options = diloco.outer_options
    if options is None:
        return None
    if isinstance(options, SparseLoCoOptions):
        return SparseLoCo(options, diloco)
    return DLionOptions(options, diloco)


def check_state(runner, state_dict: dict) -> None:
    """ValueError unless ``state_dict``'s option state fits ``runner`` (None: no options)."""
    saved = state_dict.get("outer_options")
    if runner is None:
        if saved is not None:
            raise ValueError(f"state_dict was saved with outer_options {saved.get('options')!r}; "
                             "this DiLoCo has none")
        return
    runner.check_state(saved)


class _Runner:
    """What both option sets share: the DiLoCo's settings and the state of each fragment."""

    def __init__(self, options, diloco):
        self.options, self.diloco = options, diloco
        self.fragments = diloco.fragment_states

    def state_dict(self) -> dict:
        return {"options": asdict(self.options), "kind": type(self.options).__name__,
                "residual": [None if r is None else r.clone() for r in self.residuals()]}

    def residuals(self) -> list:
        """One flat fp32 error-feedback residual per fragment, None where there is none."""
        return [None] * len(self.fragments)

    def check_state(self, saved) -> None:
        mine = {"options": asdict(self.options), "kind": type(self.options).__name__}
        if not isinstance(saved, dict) or {k: saved.get(k) for k in mine} != mine:
            got = None if not isinstance(saved, dict) else saved.get("options")
            raise ValueError(f"state_dict was saved with outer_options {got!r}, this DiLoCo has "
                             f"{mine['options']!r} ({mine['kind']})")
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


# ----------------------------------------------------------------------------- D-Lion options


class DLionOptions(_Runner):
    """The D-Lion outer step with options (module docstring)."""

    def __init__(self, options: DLionOuterOptions, diloco):
        super().__init__(options, diloco)
        self.residual = [torch.zeros_like(f.theta) if options.error_feedback else None
                         for f in self.fragments]
        # the exchange only votes: c = 0 * m + 1 * p, x = 0 - 1 * (D + 0 x), m kept (b2 = 1)
        self.segment = Segment([], [], [], 1.0, 0.0, 1.0, 0.0)

    def residuals(self) -> list:
        return self.residual

    def start(self, fragment, grad: torch.Tensor, step: int):
        dl = self.diloco
        b1 = dl.outer_betas[0]
        e = self.residual[fragment.index]
        p = grad + e if e is not None else grad
        c = fragment.momentum * b1
        c += p * (1.0 - b1)
        if self.options.threshold > 0:
            for view in fragment.views(c):
                bound = view.abs().mean() * self.options.threshold
                view.masked_fill_(view.abs() < bound, 0.0)
        return _DLionSync(self, fragment, p, c, step)


class _DLionSync:
    """One sync with options: the exchange and the scales' gather in flight, then the apply."""

    def __init__(self, runner: DLionOptions, fragment, p, vote_input, step):
        dl = runner.diloco
        self.runner, self.fragment, self.p, self.step = runner, fragment, p, step
        self.zero = torch.zeros_like(p)  # becomes -D
        scratch = torch.zeros_like(p)
        ex = Exchange(device=p.device, mode=dl.mode, votes=dl.votes, group=dl.group,
                      backend=dl.backend, step=step, nonfinite=dl.nonfinite,
                      streams=dl.streams, timeout=dl.timeout)
        rows = [Row(x, g, m, off, runner.segment) for x, g, m, off in zip(
            fragment.views(self.zero), fragment.views(vote_input), fragment.views(scratch),
            fragment.offsets)]
        ex.add(rows, fragment.blocks)
        self.exchange, self.backend = ex, ex.backend
        self.work, self.scales, self.scale_bytes = None, None, 0
        if runner.options.scale:
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
            wait(work, self.step, SCALES, self.runner.diloco.timeout)

    def abandon(self) -> None:
        self.exchange.abandon()
        self._wait()

    def finish(self, agree=None):
        try:
            stats = self.exchange.finish(agree=agree)
        finally:
            self._wait()  # the gather is paired on every rank whatever the exchange did
        if not stats.skipped:
            self._apply()
        sent = stats.bytes_sent + self.scale_bytes
        return replace(stats, bytes_sent=sent, bytes_received=sent)

    def _apply(self) -> None:
        dl, fragment, runner = self.runner.diloco, self.fragment, self.runner
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
        lr, wd = dl.outer_lr, dl.outer_weight_decay
        step = u + fragment.theta * wd if wd else u
        fragment.theta.sub_(step * lr)
        e = runner.residual[fragment.index]
        if e is not None:
            torch.sub(self.p, u * lr, out=e)
            if runner.options.ef_decay < 1.0:  # each rank's own drift, bounded
                e.mul_(runner.options.ef_decay)
        b2 = dl.outer_betas[1]
        fragment.momentum.mul_(b2)
        fragment.momentum.add_(self.p * (1.0 - b2))


# ----------------------------------------------------------------------------- SparseLoCo


class SparseLoCo(_Runner):
    """SparseLoCo's outer step (module docstring); the accumulator is the fragment's momentum."""

    def __init__(self, options: SparseLoCoOptions, diloco):
        super().__init__(options, diloco)
        self.layouts = [self._layout(f) for f in self.fragments]

    def _layout(self, fragment):
        """Per tensor: (elements kept, byte offsets of its magnitudes, indices and codes)."""
        kept = [self.options.kept(k) for k in fragment.numels]
        total = sum(kept)
        T = len(kept)
        size = _HEADER_BYTES + 8 * T + 2 * total + -(-total // 4)
        return kept, total, size

    def payload_bytes(self, fragment) -> int:
        """Bytes of one rank's payload for ``fragment``."""
        return self.layouts[fragment.index][2]

    def start(self, fragment, grad: torch.Tensor, step: int):
        return _SparseSync(self, fragment, grad, step)

    def compress(self, acc_view: torch.Tensor):
        """(kept offsets in the tensor (int64, run by run), their 2-bit codes (uint8), the two
        magnitudes (fp32 [2])) of one tensor's accumulator (flat)."""
        C, k = self.options.chunk, self.options.topk
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


def _decode_values(codes: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
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


class _SparseSync:
    """One SparseLoCo sync: the payload's gather in flight, then the apply."""

    backend = None

    def __init__(self, runner: SparseLoCo, fragment, grad, step):
        dl = runner.diloco
        self.runner, self.fragment, self.step = runner, fragment, step
        size = runner.layouts[fragment.index][2]
        self.acc = fragment.momentum * runner.options.ef_decay
        self.acc += grad
        self.sent_values = torch.zeros_like(self.acc)
        flag = torch.isfinite(grad).all().logical_not().to(torch.int32).view(1)
        magnitudes, indices, codes = [], [], []
        for view, start in zip(fragment.views(self.acc), _starts(fragment.numels)):
            flat = view.reshape(-1)
            index, code, levels = runner.compress(flat)
            run = index % runner.options.chunk
            indices.append(run.to(torch.int16))
            codes.append(code)
            magnitudes.append(levels)
            self.sent_values[start + index] = _decode_values(code, levels)
        # [header | T magnitude pairs (fp32) | K run offsets (int16) | K 2-bit codes]
        payload = torch.cat([make_header(flag, step).view(torch.uint8),
                             torch.cat(magnitudes).view(torch.uint8),
                             torch.cat(indices).view(torch.uint8),
                             _pack_codes(torch.cat(codes))])
        self.payload = payload  # alive until the gather is done
        self.group, self.n = dl.group, dl.world_size
        self.gathered = torch.empty(self.n * size, dtype=torch.uint8, device=self.acc.device)
        self.work, self.sent = None, 0
        if self.n == 1:
            self.gathered.copy_(payload)
        else:
            group = _group(dl.group)
            self.work = collective(SPARSE, step, all_gather, self.gathered, payload, group,
                                   async_op=True)
            self.sent = (self.n - 1) * size

    def _wait(self) -> None:
        if self.work is not None:
            work, self.work = self.work, None
            wait(work, self.step, SPARSE, self.runner.diloco.timeout)

    def abandon(self) -> None:
        self._wait()

    def finish(self, agree=None):
        self._wait()
        dl, fragment = self.runner.diloco, self.fragment
        kept, total, size = self.runner.layouts[fragment.index]
        rows = self.gathered.view(self.n, size)
        headers = rows[:, :_HEADER_BYTES].clone().view(torch.int32).view(self.n, HEADER_WORDS)
        if agree is not None:
            headers = agree(headers.unsqueeze(0)).reshape(-1, HEADER_WORDS)
        skipped = decide(headers)
        if skipped and dl.nonfinite == "raise":
            raise NonFiniteGradientError("a pseudo-gradient holds inf or NaN on at least one rank")
        if not skipped:
            mean = self._decode(rows, kept, total)
            lr, wd = dl.outer_lr, dl.outer_weight_decay
            step = mean + fragment.theta * wd if wd else mean
            fragment.theta.sub_(step * lr)
            torch.sub(self.acc, self.sent_values, out=fragment.momentum)
        return StepStats(self.sent, self.sent, fragment.numel, self.n, "sparse", "2-bit",
                         "torch", skipped=skipped)

    def _decode(self, rows, kept, total) -> torch.Tensor:
        """The mean of the ranks' sent values: each decoded dense, summed in rank order, / n."""
        fragment, C = self.fragment, self.runner.options.chunk
        T = len(kept)
        total_sum, device = torch.zeros_like(self.acc), self.acc.device
        run_bases = []
        for numel, k in zip(fragment.numels, kept):
            full, rest = divmod(numel, C)
            per = [self.runner.options.topk] * full + ([k - full * self.runner.options.topk]
                                                        if rest else [])
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
                dense[index] = _decode_values(codes[pos: pos + k], levels[t])
                pos += k
            total_sum += dense
        return total_sum / self.n


def _starts(numels) -> list:
    out, at = [], 0
    for k in numels:
        out.append(at)
        at += k
    return out


def _group(group):
    return resolve_group(group)[0]


__all__ = ["DLionOuterOptions", "SparseLoCoOptions"]
