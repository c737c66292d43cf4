"""A topology bound to gloo process groups (decentralized/topology.py): every rank's subgroup at
each step reduces over exactly the schedule's group."""

import pytest
import torch
import torch.distributed as dist
from workers import run_workers

from dlion_kernels.decentralized.topology import Topology
from dlion_kernels.topologies import TOPOLOGIES, period, schedule


def _groups_work(rank, n, locals_):
    out = {}
    # one process group for all of them: spawning costs seconds
    for name, local in [(t, locals_[0]) for t in TOPOLOGIES] + [
            ("alternating-exp-ring", L) for L in locals_[1:]]:
        topo = Topology(name, local=local)
        sums = []
        for t in range(topo.period):
            ranks, pg = topo.group_at(t)
            x = torch.tensor([float(rank + 1)])
            if pg is not None:
                dist.all_reduce(x, group=pg)
            sums.append((ranks, x.item()))
        out[(name, local)] = sums
    return out


@pytest.mark.parametrize("n, locals_", [(4, (2,)), (8, (2, 4))])
def test_groups_on_gloo(n, locals_):
    """Every rank's subgroup at each step reduces exactly over the schedule's group (n = 8:
    alternating-exp-ring on 4 nodes of 2 and on 2 nodes of 4)."""
    results = run_workers(n, _groups_work, locals_)
    expected = {(t, locals_[0]) for t in TOPOLOGIES} | {("alternating-exp-ring", L)
                                                          for L in locals_}
    for rank, per_topology in enumerate(results):
        assert set(per_topology) == expected
        for (name, local), sums in per_topology.items():
            assert len(sums) == period(name, n, local)
            for t, (ranks, total) in enumerate(sums):
                mine = next(g for g in schedule(name, n, local, t) if rank in g)
                assert ranks == mine, (name, local, t)
                assert total == sum(r + 1 for r in mine), (name, local, t)
