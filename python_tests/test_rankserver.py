"""The tests' run_workers: ranks forked from one server per pytest process that imported torch
once. Each run must behave like a fresh spawn: results in rank order, a failed, dead or hung rank
named while the others are killed, the caller's environment, and no state left by earlier runs."""

import os
import time

import pytest
import rankserver
import torch
import torch.distributed as dist
from workers import run_workers

from dlion_kernels.launch import spawn

_LEFT_BEHIND = []  # appended to by a rank: a later run must not see it


def _state(rank, n, mark):
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    seen = list(_LEFT_BEHIND)
    _LEFT_BEHIND.append(mark)
    dist.all_reduce = None  # a patch that must not reach the next run
    return dict(rank=rank, n=n, total=total.item(), seen=seen, random=torch.rand(3),
                threads=torch.get_num_threads(), pid=os.getpid(),
                env=os.environ.get("DLION_RANKSERVER_PROBE"), stdout=print("out", rank))


def _one_raises(rank, n):
    if rank == 1:
        raise ValueError("rank 1 gives up")
    time.sleep(3600)


def _one_dies(rank, n):
    if rank == 0:
        os._exit(7)
    time.sleep(3600)


def _one_hangs(rank, n):
    if rank == 1:
        time.sleep(3600)
    return rank


def test_fresh_processes_every_run(monkeypatch, capfd):
    first = run_workers(3, _state, "a")
    server = rankserver._server
    second = run_workers(3, _state, "b")
    assert rankserver._server is server  # one server for both runs
    for a, b in zip(first, second):
        assert a["rank"] == b["rank"] and a["n"] == 3 and a["total"] == 3.0
        assert a["seen"] == b["seen"] == [] and a["threads"] == 1 and a["env"] is None
        assert torch.equal(a["random"], b["random"])  # the generator as a new process has it
        assert torch.equal(a["random"], first[0]["random"])
        assert a["pid"] != b["pid"]
    assert "out 0" in capfd.readouterr().out  # the ranks' output reaches the test's capture

    monkeypatch.setenv("DLION_RANKSERVER_PROBE", "yes")
    assert [r["env"] for r in run_workers(2, _state, "c")] == ["yes", "yes"]
    assert rankserver._server is not server  # a new environment: a new server


def test_a_failed_rank_is_named_and_the_others_killed():
    with pytest.raises(RuntimeError) as info:
        run_workers(2, _one_raises, timeout=600)
    message = str(info.value)
    assert "rank 1:\n" in message and "ValueError: rank 1 gives up" in message
    assert "rank 0: killed: rank 1 failed" in message


def test_a_dead_rank_is_named_and_the_server_keeps_serving():
    with pytest.raises(RuntimeError) as info:
        run_workers(2, _one_dies, timeout=600)
    message = str(info.value)
    assert "rank 0: exit code 7" in message and "rank 1: killed: rank 0 failed" in message
    assert [r["rank"] for r in run_workers(2, _state, "d")] == [0, 1]


def test_a_hung_rank_is_named_after_the_timeout():
    with pytest.raises(RuntimeError, match="rank 1: timed out after 4 s"):
        run_workers(2, _one_hangs, timeout=4)


def test_a_dead_server_is_replaced():
    run_workers(1, _state, "e")
    rankserver._server.proc.kill()
    assert run_workers(2, _state, "f")[1]["total"] == 1.0


def test_plain_spawn_after_the_server():
    """A plain spawn in the same pytest process still sees its failed rank at once."""
    run_workers(2, _state, "g")
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 0: killed: rank 1 failed"):
        spawn(2, _one_raises, timeout=600)
    assert time.monotonic() - start < 300
