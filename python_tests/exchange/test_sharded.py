"""exchange/sharded.py: the DTensor plumbing of D-Lion on FSDP2 parameters (the optimizer on
top of it: python_tests/optim/test_fsdp.py)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard
from workers import run_workers

import dlion_kernels as dk
from dlion_kernels.exchange import sharded
from dlion_kernels.exchange.header import NONFINITE


def test_plain_tensors():
    """Plain tensors are no DTensors: ``local`` is the tensor itself, ``resolve`` gives None."""
    t = torch.zeros(3)
    assert sharded.own_shard(t) is t and sharded.own_shard(None) is None
    assert not sharded.is_dtensor(t) and not sharded.sharded_params([t, t])
    assert sharded.resolve([t]) is None


def test_memory_per_rank_plain():
    """Counted from the tensors: parameters, gradients once they exist, and every state tensor
    (the step counter is an int, not counted)."""
    params = [nn.Parameter(torch.zeros(10)), nn.Parameter(torch.zeros(3, 4, dtype=torch.bfloat16))]
    opt = dk.DistributedLion(params)
    assert sharded.memory_per_rank(opt) == dict(params=40 + 24, grads=0, optimizer_state=0)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    # fp32 momentum for both
    assert sharded.memory_per_rank(opt) == dict(params=64, grads=64, optimizer_state=40 + 48)


class _Fake:
    """What ShardAgreement reads of a Sharding, without a process group (N = L = 1)."""

    replicate = shard = None
    replicas = shards = 1


def test_agreement_summary():
    """Headers [buckets, 1, 2] -> this rank's own [1, 1, 2]: its flag OR-ed over the buckets,
    its step; a rank that gave the step up adds ABORTED (the word the exchange passes); with
    n = 1 no collective, no bytes."""
    from dlion_kernels.exchange.pipeline import ABORTED

    headers = torch.tensor([[[0, 5]], [[NONFINITE, 5]]], dtype=torch.int32)
    agree = sharded.ShardAgreement(_Fake(), step=5)
    assert torch.equal(agree(headers), torch.tensor([[[NONFINITE, 5]]], dtype=torch.int32))
    assert torch.equal(agree(headers, torch.tensor([ABORTED], dtype=torch.int32)),
                       torch.tensor([[[NONFINITE | ABORTED, 5]]], dtype=torch.int32))
    # the exchange's last word also carries the settings digest (header.py's word 0)
    assert torch.equal(agree(headers, torch.tensor([4 << 2], dtype=torch.int32)),
                       torch.tensor([[[NONFINITE | 4 << 2, 5]]], dtype=torch.int32))
    assert agree.sent == 0


def _worker(rank, n):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 3))  # 3 rows: shards of 2 and 1
    for m in (net[0], net[1], net):
        fully_shard(m, mesh=mesh["shard"])
    params = list(net.parameters())
    out = {}
    s = sharded.resolve(params, mesh)
    out["sharding"] = (s.replicas, s.shards, s.replicate_dim, s.shard_dim,
                       dist.get_process_group_ranks(s.replicate),
                       dist.get_process_group_ranks(s.shard))
    # the same mesh from the replicate group (one all_gather of the shard groups' ranks)
    g = sharded.resolve(params, group=mesh["replicate"].get_group())
    out["from group"] = (g.mesh.mesh.tolist(), g.mesh.mesh_dim_names, g.replicas, g.shards)
    m = s.zero_momentum(params[2])  # weight (3, 48): 2 rows here, 1 on the other shard
    out["momentum"] = (tuple(m.shape), tuple(m.placements), tuple(m.to_local().shape),
                       m.dtype, tuple(sharded.momentum_local(m).shape))
    out["placements"] = tuple(s.momentum_placements(params[2])) == (Shard(0), Shard(1))
    try:
        s.check_momentum(torch.zeros(2, 3, 48), params[2], "here")
    except ValueError as e:
        out["plain"] = str(e)
    try:
        s.check_momentum(s.zero_momentum(params[0]), params[2], "there")
    except ValueError as e:
        out["shape"] = str(e)
    # The header gather: every rank ends with the n headers in mesh order (replica-major).
    me = dist.get_rank()
    agree = sharded.ShardAgreement(s, step=3)
    mine = torch.tensor([[[me % 2, 10 + me], [0, 20 + me]]], dtype=torch.int32)  # [1, N=2, 2]
    out["agreed"] = (agree(mine).tolist(), agree.sent)
    # memory: this rank's shards and one fp32 momentum of the same size
    opt = dk.DistributedLion(params, device_mesh=mesh)
    local = sum(sharded.own_shard(p).numel() for p in params)
    out["memory"] = (sharded.memory_per_rank(opt), local,
                     sum(p.numel() for p in params))
    return out


def test_mesh_layout_agreement_memory():
    """2 x 2 mesh on 4 gloo ranks: the groups, the same mesh from group=, the momentum layout
    (global (N, *shape), Shard(0) on replicate, Shard(d + 1) on shard, this rank's piece), its
    checks, the header gather's order and bytes, and memory_per_rank."""
    results = run_workers(4, _worker)
    for r, res in enumerate(results):
        i, j = divmod(r, 2)  # replica, shard
        assert res["sharding"] == (2, 2, 0, 1, [j, 2 + j], [2 * i, 2 * i + 1]), res["sharding"]
        assert res["from group"] == ([[0, 1], [2, 3]], ("replicate", "shard"), 2, 2), r
        rows = 2 if j == 0 else 1
        assert res["momentum"][:2] == ((2, 3, 48), (Shard(0), Shard(1))), res
        assert res["momentum"][2:] == ((1, rows, 48), torch.float32, (rows, 48)), res
        assert res["placements"], r
        assert "keeps each momentum as a DTensor of global shape (2, 3, 48)" in res["plain"]
        assert "has global shape (2, 48, 64)" in res["shape"], res["shape"]
        # each rank passes the two headers it "received" (its fake ones) and keeps its own (its
        # row in its replicate group: replica q // 2); the gather over the whole mesh puts rank
        # q's own header at position q
        expect = [[q % 2, 10 + q] if q < 2 else [0, 20 + q] for q in range(4)]
        assert res["agreed"] == ([expect], 3 * 2 * 4), (r, res["agreed"])
        memory, local, full = res["memory"]
        assert memory == dict(params=4 * local, grads=0, optimizer_state=4 * local), r
        assert local <= full / 2 + 64 + 1, (local, full)


@pytest.mark.parametrize("bad", [[torch.zeros(2)], []])
def test_resolve_plain_refuses_mesh(bad):
    """device_mesh with plain (or no) parameters: a clear error, nothing else looked at."""
    with pytest.raises(ValueError, match="device_mesh is for FSDP2's DTensor parameters"):
        sharded.resolve(bad, device_mesh=object())
