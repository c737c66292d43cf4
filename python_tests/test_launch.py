"""dlion_kernels.launch.spawn, the launcher of local gloo ranks (bench/'s run_ranks, the demo's
launch; the tests' run_workers behaves the same, see test_rankserver.py): results in rank order,
and a failed or hung rank is named while every other rank is killed, never waited for."""

import time

import pytest
import torch
import torch.distributed as dist

from dlion_kernels.launch import spawn


def _sum_of_ranks(rank, n, tag):
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return {"rank": rank, "n": n, "tag": tag, "total": total.item(),
            "threads": torch.get_num_threads()}


def _one_raises(rank, n):
    if rank == 1:
        raise ValueError("rank 1 gives up")
    time.sleep(3600)  # outside any collective: only the launcher can end it


def _one_hangs(rank, n):
    if rank == 1:
        time.sleep(3600)
    return rank


@pytest.mark.parametrize("n", [1, 3])
def test_results_in_rank_order(n):
    results = spawn(n, _sum_of_ranks, "x", timeout=300)
    assert [r["rank"] for r in results] == list(range(n))
    for r in results:
        assert r["n"] == n and r["tag"] == "x" and r["threads"] == 1
        assert r["total"] == n * (n - 1) / 2


def test_a_failed_rank_is_named_and_the_others_killed():
    with pytest.raises(RuntimeError) as info:
        spawn(2, _one_raises, timeout=600)
    message = str(info.value)
    assert "rank 1:\n" in message and "ValueError: rank 1 gives up" in message
    assert "rank 0: killed: rank 1 failed" in message  # not "timed out": killed at once


def test_a_hung_rank_is_named_after_the_timeout():
    with pytest.raises(RuntimeError, match="rank 1: timed out after 8 s"):
        spawn(2, _one_hangs, timeout=8)
