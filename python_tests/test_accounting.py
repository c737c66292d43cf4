"""The byte formulas of the collectives torch runs (dlion_kernels.accounting), and that every
report of those bytes uses them."""

import pytest

from dlion_kernels.accounting import (
    ddp_all_reduce_bytes,
    fsdp_model_bytes,
    fsdp_shard_elems,
    fsdp_unit_bytes,
    ring_all_reduce_bytes,
)


def test_ring_all_reduce_bytes():
    assert ring_all_reduce_bytes(1, 1000) == 0
    assert ring_all_reduce_bytes(2, 1000) == 1000  # half sent, half received back: 2 * 1/2
    assert ring_all_reduce_bytes(4, 4000) == 6000  # 2 * 3/4 * 4000
    assert ring_all_reduce_bytes(8, 0) == 0


@pytest.mark.parametrize("ranks, nbytes", [(0, 1), (-2, 1), (2.0, 1), (True, 1), (2, -1)])
def test_ring_all_reduce_bytes_refuses(ranks, nbytes):
    with pytest.raises(ValueError, match="ranks|nbytes"):
        ring_all_reduce_bytes(ranks, nbytes)


def test_fsdp_unit_bytes():
    # L = 4, s = 100 fp32 elements: gathered twice (3 peers x 400 bytes each time), the unit's
    # 400 gradient elements reduce-scattered in fp32 (3 x 100 x 4 bytes sent)
    assert fsdp_unit_bytes(100, 400, 4, 2, reduce_bytes=4) == (3 * (2 * 400 + 400), 0.0)
    # the root: gathered once; bf16 parameters and gradients
    assert fsdp_unit_bytes(100, 200, 4, 2, reduce_bytes=2, gathers=1) == (3 * (200 + 200), 0.0)
    # HSDP: the shard's gradients all-reduced among the N = 4 replicas
    assert fsdp_unit_bytes(100, 400, 4, 4, reduce_bytes=4, replicas_all_reduce=True) == (
        3 * (2 * 400 + 400), 2 * 3 / 4 * 400)
    assert fsdp_unit_bytes(100, 400, 1, 1, reduce_bytes=4, replicas_all_reduce=True) == (0, 0)
    with pytest.raises(ValueError, match="gathers"):
        fsdp_unit_bytes(100, 400, 4, 2, reduce_bytes=4, gathers=3)
    with pytest.raises(ValueError, match="ranks_per_node"):
        fsdp_unit_bytes(100, 400, 0, 2, reduce_bytes=4)


def test_every_report_uses_the_ring_formula():
    from dlion_kernels.accounting import gossip_bytes_per_step
    from dlion_kernels.demo.common import allreduce_fp32_bytes
    from dlion_kernels.exchange.pipeline import StepStats

    for n, d in [(1, 10), (2, 1000), (3, 1001), (8, 12345)]:
        want = ring_all_reduce_bytes(n, 4 * d)
        assert StepStats(0, 0, d, n, "vote", "binary", "cpu").allreduce_fp32_bytes == round(want)
        assert allreduce_fp32_bytes(d, n) == round(want)
        assert gossip_bytes_per_step(d, 4, n) == want


def test_ddp_all_reduce_bytes():
    assert ddp_all_reduce_bytes(4, 1000) == (6000, None)  # 2 * 3/4 * 4000
    assert ddp_all_reduce_bytes(4, 1000, wire_bytes=2) == (3000, None)
    assert ddp_all_reduce_bytes(1, 1000) == (0, None)
    # the hierarchical hook, 2 nodes of 2: a ring over the node (4000), the half shard's ring
    # across the nodes (2000)
    assert ddp_all_reduce_bytes(4, 1000, ranks_per_node=2) == (6000, 2000)


def test_fsdp_model_bytes():
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))
    # padded shards on L = 2: ceil(3 / 2) = 2 rows of 5, 2 of the bias; the root's 1 row of 3, 1
    assert [fsdp_shard_elems(p, 2) for p in model.parameters()] == [10, 2, 3, 1]
    assert fsdp_shard_elems(torch.zeros(()), 2) == 1
    # unit: (L - 1) (2 gathers of 48 bytes + 12 fp32 gradients); root: 1 gather of 16 + 4 grads
    assert fsdp_model_bytes([model[0]], model, 2, 2, 4, False) == (144 + 32, 0)
    # HSDP: each shard's gradients all-reduced by the 2 replicas (ring: half of them sent)
    assert fsdp_model_bytes([model[0]], model, 2, 2, 4, True) == (144 + 32, 48 + 16)
