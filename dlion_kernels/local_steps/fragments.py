"""Streaming DiLoCo's fragments (Douillard et al., arXiv 2501.18512) as pure functions: how the
parameters are cut and when each fragment syncs. No tensors, so tests and the runtime model can
use them without a process group.

Cut: the tensors, in ``model.parameters()`` order, become P contiguous runs of whole tensors. The
cut before fragment f (f = 1 .. P-1) is the tensor boundary whose running element count is
nearest to f * total / P (a tie goes to the earlier boundary), among the boundaries that leave at
least one tensor to every fragment. So each run's size is within one largest tensor of total / P
(within half of one on each side of every cut, when no fragment is short of tensors).

Schedule (streaming DiLoCo): fragment f syncs at the inner steps t = 1, 2, ... with
t mod H == ((f + 1) * H / P) mod H, H = sync_every, a multiple of P. One fragment syncs every
H / P steps; fragment P - 1 syncs at the multiples of H, as plain DiLoCo's single fragment does.
"""

from __future__ import annotations


def split(numels, parts: int) -> list[range]:
    """The tensor index ranges of the ``parts`` fragments of tensors of sizes ``numels``."""
    numels = list(numels)
    if parts > len(numels):
        raise ValueError(f"fragments must be at most the number of trainable tensors "
                         f"({len(numels)}), got {parts}")
    prefix = [0]
    for k in numels:
        prefix.append(prefix[-1] + k)
    total, count = prefix[-1], len(numels)
    cuts = [0]
    for f in range(1, parts):
        target = f * total / parts
        lo, hi = cuts[-1] + 1, count - (parts - f)  # every fragment keeps a tensor
        cuts.append(min(range(lo, hi + 1), key=lambda k: (abs(prefix[k] - target), k)))
    cuts.append(count)
    return [range(a, b) for a, b in zip(cuts, cuts[1:])]


def phase(fragment: int, sync_every: int, fragments: int) -> int:
    """t mod H at which ``fragment`` syncs."""
    return (fragment + 1) * (sync_every // fragments) % sync_every


def due(step: int, sync_every: int, fragments: int) -> int | None:
    """The fragment that syncs at inner step ``step`` (from 1), or None."""
    every = sync_every // fragments
    if step < 1 or step % every:
        return None
    return (step % sync_every) // every - 1 if step % sync_every else fragments - 1
