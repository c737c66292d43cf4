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

On an FSDP2-sharded model (``device_mesh=``, or a replica of several ranks on torchft) every
rank runs the step on its local shards: "a tensor" above is then this rank's shard of it (the
threshold's mean|c|, the scale's mean|p|, SparseLoCo's runs and kept values are per shard), and
the vote, the scales' gather and SparseLoCo's gather run between the replicas of each shard.
Error feedback, being elementwise, gives the same residuals as on the whole tensor.

How each runs (the exchange, the gathers, the applies): ``outer.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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


# What ``outer="dlion"`` runs when no options are given: error feedback whose residual is halved
# at every sync. On simulated workers (the chars task, 4 workers, H = 8, 32 and 64, a quarter of
# the outer study's budget and all of it) it came within 1.3% of the best outer lr's loss with
# the default outer lr (``default_outer_lr``), where the plain step ended 7-13% above it at the
# full budget: bench/results/sim-sweep-20261128/. The plain step is
# ``outer_options=DLionOuterOptions()`` (every option off).
DEFAULT_DLION_OPTIONS = DLionOuterOptions(error_feedback=True, ef_decay=0.5)


def default_outer_lr(outer: str, options, inner_lr: float, sync_every: int) -> float:
    """The outer lr when none is given. The sign step moves every element by about outer_lr per
    sync whatever the pseudo-gradient's size, so D-Lion's scales with how far the inner steps
    move: 1.1 x inner lr x sqrt(H) with error feedback (its best lr grows about as sqrt(H)),
    0.16 x inner lr x H for the plain step (the best rule of the same sweep; it misses by up to
    4%, its best lr moving with the budget). DiLoCo's 0.7 for Nesterov, 1 for SparseLoCo."""
    if outer == "nesterov":
        return 0.7
    if outer == "sparseloco":
        return 1.0
    if options is None:  # the plain step
        return 0.16 * inner_lr * sync_every
    return 1.1 * inner_lr * math.sqrt(sync_every)


def check(outer: str, options, votes: str):
    """The options as a dataclass (None: the plain step), after checking they fit ``outer``
    (None: the default, ``DEFAULT_DLION_OPTIONS`` for "dlion"); ValueError or TypeError naming
    ``outer_options`` otherwise."""
    if options is None and outer == "nesterov":
        return None
    if options is None:
        options = DEFAULT_DLION_OPTIONS if outer == "dlion" else SparseLoCoOptions()
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
    return options


__all__ = ["DEFAULT_DLION_OPTIONS", "DLionOuterOptions", "SparseLoCoOptions", "default_outer_lr"]
