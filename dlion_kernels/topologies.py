"""Gossip topologies of decentralized training: the rules, without torch.

Each step t's mixing matrix W(t) is a set of disjoint groups of ranks that average with equal
weights (so W(t) is doubly stochastic and the mean over ranks is kept). ``schedule(name, n, L, t)``
is the pure function that gives those groups; ``decentralized/topology.py`` binds it to a process
group, and the runtime model (``plan/model.py``) averages its cost over ``period`` steps.

- ``complete``: all n ranks, weight 1/n.
- ``ring`` (n even): t even pairs (2k, 2k+1), t odd pairs (2k+1, 2k+2 mod n).
- ``one-peer-exp`` (n a power of two): rank j pairs with j XOR 2^(t mod log2 n).
- ``alternating-exp-ring`` (nodes of L consecutive ranks, N = n / L nodes, N a power of two >= 2):
  round r = (t // 2) mod log2 N pairs node u with u XOR 2^r; pair number p (pairs counted from the
  lowest node index up) averages over its 2L ranks at steps with (t + p) odd and inside each of
  its two nodes at the other steps, so neighbouring pairs are in opposite phase.

n = 1 is allowed for every topology: the one rank is its own group (no communication).
"""

from __future__ import annotations

TOPOLOGIES = ("complete", "ring", "one-peer-exp", "alternating-exp-ring")


def _log2_exact(value: int) -> int | None:
    return value.bit_length() - 1 if value > 0 and value & (value - 1) == 0 else None


def problem(name: str, n: int, local: int = 1) -> str | None:
    """Why the topology ``name`` cannot run on n ranks in nodes of ``local`` ranks (a sentence
    naming what it allows), or None when it can. ``local`` matters to alternating-exp-ring only."""
    if name not in TOPOLOGIES:
        return f"topology must be one of {TOPOLOGIES}, got {name!r}"
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        return f"the world size must be an integer >= 1, got {n!r}"
    if n == 1:
        return None
    if name == "ring" and n % 2:
        return f"topology 'ring' needs an even number of ranks, got {n}"
    if name == "one-peer-exp" and _log2_exact(n) is None:
        return f"topology 'one-peer-exp' needs a power-of-two number of ranks, got {n}"
    if name == "alternating-exp-ring":
        if isinstance(local, bool) or not isinstance(local, int) or local < 1 or n % local:
            return (f"topology 'alternating-exp-ring' needs the world size ({n}) to be a "
                    f"multiple of the ranks per node ({local!r}; LOCAL_WORLD_SIZE under torchrun)")
        nodes = n // local
        if nodes < 2 or _log2_exact(nodes) is None:
            return (f"topology 'alternating-exp-ring' needs a power-of-two number >= 2 of nodes; "
                    f"{n} ranks in nodes of {local} make {nodes} node(s) (use 'complete' or "
                    "'one-peer-exp' for one node)")
    return None


def check(name: str, n: int, local: int = 1) -> None:
    """ValueError with ``problem``'s sentence if the topology cannot run on n ranks."""
    reason = problem(name, n, local)
    if reason is not None:
        raise ValueError(reason)


def period(name: str, n: int, local: int = 1) -> int:
    """Steps after which the schedule repeats."""
    check(name, n, local)
    if n == 1 or name == "complete":
        return 1
    if name == "ring":
        return 2
    if name == "one-peer-exp":
        return _log2_exact(n)
    return 2 * _log2_exact(n // local)


def schedule(name: str, n: int, local: int, t: int) -> list[tuple[int, ...]]:
    """The groups of step t (t >= 0): disjoint sorted rank tuples covering 0..n-1, sorted."""
    check(name, n, local)
    if n == 1:
        return [(0,)]
    if name == "complete":
        return [tuple(range(n))]
    if name == "ring":
        if t % 2 == 0:
            return [(2 * k, 2 * k + 1) for k in range(n // 2)]
        return sorted(tuple(sorted((2 * k + 1, (2 * k + 2) % n))) for k in range(n // 2))
    if name == "one-peer-exp":
        bit = 1 << (t % _log2_exact(n))
        return [(j, j ^ bit) for j in range(n) if j < j ^ bit]
    nodes = n // local
    bit = 1 << ((t // 2) % _log2_exact(nodes))
    groups = []
    pairs = [(u, u ^ bit) for u in range(nodes) if u < u ^ bit]
    for p, (u, w) in enumerate(pairs):
        ranks_u = tuple(range(u * local, (u + 1) * local))
        ranks_w = tuple(range(w * local, (w + 1) * local))
        if (t + p) % 2 == 1:
            groups.append(ranks_u + ranks_w)
        else:
            groups += [ranks_u, ranks_w]
    return sorted(groups)
