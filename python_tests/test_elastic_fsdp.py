"""Elastic training of FSDP2 replica groups on torchft (dlion_kernels/elastic.py), with real
processes on gloo: an in-process torchft ``LighthouseServer`` and 2 replicas of 2 ranks each.

Each replica is its own torch.distributed job, as torchft's HSDP runs: its two ranks make their
default gloo group from the replica's own TCPStore, shard the model over it with ``fully_shard``
(uneven shards included: a 5-row layer over 2 ranks), and each rank has its own
``Manager(rank=<position in the replica>, world_size=2, replica_id=<the replica>,
min_replica_size=1, use_async_quorum=False)``. ``DistributedLion(model.parameters(),
manager=manager, heal_momentum="peer")`` votes each local shard with the rank at the same
position in the other replica, over the manager's process group; nothing runs over all four
processes.

Replica 1 loses one of its ranks, in two runs: its rank at shard position 1, then the one at
position 0 (which also runs the replica's ManagerServer), kills itself (SIGKILL) in the middle of
the step after its first commit with both replicas at manager step 3 or later (inside the
all_gather of the tally, after the all_to_all of the votes). Its other rank finishes its own
vote, fails in the replica's header gather, and cannot get a commit decision (torchft's
should_commit waits for every rank of the replica, or finds the replica's ManagerServer gone):
it raises ``DistributedStepError`` naming should_commit, within the manager's timeout, with
nothing applied, and its process ends. The test
then waits for replica 0 to commit a step alone (min_replica_size=1) and starts both ranks of
replica 1 again, with the same replica id and a fresh store. Every rank writes one line per
step: the manager step after it, whether it committed, the participants, the bytes, its local
elements, a digest of its local shards, and a digest of its momentum and its step count as the
quorum left them (before the step). Checked:

- replica 0 never raises (exit code 0); its step of the kill does not commit on either rank and
  changes nothing; it then commits steps alone (n = 1) and, after the heal, with both;
- replica 1's surviving rank raises the error above, and only it;
- after every committed manager step the two replicas' ranks at the same shard position hold
  bit-identical shards; a step that did not commit changed nothing on that rank;
- replica 1's restarted ranks heal per shard position: their first step is at replica 0's step,
  its first quorum left them the momentum (``"peer"``) and step count of the rank at their
  position in replica 0, they end the step bit-identical with it, and they vote again until the
  end (committed, 2 participants, at least 3 steps);
- bytes per step: between replicas, the wire format's figure for n voters on the rank's local
  elements (2 (n-1)/n d/8 plus the padding of each tensor to 32-element words, exactly the
  all_to_all and all_gather sizes); inside the replica, the header gather: (L - 1) n 2 words.

With ``nonfinite="skip"``, replica 0's rank at shard position 1 puts a NaN into its gradient in
the second step after the heal: that step commits and is skipped on all four ranks, parameters
and momenta unchanged (the ranks at position 0 learn it only from their replica's header gather).
The constructor's checks (a manager made for another shard position, ``group=``) are run inside
the same processes, before training.

``DLION_ELASTIC_FSDP_REPLICAS=3`` runs the same test with 3 replicas x 2 shards (replica 1 dies;
replicas 0 and 2 go on with 2 participants, and the restart heals from either): by hand, not in
the suite, whose 2 shared cores are too few for its 8 processes with the restarts.

What is not tested here, and why: GPU process groups (no GPU where the tests run); DiLoCo on an
FSDP2 replica (``DiLoCo(manager=)`` runs one process per replica).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import multiprocessing as mp
import os
import signal
import time
from datetime import timedelta

import pytest

torchft = pytest.importorskip("torchft")

from test_elastic import _exit_codes, _kill_left, _vote_bytes, _wait_for  # noqa: E402

from dlion_kernels.demo.elastic import read_records  # noqa: E402

# 3 replicas x 2 shards (8 processes with the restarts) are too many for the 2 shared cores the
# suite runs on; run them by hand: DLION_ELASTIC_FSDP_REPLICAS=3 pytest <this file> -n 0
REPLICAS, SHARDS = int(os.environ.get("DLION_ELASTIC_FSDP_REPLICAS", "2")), 2
VICTIM, KILL_AT, TARGET, TOGETHER = 1, 3, 9, 3
OTHERS = [r for r in range(REPLICAS) if r != VICTIM]
TIMEOUT = 10  # seconds: the managers' timeout (their process groups' and should_commit's)
POISONED = 1  # the shard position of replica 0 given a NaN gradient in the second step after
# the heal


def _digest(tensors) -> str:
    h = hashlib.blake2b(digest_size=12)
    for t in tensors:
        h.update(t.detach().contiguous().view(-1).numpy().tobytes())
    return h.hexdigest()


def _arm_kill(armed) -> None:
    """SIGKILL this process inside the all_gather of the tally of its first step with both
    replicas once ``armed()``."""
    from dlion_kernels import elastic

    original = elastic.ManagerGroup.all_gather_single

    def all_gather_single(self, *args):
        if armed() and self.n == REPLICAS:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, *args)

    elastic.ManagerGroup.all_gather_single = all_gather_single


def _checks_at_construction(model, manager, position) -> None:
    """The constructor refuses a manager made for another shard position, and group=; on both
    ranks of the replica alike (its start check runs over the shard group)."""
    from torchft.manager import Manager

    import dlion_kernels as dk

    other = Manager.__new__(Manager)  # no servers: enough for the checks before anything starts
    other._use_async_quorum = False
    other._group_rank, other._group_world_size = 1 - position, SHARDS
    with pytest.raises(ValueError, match=f"rank={position} and world_size={SHARDS}"):
        dk.DistributedLion(model.parameters(), lr=1e-2, manager=other)
    import torch.distributed as dist

    with pytest.raises(ValueError, match="pass group=None"):  # the replicas are torchft's
        dk.DistributedLion(model.parameters(), lr=1e-2, manager=manager,
                           group=dist.new_group([dist.get_rank()],
                                                use_local_synchronization=True))


def _rank(replica, position, lighthouse, store_port, kill, check, out, go=None) -> None:
    import torch

    import dlion_kernels.elastic  # noqa: F401  (imported ahead: the restart starts at once)
    import dlion_kernels.optim.dlion  # noqa: F401

    torch.set_num_threads(1)
    if go is not None:
        go.wait()
    import torch.distributed as dist
    from torch.distributed import PrefixStore, TCPStore
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    import dlion_kernels as dk
    from dlion_kernels import launch

    store = TCPStore("localhost", store_port, is_master=False, wait_for_workers=False)
    # the replica's own job: its default group is its shard group, nothing spans the replicas
    dist.init_process_group("gloo", store=PrefixStore("replica", store), rank=position,
                            world_size=SHARDS, timeout=timedelta(seconds=30))
    mesh = init_device_mesh("cpu", (SHARDS,), mesh_dim_names=("shard",))
    manager = launch.replica_manager(f"fsdp_{replica}", lighthouse, rank=position,
                                     world_size=SHARDS, store_port=store_port,
                                     min_replica_size=1, timeout=TIMEOUT, quorum_timeout=90.0,
                                     connect_timeout=timedelta(seconds=20))
    torch.manual_seed(0)  # the same initial weights everywhere (a restarted one heals anyway)
    model = torch.nn.Sequential(torch.nn.Linear(40, 24), torch.nn.Tanh(), torch.nn.Linear(24, 5))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if check:
        _checks_at_construction(model, manager, position)
    opt = dk.DistributedLion(model.parameters(), lr=1e-2, manager=manager, heal_momentum="peer",
                             nonfinite="skip")
    params = list(model.parameters())
    seen = {"failed": False, "alone": False, "together": 0, "poisoned": False}
    armed = {"now": False}  # set on both ranks of the replica at the same step (same records)
    if kill:
        _arm_kill(lambda: armed["now"])
    lines = open(out, "a")
    iteration = 0
    while True:
        iteration += 1
        gen = torch.Generator().manual_seed(1000 * replica + 100 * position + 7 * iteration)
        x = torch.randn(8, 40, generator=gen)
        opt.zero_grad()  # the quorum (a restarted replica heals here)
        momentum = _digest([opt.state[p]["exp_avg"].to_local() for p in params])
        counts = sorted({opt.state[p]["step"] for p in params})
        model(x).pow(2).mean().backward()
        if replica == 0 and position == POISONED and seen["together"] == 1 and \
                not seen["poisoned"]:  # one shard of one replica: every rank must skip
            seen["poisoned"] = True
            with torch.no_grad():
                params[0].grad.to_local().view(-1)[0] = float("nan")
        try:
            opt.step()
        except Exception as e:  # recorded for the test, which expects it on one rank only
            with open(out + ".error", "w") as f:
                json.dump(dict(t=time.time(), type=type(e).__name__, message=str(e)), f)
            os._exit(3)
        s = opt.last_stats
        with torch.no_grad():
            local = [p.to_local() for p in params]  # this rank's shards
        record = dict(t=time.time(), step=s.manager_step, committed=s.committed, skipped=s.skipped,
                      n=s.participants, sent=s.bytes_sent, inter=s.inter_node_bytes_sent,
                      intra=s.intra_node_bytes_sent, shards=s.shards, numel=s.numel,
                      sizes=[t.numel() for t in local], digest=_digest(local),
                      momentum=momentum, counts=counts)
        lines.write(json.dumps(record) + "\n")
        lines.flush()
        # replica 0 goes on until it has lived through the kill (a step that failed, then one
        # alone) and then committed TOGETHER steps with the healed replica 1, which stops after
        # as many: the same on both ranks of a replica (one quorum, one should_commit)
        seen["failed"] |= not record["committed"]
        seen["alone"] |= seen["failed"] and record["committed"] and record["n"] == REPLICAS - 1
        both = record["committed"] and record["n"] == REPLICAS
        seen["together"] += both and (replica == VICTIM or seen["alone"])
        if not kill and seen["together"] >= TOGETHER and record["step"] >= TARGET:
            break  # (a victim only dies)
        # die in the step after this replica's first commit with both at KILL_AT or later
        armed["now"] = record["committed"] and record["n"] == REPLICAS and \
            record["step"] >= KILL_AT or armed["now"]
        if record["n"] < REPLICAS:
            time.sleep(0.02)  # waiting for the restart: leave it the CPU
    lines.close()
    launch.end_replica(manager)  # the replica's ranks meet, then leave at once


def _run(tmp_path, killed: int) -> tuple[dict, dict, float, dict]:
    """Both replicas, the rank of replica 1 at shard position ``killed`` killed, then replica 1
    restarted. Returns each rank's records, how many lines each of replica 1's ranks wrote before
    it ended, the time of the kill, and what replica 1's surviving rank raised."""
    from torch.distributed import TCPStore

    from dlion_kernels import launch

    tmp = str(tmp_path)
    # a join timeout of 4 s, as test_elastic.py: at 1 s a loaded machine lets a slow replica
    # miss quorum after quorum
    house = launch.lighthouse(min_replicas=1, join_timeout_ms=4000)
    # one store per replica and start (a restart gets a fresh one: no stale keys), kept here so
    # that a store outlives its replica's processes
    stores = {(r, k): TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
              for r, k in [(r, 0) for r in range(REPLICAS)] + [(VICTIM, 1)]}
    path = os.path.join(tmp, "replica{}-rank{}.jsonl").format
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "torchft",
                                "torch.distributed.fsdp", "dlion_kernels.elastic",
                                "dlion_kernels.optim.dlion", "dlion_kernels.kernels.native",
                                "dlion_kernels.kernels.reference", "dlion_kernels.demo.elastic"])
    go = ctx.Event()

    def process(replica, position, start, restart):
        return ctx.Process(target=_rank, args=(
            replica, position, house.address(), stores[(replica, start)].port,
            replica == VICTIM and position == killed and not restart, not restart,
            path(replica, position),
            go if restart else None))

    firsts = {(r, q): process(r, q, 0, False) for r in range(REPLICAS) for q in range(SHARDS)}
    restarts = {(VICTIM, q): process(VICTIM, q, 1, True) for q in range(SHARDS)}
    procs = list(firsts.values()) + list(restarts.values())
    try:
        for p in procs:
            p.start()
        firsts[(VICTIM, killed)].join(timeout=240)
        assert firsts[(VICTIM, killed)].exitcode == -signal.SIGKILL, "replica 1's rank was to die"
        died = time.time()
        left = firsts[(VICTIM, 1 - killed)]  # replica 1's other rank: raises, then ends
        left.join(timeout=TIMEOUT + 60)
        assert left.exitcode == 3, f"replica 1's surviving rank: exit code {left.exitcode}"
        with open(path(VICTIM, 1 - killed) + ".error") as f:
            error = json.load(f)
        before = {q: len(read_records(path(VICTIM, q))) for q in range(SHARDS)}

        def went_on():  # the other replicas committed a step without replica 1 after the death
            return all(any(r["committed"] and r["n"] == REPLICAS - 1 and r["t"] > died
                           for r in read_records(path(o, q))) for o in OTHERS
                       for q in range(SHARDS))

        _wait_for("the others stepping without it", went_on, [p for p in procs if p is not left],
                  limit=240)
        go.set()
        current = [firsts[(o, q)] for o in OTHERS for q in range(SHARDS)] + \
            list(restarts.values())
        codes = _exit_codes(current, 240)
    finally:
        _kill_left(procs)
        house.shutdown()
    assert codes == [0] * len(codes), f"replica 0 and the restarted replica 1 must end: {codes}"
    records = {(r, q): read_records(path(r, q)) for r in range(REPLICAS) for q in range(SHARDS)}
    raised = sorted(os.path.basename(p) for p in os.listdir(tmp) if p.endswith(".error"))
    assert raised == [os.path.basename(path(VICTIM, 1 - killed)) + ".error"], raised
    return records, before, died, error


# position 0 also runs the replica's ManagerServer: with it gone, the other rank's should_commit
# fails at once instead of waiting for the manager's timeout
@pytest.mark.parametrize("killed", [1, 0], ids=["position1", "position0-with-manager-server"])
def test_fsdp2_replica_groups_vote_survive_a_dead_replica_and_heal_per_shard(tmp_path, killed):
    records, before, died, error = _run(tmp_path, killed)
    # replica 1's surviving rank: one clear error, within the manager's timeout, nothing applied
    assert error["type"] == "DistributedStepError", error
    assert "collective should_commit failed" in error["message"], error
    assert "nothing of this step was applied" in error["message"], error
    assert "restart all its ranks" in error["message"], error
    assert error["t"] - died < TIMEOUT + 30, (error["t"] - died, error)
    # bit-identical per shard position after every committed step; nothing changes otherwise
    by_step: dict = {}
    for (r, q), rs in records.items():
        prev = None
        for k, rec in enumerate(rs):
            if rec["committed"]:
                by_step.setdefault((rec["step"], q), set()).add(rec["digest"])
            elif prev is not None and not (r == VICTIM and k == before[q]):
                assert rec["digest"] == prev["digest"], ("a step that did not commit changed it",
                                                         r, q, rec)
            prev = rec
    assert all(len(d) == 1 for d in by_step.values()), \
        {s: d for s, d in by_step.items() if len(d) > 1}
    # the ranks of a replica take the same quorum and the same commit decision
    for r in range(REPLICAS):
        a, b = records[(r, 0)], records[(r, 1)]
        assert [(x["step"], x["committed"], x["n"]) for x in a] == \
            [(x["step"], x["committed"], x["n"]) for x in b], r
    # the others: their step of the kill does not commit, they go on without replica 1, then
    # with the healed one
    for o, q in itertools.product(OTHERS, range(SHARDS)):
        rs = records[(o, q)]
        assert any(not rec["committed"] for rec in rs), "the step of the kill cannot commit"
        assert any(rec["committed"] and rec["n"] == REPLICAS - 1 and rec["t"] > died
                   for rec in rs), "no step without replica 1"
        assert rs[-1]["committed"] and rs[-1]["n"] == REPLICAS and rs[-1]["step"] >= TARGET
        # a step with both replicas before the kill: the vote ran between replicas
        assert any(rec["committed"] and rec["n"] == REPLICAS and rec["t"] < died for rec in rs)
    # replica 1's restarted ranks heal from the rank at their position in a live replica
    for q in range(SHARDS):
        old, healed = records[(VICTIM, q)][:before[q]], records[(VICTIM, q)][before[q]:]
        assert healed, f"the restarted rank {q} of replica 1 took no step"
        first = healed[0]
        assert first["committed"] and first["n"] == REPLICAS, first
        assert first["digest"] in by_step[(first["step"], q)]
        assert first["step"] > max((rec["step"] for rec in old if rec["committed"]), default=0)
        twins = [next(rec for rec in records[(o, q)] if rec["committed"]
                      and rec["step"] == first["step"]) for o in OTHERS]
        # "peer": the momentum and the step count the quorum left are those of its twin (the
        # rank at its position in the replica it healed from)
        assert any(first["momentum"] == twin["momentum"] and first["counts"] == twin["counts"]
                   for twin in twins)
        assert first["counts"] == [first["step"] - 1]
        assert all(rec["committed"] and rec["n"] == REPLICAS for rec in healed)
        assert len(healed) >= TOGETHER and healed[-1]["step"] == records[(0, q)][-1]["step"]
    # the NaN in one shard of one replica: the step commits and is skipped on all four ranks
    # (the other shard position learns it from the replica's header gather), nothing changes
    poisoned = {rec["step"] for rs in records.values() for rec in rs if rec["skipped"]
                and rec["committed"]}
    assert len(poisoned) == 1, poisoned
    for (r, q), rs in records.items():
        k = next(k for k, rec in enumerate(rs) if rec["step"] in poisoned and rec["committed"])
        assert rs[k]["skipped"] and rs[k]["digest"] == rs[k - 1]["digest"], (r, q)
        assert rs[k + 1]["momentum"] == rs[k]["momentum"], (r, q)  # nor the momentum
    # bytes: the flat wire figure on the local elements between replicas, headers inside
    numels = set()
    for (r, q), rs in records.items():
        for rec in rs:
            numels.add((q, rec["numel"]))
            assert rec["shards"] == SHARDS
            if rec["committed"]:
                n, blocks = rec["n"], sum(-(-k // 32) for k in rec["sizes"])
                owned = -(-blocks // n)  # 32-element words each rank tallies (binary votes)
                # the all_to_all of the votes (a 2-word header and the words of each peer's
                # part) and the all_gather of the tally, to and from each of the n - 1 peers
                assert rec["inter"] == (n - 1) * 4 * ((2 + owned) + owned), rec
                low, high = _vote_bytes(n, rec["numel"])  # 2 (n-1)/n d/8 plus padding
                assert low <= rec["inter"] <= high + (n - 1) * 4 * len(rec["sizes"]), rec
                assert rec["intra"] == (SHARDS - 1) * 4 * 4  # the replica's agreement
                assert rec["sent"] == rec["inter"] + rec["intra"]
            assert rec["numel"] == sum(rec["sizes"])
    # local elements: 24x40 + 24 in halves, 5x24 + 5 as 3 and 2 rows
    assert numels == {(0, 480 + 12 + 72 + 3), (1, 480 + 12 + 48 + 2)}
