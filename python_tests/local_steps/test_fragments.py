"""Streaming DiLoCo's cut and schedule (local_steps/fragments.py), without processes."""

import pytest

from dlion_kernels.local_steps import fragments as frag


@pytest.mark.parametrize("numels,parts", [
    ([10, 10, 10, 10], 2), ([10, 10, 10, 10], 4), ([1, 100, 1, 1, 1, 100], 3),
    ([231, 33, 99, 3, 5], 3), ([7], 1), ([3, 1000, 2], 3), ([5, 5, 5, 5, 5, 5, 5], 4),
])
def test_split_partitions_whole_tensors_in_order(numels, parts):
    cuts = frag.split(numels, parts)
    assert len(cuts) == parts
    assert [i for c in cuts for i in c] == list(range(len(numels)))  # contiguous, in order
    assert all(len(c) >= 1 for c in cuts)
    total, biggest = sum(numels), max(numels)
    for c in cuts:  # within one largest tensor of an even share
        assert abs(sum(numels[i] for i in c) - total / parts) <= biggest


def test_split_cuts_at_the_nearest_boundary():
    # targets 25, 50, 75 fall on boundaries exactly
    assert frag.split([25, 25, 25, 25], 4) == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    # target 50: boundaries at 40 (|10|) and 70 (|20|): the cut is after the second tensor
    assert frag.split([20, 20, 30, 30], 2) == [range(0, 2), range(2, 4)]
    # a tie (45 and 55 around 50) goes to the earlier boundary
    assert frag.split([45, 10, 45], 2) == [range(0, 1), range(1, 3)]
    # one huge tensor first: every later fragment still gets a tensor
    assert frag.split([1000, 1, 1], 3) == [range(0, 1), range(1, 2), range(2, 3)]


def test_split_refuses_more_fragments_than_tensors():
    with pytest.raises(ValueError, match="fragments must be at most the number of trainable"):
        frag.split([4, 4], 3)


@pytest.mark.parametrize("H,P", [(1, 1), (8, 1), (8, 2), (8, 4), (12, 3), (6, 6)])
def test_schedule(H, P):
    """Fragment f syncs exactly at t with t mod H == ((f + 1) H / P) mod H: one fragment every
    H / P steps, each fragment once per H steps, the last one at the multiples of H."""
    seen = []
    for t in range(1, 3 * H + 1):
        f = frag.due(t, H, P)
        expected = [g for g in range(P) if t % H == (g + 1) * H // P % H]
        assert (expected == [] and f is None) or expected == [f], (t, f, expected)
        if f is not None:
            assert frag.phase(f, H, P) == t % H
            seen.append((t, f))
    assert [t for t, _ in seen] == list(range(H // P, 3 * H + 1, H // P))
    assert frag.due(H, H, P) == P - 1 and frag.due(0, H, P) is None
