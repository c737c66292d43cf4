"""The per-rank step header: a few int32 words every rank sends before the votes.

Layout (``HEADER_WORDS`` int32 words per rank):

    word 0  flags: bit 0 (``NONFINITE``) = this rank has an inf/NaN gradient (or, under a
            GradScaler, an overflow); bit 1 (``pipeline.ABORTED``) = this rank gave the step
            up; bits 2-30 (``SETTINGS_SHIFT``): a 29-bit digest of the settings the step
            applies with (every param group's lr, betas and weight_decay; 0 where the caller
            has none), so that ranks set apart (a learning rate changed on one rank only) skip
            the step together and raise instead of drifting apart
    word 1  the step counter modulo 2**31 (the tie rule's step, ``DistributedLion``'s step),
            copied on the device from the counter tensor when the step has one (a step captured
            in a CUDA graph reads it at every replay)

All ranks all-gather their headers, so every rank takes the same decision from the same words:
skip when any rank flags a non-finite gradient, and raise on every rank when the ranks are not on
the same step (their collectives would otherwise pair different steps silently). The header is
built on the gradients' device without reading anything back, so the only host sync of the
decision is the one read of the gathered headers.
"""

from __future__ import annotations

import struct
import zlib

import torch

from ..kernels.layout import HEADER_WORDS

NONFINITE = 1  # flag bit
_STEP_MOD = 2**31
SETTINGS_SHIFT, _SETTINGS_MASK = 2, (1 << 29) - 1


def settings_digest(segments) -> int:
    """A 29-bit digest of the settings of ``segments`` (``pipeline.Segment``: lr, beta1, beta2,
    weight_decay of each param group), for the header's word 0; 0 for None."""
    if not segments:
        return 0
    values = [float(v) for s in segments for v in (s.lr, s.beta1, s.beta2, s.weight_decay)]
    return zlib.crc32(struct.pack(f"<{len(values)}d", *values)) & _SETTINGS_MASK


def settings_word(flags: int, segments) -> int:
    """Word 0 of a header: ``flags`` and the settings digest of ``segments``."""
    return int(flags) | settings_digest(segments) << SETTINGS_SHIFT


def settings_differ(words: torch.Tensor) -> torch.Tensor:
    """From word 0 of the gathered headers [..., n]: whether two ranks' settings digests differ
    in any row (a device tensor, not read back)."""
    digests = words >> SETTINGS_SHIFT
    return (digests != digests[..., :1]).any()


class StepMismatchError(RuntimeError):
    """Ranks of one group called the step with different step counters; nothing was modified."""


def make_header(flag: torch.Tensor, step, word: int = 0, counter=None) -> torch.Tensor:
    """This rank's header on ``flag``'s device; ``flag`` is an int32 [1] tensor, nonzero for a
    non-finite gradient (it is not read back here); ``word``: further bits of word 0 (the
    settings digest, ``settings_word``). The step word is ``step`` (an int), or, with
    ``counter`` (the step counter, an int64 [1] tensor on that device), the counter's value,
    copied there without reading it back."""
    header = torch.empty(HEADER_WORDS, dtype=torch.int32, device=flag.device)
    header[0:1] = (flag != 0).to(torch.int32) * NONFINITE | word
    if counter is not None:
        header[1:2] = (counter.reshape(1) % _STEP_MOD).to(torch.int32)
    else:
        header[1:2].fill_(step % _STEP_MOD)  # a kernel argument: item assignment copies from host
    return header


class SettingsMismatchError(ValueError):
    """Ranks of one group stepped with different settings (a param group's lr, betas or
    weight_decay set on some ranks only); nothing was modified."""


def check_settings(rows, step=None) -> None:
    """From the host rows [n][2+] of one bucket's headers: ``SettingsMismatchError`` (the same on
    every rank) when two ranks' settings digests differ."""
    digests = [row[0] >> SETTINGS_SHIFT for row in rows]
    odd = [r for r, d in enumerate(digests) if d != digests[0]]
    if odd:
        raise SettingsMismatchError(
            f"D-Lion step {step}: ranks {odd} of the exchange's group set other param group "
            "settings (lr, betas, weight_decay) than rank 0; nothing was updated on any rank. "
            "Set the same values on every rank (an LR scheduler stepped alike everywhere)")


def decide(headers: torch.Tensor, step=None) -> bool:
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
    check_settings(rows, step)
    return any(row[0] & NONFINITE for row in rows)
