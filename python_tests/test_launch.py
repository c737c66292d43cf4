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


def _environment_and_output(rank, n, name):
    import os

    print(f"rank {rank} says hello", flush=True)
    return os.environ.get(name)


def test_ranks_see_the_callers_environment_and_output_of_the_moment(monkeypatch, capfd):
    """The ranks come from a fork server started at the first spawn: a later spawn's ranks still
    get the environment and the stdout the caller has when it starts them."""
    spawn(1, _sum_of_ranks, "first", timeout=300)  # the server runs from here on
    monkeypatch.setenv("DLION_LAUNCH_PROBE", "set after the first spawn")
    capfd.readouterr()
    got = spawn(2, _environment_and_output, "DLION_LAUNCH_PROBE", timeout=300)
    assert got == ["set after the first spawn"] * 2
    out = capfd.readouterr().out
    assert "rank 0 says hello" in out and "rank 1 says hello" in out
