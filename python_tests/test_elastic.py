"""Elastic training on torchft (dlion_kernels/elastic.py), with real processes on gloo: an
in-process torchft ``LighthouseServer`` per phase and 3 replicas of one process each, started here
(each with its own TCPStore and ``Manager(pg=ProcessGroupGloo(...), min_replica_size=2,
use_async_quorum=False)``).

Phases, in one set of processes: ``DistributedLion``, ``DiLoCo`` with the D-Lion outer step,
``DiLoCo`` with Nesterov, and ``DistributedLion`` again with two replicas dying in the same step.
In each, victims kill themselves (SIGKILL) in the middle of a step (a sync): D-Lion inside the
all_gather of the tally, after the all_to_all of the votes; Nesterov at its all-reduce. The test
restarts each victim with the same replica id once the survivors went on without it. Every
replica writes one line per step (sync): the manager step after it, whether it committed, the
participants, the bytes sent, the elements and a digest of its parameters. Checked from those
lines:

- the survivors never raise (exit code 0) and keep stepping with 2 participants; one survivor
  alone (below min_replica_size) commits nothing and waits for a quorum until the restarts heal;
- no step is applied on a subset: a replica whose step did not commit keeps its parameters, and
  every replica that committed a given manager step holds bit-identical parameters after it (and
  the same theta_bar, for DiLoCo); nothing commits with fewer than 2 replicas;
- a restarted replica heals (its first step is at the survivors' step, with their parameters)
  and votes again (committed, up to all 3 replicas at the end);
- bytes per step are the wire's figure for the step's participants: 2 (n-1)/n d/8 plus padding
  for the vote, 2 (n-1)/n 4 (d + 2n) for Nesterov's all-reduce (its step words included).

A replica that starts late (after the others' first quorum) heals the same way; the phases'
starts often make one, but the test does not force it.

What is not tested here, and why:
- an FSDP2 replica group (2 replicas x 2 shards): ``python_tests/test_elastic_fsdp.py``;
- GPU process groups (torchft's ``ProcessGroupNCCL``): no GPU where the tests run;
- an asynchronous quorum: refused (``use_async_quorum=True`` raises ``ValueError``, tested below).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import signal
import time

import pytest

torchft = pytest.importorskip("torchft")

from dlion_kernels.demo.elastic import end_replica, read_records  # noqa: E402

REPLICAS = 3
LATE_S = 2.5  # a late replica's pause: more than the 1 s its Lighthouse waits for it
D = 984  # elements of the tiny model: Linear(40, 24) with its bias


def _digest(params) -> str:
    h = hashlib.blake2b(digest_size=12)
    for p in params:
        h.update(p.detach().contiguous().view(-1).numpy().tobytes())
    return h.hexdigest()


def _arm_kill(at_step: int, step_of) -> None:
    """Kill this process (SIGKILL) in the middle of its first step (sync) of all 3 replicas from
    manager step ``at_step`` on (a replica may start late and join a later quorum): D-Lion inside
    the all_gather of the tally (its votes were sent: the all_to_all is done), Nesterov at its
    all-reduce."""
    from dlion_kernels import elastic

    def dies(name):
        original = getattr(elastic.ManagerGroup, name)

        def collective(self, *args):
            if step_of() >= at_step and self.n == REPLICAS:
                os.kill(os.getpid(), signal.SIGKILL)
            return original(self, *args)

        setattr(elastic.ManagerGroup, name, collective)

    dies("all_gather_single")
    dies("allreduce")


def _phase(index, phase, lighthouse, kind, kill_at, target, out, late=None) -> None:
    """One replica through one phase: its store and Manager, a tiny model, steps (DiLoCo syncs)
    until one commits with all 3 replicas at manager step ``target`` or later. ``late``: (replica,
    step): that replica pauses ``LATE_S`` once, before a step, when it has committed 3 plain
    steps in a row (each one step on, nothing skipped) up to that manager step or later: then it
    is current and asks for its next quorum ahead (the steps it may have spent asking at
    zero_grad, were the machine slow enough to make it miss a quorum before, are over)."""
    import torch

    import dlion_kernels as dk
    from dlion_kernels import launch

    manager = launch.replica_manager(f"{kind}_{index}", lighthouse, min_replica_size=2,
                                     timeout=20.0, quorum_timeout=60.0)
    torch.manual_seed(0)  # the same initial weights everywhere (a restarted one heals anyway)
    model = torch.nn.Linear(40, 24)
    params = list(model.parameters())
    assert sum(p.numel() for p in params) == D
    if kind.startswith("lion"):
        opt = dk.DistributedLion(model.parameters(), lr=1e-2, manager=manager)
    else:
        inner = torch.optim.SGD(model.parameters(), lr=0.05)
        diloco = dk.DiLoCo(model, inner, sync_every=2, outer=kind,
                           outer_lr=1e-2 if kind == "dlion" else 0.7, manager=manager)
    if kill_at is not None:
        _arm_kill(kill_at, manager.current_step)
    lines = open(out, "a")
    local = 0
    late_at = late[1] if late is not None and late[0] == index else None
    plain, paused = [], False  # the last committed plain steps; whether this step follows a pause
    while True:
        local += 1
        gen = torch.Generator().manual_seed(1000 * index + 7 * local)
        x = torch.randn(8, 40, generator=gen)
        if kind.startswith("lion"):
            if late_at is not None and len(plain) >= 3 and plain[-1] >= late_at:
                late_at, paused = None, True
                time.sleep(LATE_S)  # the others' quorums go on without it (join timeout)
            opt.zero_grad()  # the quorum (a restarted replica heals here)
            model(x).pow(2).mean().backward()
            opt.step()
            s = opt.last_stats
            extra = {}
        else:
            inner.zero_grad()
            model(x).pow(2).mean().backward()
            inner.step()
            s = diloco.step()
            if s is None:
                continue
            extra = dict(theta=_digest(diloco.theta_bar), inner=diloco.inner_step)
        record = dict(t=time.time(), step=s.manager_step, committed=s.committed, n=s.participants,
                      skipped=s.skipped, sent=s.bytes_sent, numel=s.numel,
                      digest=_digest(params), paused=paused, **extra)
        if kind.startswith("lion"):
            one_on = s.committed and not s.skipped and plain and s.manager_step == plain[-1] + 1
            plain = plain + [s.manager_step] if one_on or not plain and s.committed else []
            paused = False
        lines.write(json.dumps(record) + "\n")
        lines.flush()
        if (record["committed"] and record["n"] == REPLICAS and record["step"] >= target
                and not record["skipped"]):
            break
        if record["n"] < REPLICAS:
            time.sleep(0.02)  # waiting for the restart: leave it the CPU
    end_replica(lines, manager, leave=False)  # the next phase runs in this process


def _replica(index: int, phases, first: int, tmp: str, go=None) -> None:
    """Replica ``index`` through ``phases[first:]``; ``go``: a restart, imported ahead, that
    starts when told."""
    import torch

    import dlion_kernels.elastic  # noqa: F401  (imported ahead: the restart starts at once)
    import dlion_kernels.local_steps.diloco  # noqa: F401
    import dlion_kernels.optim.dlion  # noqa: F401

    torch.set_num_threads(1)
    if go is not None:
        go.wait()
    for p, (kind, lighthouse, victims, kill_at, target, late) in enumerate(phases):
        if p >= first:  # a restart does not die again in the phase it restarts in
            dies = index in victims and (go is None or p > first)
            _phase(index, p, lighthouse, kind, kill_at if dies else None, target,
                   os.path.join(tmp, f"{kind}-replica{index}.jsonl"), late)
    os._exit(0)  # torchft's threads: leave at once


def _wait_for(what, condition, procs, limit=150.0) -> None:
    end = time.monotonic() + limit
    while not condition():
        dead = [p.exitcode for p in procs if p.exitcode not in (None, 0, -signal.SIGKILL)]
        assert not dead and time.monotonic() < end, f"waiting for {what}: exit codes {dead}"
        time.sleep(0.1)


def _exit_codes(current, timeout: float) -> list:
    """The exit codes of the processes ``current``, each joined for up to ``timeout`` seconds."""
    for p in current:
        p.join(timeout=timeout)
    return [p.exitcode for p in current]


def _kill_left(procs) -> None:
    """Kill and reap whichever of ``procs`` still runs (a test that failed midway)."""
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()


def _run(phases, tmp_path) -> dict:
    """3 replicas through ``phases`` ((kind, victims, kill_at, target, late) each): in each
    phase its victims kill themselves in the same step and are restarted (processes imported
    ahead) once the survivors have gone on without them: committed a step with 2 replicas, or,
    for one survivor alone (below min_replica_size), failed the step. ``late`` (``_phase``): a
    replica that pauses instead, under a Lighthouse that waits 1 s for it. Returns each phase's
    records and how many lines each victim wrote before it died."""
    from dlion_kernels import launch

    tmp = str(tmp_path)
    # the join timeout: how long a quorum that has min_replicas waits for the others. At 1 s a
    # replica slowed by a loaded machine misses a quorum and starts the next one with another,
    # and quorums of 2 alternate from then on; 4 s keeps the 3 together (the survivors' first
    # quorum after a kill waits at most that long for the dead replica)
    houses = [launch.lighthouse(min_replicas=2, join_timeout_ms=4000 if late is None else 1000)
              for _, _, _, _, late in phases]
    plan = [(kind, h.address(), victims, kill_at, target, late)
            for (kind, victims, kill_at, target, late), h in zip(phases, houses)]
    # a fork server that imported torch and the library once: many processes importing torch at
    # once cost a minute of CPU on a small machine (the server runs nothing, so forking it is
    # safe; torchft starts its threads only in the replicas)
    ctx = mp.get_context("forkserver")
    # (torch._dynamo: what torch.optim loads at a first step; a restart then heals at once)
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "torchft",
                                "dlion_kernels.elastic", "dlion_kernels.optim.dlion",
                                "dlion_kernels.local_steps.diloco", "dlion_kernels.kernels.native",
                                "dlion_kernels.kernels.reference", "dlion_kernels.demo.elastic"])
    firsts = [ctx.Process(target=_replica, args=(i, plan, 0, tmp)) for i in range(REPLICAS)]
    gos = [ctx.Event() for _ in phases]
    restarts = {(p, v): ctx.Process(target=_replica, args=(v, plan, p, tmp, gos[p]))
                for p, (_, victims, _, _, _) in enumerate(phases) for v in victims}
    procs = firsts + list(restarts.values())
    before = []
    path = os.path.join(tmp, "{}-replica{}.jsonl").format
    try:
        for p in procs:
            p.start()
        current = list(firsts)  # the process running each replica
        for p, (kind, victims, _, _, _) in enumerate(phases):
            before.append({})
            if not victims:
                continue
            for v in victims:
                current[v].join(timeout=150)
                assert current[v].exitcode == -signal.SIGKILL, f"{kind}: replica {v} was to die"
                before[-1][v] = len(read_records(path(kind, v)))
            others = [i for i in range(REPLICAS) if i not in victims]

            def went_on(kind=kind, others=others):
                return all(any(r["committed"] and r["n"] == 2 if len(others) == 2 else
                               not r["committed"] for r in read_records(path(kind, i)))
                           for i in others)

            _wait_for(f"{kind}: the survivors' steps", went_on, procs)
            gos[p].set()
            for v in victims:
                current[v] = restarts[(p, v)]
        codes = _exit_codes(current, 150)
    finally:
        _kill_left(procs)
        for h in houses:
            h.shutdown()
    assert codes == [0] * REPLICAS, f"survivors and restarted replicas must end cleanly: {codes}"
    return {kind: dict(records=[read_records(path(kind, i)) for i in range(REPLICAS)], before=b)
            for (kind, _, _, _, _), b in zip(phases, before)}


def _committed_digests(records) -> dict:
    """Every committed manager step's parameter digest, asserted the same on every replica that
    committed it (bit-identical after every committed step)."""
    by_step: dict = {}
    for rs in records:
        for r in rs:
            if r["committed"]:
                by_step.setdefault(r["step"], set()).add(r["digest"])
    assert all(len(d) == 1 for d in by_step.values()), \
        {s: d for s, d in by_step.items() if len(d) > 1}
    return {s: d.pop() for s, d in by_step.items()}


def _check(run, sent_bound) -> None:
    records, before = run["records"], run["before"]
    # no step applied on a subset; bit-identical after every committed step
    by_step = _committed_digests(records)
    for i, rs in enumerate(records):
        prev = None
        for k, r in enumerate(rs):
            if r["committed"]:
                assert r["n"] >= 2, "committed below min_replica_size"
            elif prev is not None and before.get(i) != k:
                assert r["digest"] == prev["digest"], "a step that did not commit changed it"
            prev = r
    survivors = [rs for i, rs in enumerate(records) if i not in before]
    for rs in survivors:
        assert not all(r["committed"] for r in rs), "the step of the kill cannot have committed"
        if len(survivors) == 2:
            assert any(r["committed"] and r["n"] == 2 for r in rs), "no step with 2 survivors"
        assert rs[-1]["committed"] and rs[-1]["n"] == REPLICAS
    for v, b in before.items():
        healed = records[v][b:]
        assert healed, f"the restarted replica {v} took no step"
        first = healed[0]
        assert first["committed"] and first["n"] >= 2, first
        # healed: it stepped from the survivors' state, so its first step ends where theirs does
        assert first["digest"] == by_step[first["step"]]
        assert first["step"] > max((r["step"] for r in records[v][:b] if r["committed"]),
                                   default=0)
        assert healed[-1]["committed"] and healed[-1]["n"] == REPLICAS
    for rs in records:
        for r in rs:
            if r["committed"]:
                low, high = sent_bound(r["n"], r["numel"])
                assert low <= r["sent"] <= high, (r, low, high)


def _check_late(records, late: int) -> None:
    """A replica that fell behind while alive: it had committed its last step, so it asked for
    the next quorum ahead (zero_grad), and that quorum found it behind while its forward and
    backward ran. It heals in step(), and its vote, made before the heal, counts nowhere: every
    replica commits that step with nothing applied. Then all vote again."""
    _committed_digests(records)
    rs = records[late]
    k = next(k for k, r in enumerate(rs) if r["paused"])
    healed = rs[k]
    assert healed["step"] > rs[k - 1]["step"] + 1, f"replica {late} did not fall behind: {rs}"
    assert healed["committed"] and healed["skipped"] and healed["n"] == REPLICAS, healed
    for i, others in enumerate(records):
        if i == late:
            continue
        assert any(r["committed"] and r["n"] == 2 for r in others), "no step without it"
        k = next(k for k, r in enumerate(others) if r["step"] == healed["step"])
        r = others[k]
        # nothing applied: the parameters of the step before, which the late one healed to
        assert r["committed"] and r["skipped"] and r["digest"] == others[k - 1]["digest"], r
        assert r["digest"] == healed["digest"]
    for rs in records:
        assert rs[-1]["committed"] and not rs[-1]["skipped"] and rs[-1]["n"] == REPLICAS


def _vote_bytes(n, d):
    """The wire format's vote/binary figure 2 (n-1)/n d/8, and it plus the padding: a step header (8
    bytes) and at most one 32-element word per plane of each of the n shards, per peer."""
    if n == 1:
        return 0, 0
    exact = 2 * (n - 1) / n * d / 8
    return exact, exact + (n - 1) * (8 + 2 * 4 * 2)


def _allreduce_bytes(n, d):
    """DiLoCo's Nesterov: a ring all-reduce of the fp32 pseudo-gradients and every replica's
    inner step (2 fp32 words each), 2 (n-1)/n 4 (d + 2n)."""
    exact = round(2 * (n - 1) / n * 4 * (d + 2 * n))
    return exact, exact


def test_a_replica_killed_mid_step_and_mid_sync_survivors_go_on_and_it_heals(tmp_path):
    # one set of processes for all (torch's import is most of this test's time): first
    # DistributedLion (replica 1 dies mid-step), then DiLoCo with the D-Lion outer step
    # (replica 2 dies mid-sync), then DiLoCo with Nesterov (replica 0 dies mid-sync), then
    # DistributedLion again with replicas 1 and 2 dying in the same step: replica 0 alone is
    # below min_replica_size, commits nothing and waits for the quorum until both restarts
    # have healed; each restarted replica goes on into the next phases
    # (last, DistributedLion with no failure: replica 2 pauses after committing step 3, past
    # the Lighthouse's wait, and the others go on without it: _check_late)
    runs = _run([("lion", (1,), 3, 8, None), ("dlion", (2,), 2, 5, None),
                 ("nesterov", (0,), 2, 5, None), ("lion2", (1, 2), 3, 8, None),
                 ("lion3", (), None, 8, (2, 3))], tmp_path)
    _check_late(runs["lion3"]["records"], late=2)
    _check(runs["lion"], _vote_bytes)
    _check(runs["lion2"], _vote_bytes)
    _check(runs["dlion"], _vote_bytes)
    _check(runs["nesterov"], _allreduce_bytes)
    # theta_bar is the same on every replica after every committed sync
    for kind in ("dlion", "nesterov"):
        thetas: dict = {}
        for rs in runs[kind]["records"]:
            for r in rs:
                if r["committed"]:
                    thetas.setdefault(r["step"], set()).add(r["theta"])
        assert all(len(t) == 1 for t in thetas.values()), kind


def test_manager_is_checked_and_torchft_is_imported_only_with_one():
    import subprocess
    import sys

    import torch
    from torchft.manager import Manager

    import dlion_kernels as dk

    model = torch.nn.Linear(2, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="manager must be a torchft.Manager"):
        dk.DistributedLion(model.parameters(), manager=object())
    with pytest.raises(TypeError, match="manager must be a torchft.Manager"):
        dk.DiLoCo(model, inner, sync_every=2, manager="manager")
    with pytest.raises(ValueError, match="applies only with manager="):
        dk.DistributedLion(model.parameters(), heal_momentum="peer")
    with pytest.raises(ValueError, match="applies only with manager="):
        dk.DiLoCo(model, inner, sync_every=2, heal_momentum="zero")
    # a Manager without its servers: enough for the checks made before anything starts
    manager = Manager.__new__(Manager)
    manager._use_async_quorum = True
    with pytest.raises(ValueError, match="use_async_quorum=False"):
        dk.DistributedLion(model.parameters(), manager=manager)
    manager._use_async_quorum = False
    with pytest.raises(ValueError, match="heal_momentum must be one of"):
        dk.DistributedLion(model.parameters(), manager=manager, heal_momentum="mine")
    with pytest.raises(ValueError, match="pass group=None"):
        dk.DistributedLion(model.parameters(), manager=manager, group=object())
    with pytest.raises(ValueError, match='hierarchy="auto"'):
        dk.DistributedLion(model.parameters(), manager=manager, hierarchy="auto")
    with pytest.raises(ValueError, match="pass group=None"):
        dk.DiLoCo(model, inner, sync_every=4, manager=manager, group=object())
    # without a manager torchft is never imported
    code = ("import sys, torch, dlion_kernels as dk; m = torch.nn.Linear(2, 2); "
            "dk.DistributedLion(m.parameters()); "
            "dk.DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), sync_every=2); "
            "import dlion_kernels.elastic; assert 'torchft' not in sys.modules, 'imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
