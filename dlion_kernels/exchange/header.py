"""The per-rank step header: a few int32 words every rank sends before the votes.

Layout (``HEADER_WORDS`` int32 words per rank):

    word 0  flags: bit 0 (``NONFINITE``) = this rank has an inf/NaN gradient (or, under a
            GradScaler, an overflow)
    word 1  the step counter modulo 2**31 (the tie rule's step, ``DistributedLion``'s step)

All ranks all-gather their headers, so every rank takes the same decision from the same words:
skip when any rank flags a non-finite gradient, and raise on every rank when the ranks are not on
the same step (their collectives would otherwise pair different steps silently). The header is
built on the gradients' device without reading anything back, so the only host sync of the
decision is the one read of the gathered headers.
"""

from __future__ import annotations

import torch

from ..kernels.layout import HEADER_WORDS

NONFINITE = 1  # flag bit
_STEP_MOD = 2**31


class StepMismatchError(RuntimeError):
    """Ranks of one group called the step with different step counters; nothing was modified."""


def make_header(flag: torch.Tensor, step: int) -> torch.Tensor:
    """This rank's header on ``flag``'s device; ``flag`` is an int32 [1] tensor, nonzero for a
    non-finite gradient (it is not read back here)."""
    header = torch.empty(HEADER_WORDS, dtype=torch.int32, device=flag.device)
    header[0:1] = (flag != 0).to(torch.int32) * NONFINITE
    header[1] = step % _STEP_MOD
    return header


def decide(headers: torch.Tensor) -> bool:
    """From the gathered headers [n, HEADER_WORDS]: whether any rank flagged a non-finite
    gradient. Raises ``StepMismatchError`` (the same on every rank) when the steps differ."""
    rows = headers.view(-1, HEADER_WORDS).tolist()  # the one host read of the decision
    steps = [row[1] for row in rows]
    if len(set(steps)) > 1:
        first = next(r for r, s in enumerate(steps) if s != steps[0])
        raise StepMismatchError(
            f"ranks of the process group are on different steps: rank 0 is at step {steps[0]}, "
            f"rank {first} at step {steps[first]} (all steps: {steps}); nothing was updated on "
            "any rank. Every rank must load the same checkpoint step and call step() the same "
            "number of times"
        )
    return any(row[0] & NONFINITE for row in rows)
