"""Elastic training on torchft (dlion_kernels/elastic.py), with real processes on gloo: an
in-process torchft ``LighthouseServer`` and 3 replicas of one process each, started here (each
with its own TCPStore and ``Manager(pg=ProcessGroupGloo(...), min_replica_size=2,
use_async_quorum=False)``).

One replica kills itself (SIGKILL) in the middle of a step: after its all_to_all of the votes,
inside the all_gather of the tally (for ``DiLoCo``: in the middle of a sync). The test then
restarts it with the same replica id. Every replica writes one line per step (sync): the manager
step after it, whether it committed, the participants, the bytes sent, the elements and a digest
of its parameters. Checked from those lines:

- the survivors never raise (exit code 0) and keep stepping with 2 participants;
- no step is applied on a subset: a replica whose step did not commit keeps its parameters, and
  every replica that committed a given manager step holds bit-identical parameters after it;
- the restarted replica heals (its first step is at the survivors' step, with their parameters)
  and votes again (3 participants, committed);
- bytes per step are the wire's figure for the step's participants: 2 (n-1)/n d/8 plus padding.

What is not tested here, and why:
- an FSDP2 replica group (2 replicas x 2 shards): ``manager=`` runs one process per replica;
  torchft's gloo group would need one manager per shard rank and the exchange on local shards,
  which is not built;
- GPU process groups (torchft's ``ProcessGroupNCCL``): no GPU on the machines the tests run on;
- an asynchronous quorum: refused (``use_async_quorum=True`` raises ``ValueError``).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import signal
import time
from datetime import timedelta

import pytest

torchft = pytest.importorskip("torchft")

REPLICAS = 3
D = 984  # elements of the tiny model: Linear(40, 24) with its bias


def _digest(params) -> str:
    h = hashlib.blake2b(digest_size=12)
    for p in params:
        h.update(p.detach().contiguous().view(-1).numpy().tobytes())
    return h.hexdigest()


def _arm_kill(at_step: int, step_of) -> None:
    """Kill this process (SIGKILL) inside the all_gather of the tally of its first step of all
    3 replicas from ``at_step`` on (a replica may start late and join a later quorum): its votes
    were sent (the all_to_all is done), the step is half way."""
    from dlion_kernels import elastic

    original = elastic.ManagerGroup.all_gather_single

    def all_gather_single(self, output, input, opts):
        if step_of() >= at_step and self.n == REPLICAS:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, output, input, opts)

    elastic.ManagerGroup.all_gather_single = all_gather_single


def _replica(index: int, lighthouse: str, kind: str, kill_at, target: int, out: str,
             go=None) -> None:
    import torch
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    import dlion_kernels as dk

    torch.set_num_threads(1)
    if go is not None:  # a restart: imported ahead, it starts its replica when told
        go.wait()
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=20)), load_state_dict=None,
                      state_dict=None, min_replica_size=2, use_async_quorum=False,
                      replica_id=f"replica{index}", store_addr="localhost", store_port=store.port,
                      rank=0, world_size=1, lighthouse_addr=lighthouse,
                      timeout=timedelta(seconds=20), quorum_timeout=timedelta(seconds=60),
                      connect_timeout=timedelta(seconds=20))
    torch.manual_seed(0)  # the same initial weights everywhere (a restarted one heals anyway)
    model = torch.nn.Linear(40, 24)
    params = list(model.parameters())
    assert sum(p.numel() for p in params) == D
    sync_every = 2
    if kind == "lion":
        opt = dk.DistributedLion(model.parameters(), lr=1e-2, manager=manager)
        step_of = manager.current_step
    else:
        inner = torch.optim.SGD(model.parameters(), lr=0.05)
        diloco = dk.DiLoCo(model, inner, sync_every=sync_every, outer=kind, outer_lr=1e-2
                           if kind == "dlion" else 0.7, manager=manager)
        step_of = manager.current_step
    if kill_at is not None:
        _arm_kill(kill_at, step_of)
    lines = open(out, "a")
    local = 0
    while True:
        local += 1
        gen = torch.Generator().manual_seed(1000 * index + 7 * local)
        x = torch.randn(8, 40, generator=gen)
        if kind == "lion":
            opt.zero_grad()  # the quorum (a restarted replica heals here)
            model(x).pow(2).mean().backward()
            opt.step()
            s = opt.last_stats
            record = dict(step=s.manager_step, committed=s.committed, n=s.participants,
                          sent=s.bytes_sent, numel=s.numel, digest=_digest(params))
        else:
            inner.zero_grad()
            model(x).pow(2).mean().backward()
            inner.step()
            s = diloco.step()
            if s is None:
                continue
            record = dict(step=s.manager_step, committed=s.committed, n=s.participants,
                          sent=s.bytes_sent, numel=s.numel, digest=_digest(params),
                          theta=_digest(diloco.theta_bar), inner=diloco.inner_step)
        lines.write(json.dumps(record) + "\n")
        lines.flush()
        if record["n"] < REPLICAS:
            time.sleep(0.02)  # waiting for the restart: leave it the CPU
        if record["committed"] and record["n"] == REPLICAS and record["step"] >= target:
            break
    manager.shutdown(wait=False)
    os._exit(0)  # torchft's threads: leave at once


def _run(kind: str, kill_at: int, target: int, tmp_path) -> dict:
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=1000)
    ctx = mp.get_context("spawn")
    outs = [str(tmp_path / f"replica{i}.jsonl") for i in range(REPLICAS)]
    victim = 1
    procs = [ctx.Process(target=_replica, args=(i, lighthouse.address(), kind,
                                                 kill_at if i == victim else None, target,
                                                 outs[i])) for i in range(REPLICAS)]
    go = ctx.Event()
    restarted = ctx.Process(target=_replica, args=(victim, lighthouse.address(), kind, None,
                                                    target, outs[victim], go))
    try:
        for p in procs + [restarted]:
            p.start()
        procs[victim].join(timeout=120)
        assert procs[victim].exitcode == -signal.SIGKILL, "the victim was to kill itself"
        with open(outs[victim]) as f:
            before = len(f.readlines())
        go.set()
        deadline = time.monotonic() + 150
        for p in [procs[0], procs[2], restarted]:
            p.join(timeout=max(1, deadline - time.monotonic()))
        codes = [procs[0].exitcode, procs[2].exitcode, restarted.exitcode]
    finally:
        for p in procs + [restarted]:
            if p.is_alive():
                p.kill()
                p.join()
        lighthouse.shutdown()
    assert codes == [0, 0, 0], f"survivors and the restarted replica must end cleanly: {codes}"
    records = []
    for f in outs:
        with open(f) as fh:
            records.append([json.loads(line) for line in fh])
    return dict(records=records, victim=victim, before=before)


def _check(run, sent_bound) -> None:
    records, victim, before = run["records"], run["victim"], run["before"]
    # no step applied on a subset; bit-identical after every committed step
    by_step: dict = {}
    for i, rs in enumerate(records):
        prev = None
        for r in rs:
            if r["committed"]:
                by_step.setdefault(r["step"], set()).add(r["digest"])
            elif prev is not None and not (i == victim and r is rs[before]):
                assert r["digest"] == prev["digest"], "a step that did not commit changed it"
            prev = r
    assert all(len(d) == 1 for d in by_step.values()), \
        {s: d for s, d in by_step.items() if len(d) > 1}
    survivors = [rs for i, rs in enumerate(records) if i != victim]
    for rs in survivors:
        assert not all(r["committed"] for r in rs), "the step of the kill cannot have committed"
        assert any(r["committed"] and r["n"] == 2 for r in rs), "no step with the 2 survivors"
        assert rs[-1]["committed"] and rs[-1]["n"] == REPLICAS
    healed = records[victim][before:]
    assert healed, "the restarted replica took no step"
    first = healed[0]
    assert first["committed"] and first["n"] == REPLICAS, first
    # healed: it stepped from the survivors' state, so its first step ends where theirs does
    assert first["digest"] in by_step[first["step"]]
    assert first["step"] > max((r["step"] for r in records[victim][:before] if r["committed"]),
                               default=0)
    for rs in records:
        for r in rs:
            if r["committed"]:
                low, high = sent_bound(r["n"], r["numel"])
                assert low <= r["sent"] <= high, (r, low, high)


def _vote_bytes(n, d):
    """SPEC's vote/binary figure 2 (n-1)/n d/8, and it plus the padding: a step header (8
    bytes) and at most one 32-element word per plane of each of the n shards, per peer."""
    if n == 1:
        return 0, 0
    exact = 2 * (n - 1) / n * d / 8
    return exact, exact + (n - 1) * (8 + 2 * 4 * 2)


def test_distributed_lion_survives_a_killed_replica_and_heals_it(tmp_path):
    run = _run("lion", kill_at=3, target=8, tmp_path=tmp_path)
    _check(run, _vote_bytes)


def test_diloco_survives_a_replica_killed_in_a_sync_and_heals_it(tmp_path):
    run = _run("dlion", kill_at=2, target=5, tmp_path=tmp_path)
    _check(run, _vote_bytes)
    # theta_bar is the same on every replica after every committed sync
    thetas: dict = {}
    for rs in run["records"]:
        for r in rs:
            if r["committed"]:
                thetas.setdefault(r["step"], set()).add(r["theta"])
    assert all(len(t) == 1 for t in thetas.values())


def test_manager_is_checked():
    import torch

    import dlion_kernels as dk

    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="manager must be a torchft.Manager"):
        dk.DistributedLion(model.parameters(), manager=object())
    with pytest.raises(TypeError, match="manager must be a torchft.Manager"):
        dk.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2,
                  manager="manager")
