"""The packed formats that the three stages exchange (the wire format).

Element space. The tensors of one step are laid end to end in *blocks* of 32 elements. Tensor t
owns blocks ``offsets[t] .. offsets[t] + ceil(numel_t / 32)``: every tensor starts on a block
boundary, so a tensor wastes at most 31 bit positions of padding, and the element index inside a
tensor has the same parity as its bit position in the word (the binary tie rule relies on that).

Packed vectors. A packed vector with P *bit planes* stores block b in the P int32 words
``P*b .. P*b + P - 1``; word ``P*b + p`` holds plane p, and bit j (LSB first) of that word
belongs to element ``32*b + j``. Bits past the end of a tensor are 0.

- votes, binary:   P = 1, bit = 1 where c > 0 (vote +1), 0 otherwise (vote -1; 0, -0, NaN).
- votes, ternary:  P = 2, plane 0 = "c > 0" (vote +1), plane 1 = "c < 0" (vote -1); neither
  bit set is an abstention (c = 0). Both bits are never set together.
- aggregate, vote/binary:  P = 1, bit = 1 for D = +1, 0 for D = -1.
- aggregate, vote/ternary: P = 2, same encoding as ternary votes (D in {+1, 0, -1}).
- aggregate, average/binary:  P = ceil(log2(n+1)) = n.bit_length(); plane p holds bit p of k,
  the number of +1 votes (0..n). D = (2k - n) / n.
- aggregate, average/ternary: P = ceil(log2(2n+1)) = (2n).bit_length(); plane p holds bit p of
  q = (#plus) - (#minus) + n (0..2n). D = (q - n) / n.

Even-n binary tie (k == n/2): D = +1 where (j + step) is even, -1 where it is odd, j being the
element's bit position (equivalently its index inside its tensor) and ``step`` the step counter.
Half the tied elements of a step go each way, and a given element alternates between steps.
"""

from __future__ import annotations

import math

BLOCK = 32  # elements per packed int32 word
WORD_BYTES = 4  # bytes of one packed int32 word
# int32 words of the per-rank step header (non-finite flag, step counter) that lead every rank's
# all_to_all chunk; ``exchange/header.py`` builds and reads them.
HEADER_WORDS = 2
# The most vote vectors one tally counts, on every backend (16-bit-plane counters of the ternary
# biased count q <= 2n; csrc/common.h kMaxVoters). Above it the stages raise ValueError.
MAX_VOTERS = 32767


def num_blocks(numel: int) -> int:
    return (numel + BLOCK - 1) // BLOCK


def block_offsets(numels) -> tuple[list[int], int]:
    """Block offset of each tensor and the total number of blocks."""
    offsets, total = [], 0
    for numel in numels:
        offsets.append(total)
        total += num_blocks(numel)
    return offsets, total


def vote_planes(votes: str) -> int:
    return 1 if votes == "binary" else 2


def aggregate_planes(mode: str, votes: str, n: int) -> int:
    if mode == "vote":
        return vote_planes(votes)
    return n.bit_length() if votes == "binary" else (2 * n).bit_length()


def shard_blocks(total_blocks: int, n: int) -> int:
    """Blocks owned by each rank: the vote vector is zero-padded to n equal shards."""
    return max(1, math.ceil(total_blocks / n))


def tie_pattern(step: int) -> int:
    """Bits that win a binary tie at this step, as an int32 word (see the module docstring)."""
    return 0x55555555 if step % 2 == 0 else -0x55555556  # 0xAAAAAAAA as a signed int32
