"""Gossip schedules (dlion_kernels/topologies.py): pure functions of (n, L, t)."""

import pytest
import torch

from dlion_kernels.topologies import period, schedule


def _valid(groups, n):
    """Disjoint, covering every rank once, each sorted."""
    flat = [r for g in groups for r in g]
    assert sorted(flat) == list(range(n))
    assert all(list(g) == sorted(g) for g in groups)


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16, 3, 5])
def test_complete(n):
    assert schedule("complete", n, 1, 7) == [tuple(range(n))]
    assert period("complete", n) == 1


@pytest.mark.parametrize("n", [2, 4, 6, 8])
def test_ring(n):
    even = schedule("ring", n, 1, 0)
    odd = schedule("ring", n, 1, 1)
    assert even == [(2 * k, 2 * k + 1) for k in range(n // 2)]
    assert set(odd) == {tuple(sorted((2 * k + 1, (2 * k + 2) % n))) for k in range(n // 2)}
    assert schedule("ring", n, 1, 4) == even and schedule("ring", n, 1, 7) == odd
    _valid(odd, n)
    if n == 6:
        assert odd == [(0, 5), (1, 2), (3, 4)]


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_one_peer_exp(n):
    rounds = n.bit_length() - 1
    assert period("one-peer-exp", n) == rounds
    for t in range(2 * rounds + 1):
        groups = schedule("one-peer-exp", n, 1, t)
        _valid(groups, n)
        bit = 1 << (t % rounds)
        assert all(len(g) == 2 and g[0] ^ g[1] == bit for g in groups)
    # after log2 n steps every rank has (indirectly) mixed with every other: product of the
    # matrices is the full average
    W = torch.eye(n, dtype=torch.float64)
    for t in range(rounds):
        M = torch.zeros(n, n, dtype=torch.float64)
        for g in schedule("one-peer-exp", n, 1, t):
            for i in g:
                for j in g:
                    M[i, j] = 1.0 / len(g)
        W = M @ W
    torch.testing.assert_close(W, torch.full((n, n), 1.0 / n, dtype=torch.float64))


@pytest.mark.parametrize("n, L", [(4, 2), (8, 2), (8, 4), (16, 4), (2, 1), (4, 1)])
def test_alternating_exp_ring(n, L):
    nodes = n // L
    rounds = nodes.bit_length() - 1
    assert period("alternating-exp-ring", n, L) == 2 * rounds
    for t in range(4 * rounds):
        groups = schedule("alternating-exp-ring", n, L, t)
        _valid(groups, n)
        bit = 1 << ((t // 2) % rounds)
        pairs = [(u, u ^ bit) for u in range(nodes) if u < u ^ bit]
        for p, (u, w) in enumerate(pairs):
            node_u, node_w = tuple(range(u * L, u * L + L)), tuple(range(w * L, w * L + L))
            if (t + p) % 2:  # this pair averages over its 2L ranks
                assert node_u + node_w in groups
            else:  # inside each node
                assert node_u in groups and node_w in groups
        # every pair does both phases within each round (opposite phase for neighbours)
    if nodes >= 4:
        t0 = schedule("alternating-exp-ring", n, L, 0)
        assert tuple(range(L)) in t0  # pair 0 starts inside its nodes
        assert tuple(range(2 * L, 3 * L)) + tuple(range(3 * L, 4 * L)) in t0  # pair 1: across


@pytest.mark.parametrize(
    "name, n, L, match",
    [
        ("ring", 3, 1, "even"),
        ("ring", 5, 1, "even"),
        ("one-peer-exp", 6, 1, "power-of-two"),
        ("one-peer-exp", 3, 1, "power-of-two"),
        ("alternating-exp-ring", 6, 2, "power-of-two"),
        ("alternating-exp-ring", 4, 4, "power-of-two"),
        ("alternating-exp-ring", 6, 4, "multiple"),
        ("mesh", 4, 1, "one of"),
    ],
)
def test_unsupported_sizes(name, n, L, match):
    with pytest.raises(ValueError, match=match):
        schedule(name, n, L, 0)
