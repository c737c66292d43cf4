"""Elastic training composes with the rest (docs/composition.md): each run on torchft's quorum,
with no failure, gives the same parameters, bit for bit, as the same run on a plain gloo process
group of the same replicas.

Two replicas, started here with a torchft Lighthouse and a Manager per rank
(``launch.lighthouse``, ``launch.replica_manager``), run a list of cases one after the other;
the same cases then run on one gloo job of the same ranks (``launch.spawn``). Each case returns
the digest of every rank's parameters (FSDP2: of its local shards) and its stats, and the two
runs must agree, replica by replica and rank by rank.

Replicas of one process:
- ``overlap``: ``DistributedLion(overlap=True)``, several buckets during backward;
- ``scaler``: ``torch.amp.GradScaler`` on the CPU, with an overflow on one replica at one step
  (every replica skips it, every scale follows);
- ``diloco-ef``, ``diloco-sparse``, ``diloco-stream``: ``DiLoCo`` with the D-Lion outer step's
  error feedback, with SparseLoCo, and with 2 fragments streamed (``overlap_steps=1``);
- ``ckpt-lion``, ``ckpt-diloco``: a ``DistributedLion``, and a streaming ``DiLoCo`` with a sync
  in flight, save (``dk.save_state``) in the middle of the run; every replica stops; new
  processes under a new Lighthouse load and go on, and end where the uninterrupted run does.
Replicas of two ranks (each its own gloo job):
- ``hierarchy``: ``DistributedLion(hierarchy=2)``: the replica is the node;
- ``fsdp``: FSDP2 over the replica's ranks, ``DistributedLion``;
- ``diloco-fsdp``: FSDP2 over the replica's ranks, ``DiLoCo`` with its default outer step,
  2 fragments streamed; ``diloco-fsdp-nesterov``: the same with the fp32 Nesterov outer step
  (its decision over the replica's ranks from the all-reduce's words).

What elastic training does when a replica dies is ``test_elastic.py``'s and
``test_elastic_fsdp.py``'s (and the demo's).
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os

import pytest

torchft = pytest.importorskip("torchft")

from dlion_kernels import launch  # noqa: E402

REPLICAS = 2
ONE = ["overlap", "scaler", "diloco-ef", "diloco-sparse", "diloco-stream", "ckpt-lion",
       "ckpt-diloco"]
TWO = ["hierarchy", "fsdp", "diloco-fsdp", "diloco-fsdp-nesterov"]
STEPS = 8  # a case's steps (DiLoCo: inner steps)
SAVE_AT = {"ckpt-lion": 3, "ckpt-diloco": 6}  # steps taken at the save (DiLoCo: one in flight)


def _digest(tensors) -> str:
    h = hashlib.blake2b(digest_size=12)
    for t in tensors:
        h.update(t.detach().contiguous().view(-1).numpy().tobytes())
    return h.hexdigest()


def _model():
    import torch

    torch.manual_seed(0)  # the same initial weights on every rank
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 6))


def _loss(model, replica, position, t):
    import torch

    gen = torch.Generator().manual_seed(1000 * replica + 100 * position + t)
    x = torch.randn(8, 24, generator=gen)
    return model(x).pow(2).mean()


def _shard(model, ranks: int, mesh2d=None):
    """FSDP2 over this replica's ranks: its default group (elastic), or the shard dimension of
    the plain job's 2-D mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = mesh2d["shard"] if mesh2d is not None else init_device_mesh(
        "cpu", (ranks,), mesh_dim_names=("shard",))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _local(params):
    from dlion_kernels.exchange.sharded import own_shard

    return [own_shard(p) for p in params]


def _quorum(stats, manager) -> tuple:
    return (stats.participants, stats.committed) if manager is not None else (2, True)


def run_case(case: str, replica: int, position: int, manager=None, tmp=None):
    """One case on this rank; ``manager`` None: the plain job (the default group holds every
    rank of both replicas). Returns (digest per step, what the stats said per step)."""
    import torch
    import torch.distributed as dist

    import dlion_kernels as dk

    plain = manager is None
    elastic = {} if plain else {"manager": manager}
    model = _model()
    if case in ("fsdp", "diloco-fsdp", "diloco-fsdp-nesterov"):
        mesh2d = None
        if plain:
            from torch.distributed.device_mesh import init_device_mesh

            mesh2d = init_device_mesh("cpu", (REPLICAS, 2), mesh_dim_names=("replicate", "shard"))
        _shard(model, 2, mesh2d)
        if plain:
            elastic = {"device_mesh": mesh2d}
    params = list(model.parameters())
    if case.startswith("diloco") or case == "ckpt-diloco":
        return _diloco_case(case, model, replica, position, manager, elastic, tmp)
    kw = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01)
    if case == "overlap":
        kw.update(overlap=True, bucket_mb=0.002)  # several buckets of this tiny model
    if case == "hierarchy":
        kw.update(hierarchy=2)
    if case == "scaler":
        kw.update(nonfinite="skip")
    opt = dk.DistributedLion(params, **kw, **elastic)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if case == "scaler" else None
    first, stop = _checkpoint(case, replica, tmp, model, opt, None)
    digests, seen = [], []
    for t in range(first, STEPS):
        if t == stop:
            _save(case, replica, tmp, model, opt, None)
            break  # every replica stops here
        opt.zero_grad()
        loss = _loss(model, replica, position, t)
        if scaler is not None:
            scaler.scale(loss).backward()
            if t == 2 and replica == 1:  # an overflow on one replica: every replica skips
                params[0].grad.view(-1)[0] = float("inf")
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        s = opt.last_stats
        digests.append(_digest(_local(params)))
        seen.append((s.skipped, *_quorum(s, manager)) + (
            () if scaler is None else (scaler.get_scale(),)))
    if not plain:
        opt.elastic.close()
    if plain and dist.is_initialized():
        dist.barrier()
    return digests, seen


def _refuse_ddp_hook(manager) -> None:
    """DDP's comm hook refuses an elastic optimizer, registering nothing."""
    import torch
    import torch.distributed as dist

    import dlion_kernels as dk

    model = _model()
    opt = dk.DistributedLion(model.parameters(), lr=1e-2, manager=manager)
    # DDP needs a default group: this process alone (after the cases, which need none)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    with pytest.raises(ValueError, match="manager="):
        dk.register_ddp_comm_hook(ddp, opt)
    assert not opt.ddp_hooked  # nothing registered
    opt.elastic.close()


def _diloco_case(case, model, replica, position, manager, elastic, tmp):
    import torch
    import torch.distributed as dist

    import dlion_kernels as dk

    params = list(model.parameters())
    kw = dict(sync_every=4, outer_lr=0.05)
    if case == "diloco-ef":
        kw["outer_options"] = dk.DLionOuterOptions(error_feedback=True, ef_decay=0.5)
    elif case == "diloco-sparse":
        kw.update(outer="sparseloco", outer_lr=1.0,
                  outer_options=dk.SparseLoCoOptions(chunk=64, topk=8))
    else:  # 2 fragments, streamed
        kw.update(fragments=2, overlap_steps=1)
    if case == "diloco-fsdp-nesterov":
        kw.update(outer="nesterov", outer_lr=0.7)
    inner = torch.optim.AdamW(params, lr=1e-2) if case.startswith("diloco-fsdp") else \
        torch.optim.SGD(params, lr=0.05, momentum=0.5)
    diloco = dk.DiLoCo(model, inner, **kw, **elastic)
    first, stop = _checkpoint(case, replica, tmp, model, diloco, inner)
    digests, seen = [], []
    for t in range(first, STEPS):
        if t == stop:
            _save(case, replica, tmp, model, diloco, inner)
            break  # every replica stops here
        inner.zero_grad()
        _loss(model, replica, position, t).backward()
        inner.step()
        s = diloco.step()
        if s is not None:
            seen.append((s.step, s.skipped, *_quorum(s, manager)))
        digests.append(_digest(_local(params)))
    if manager is not None:
        diloco.elastic.close()
    if manager is None and dist.is_initialized():
        dist.barrier()
    return digests, seen


def _checkpoint(case, replica, tmp, model, obj, inner) -> tuple:
    """(first step, the step to save and stop at or None): a ``ckpt-`` case on a replica
    saves at ``SAVE_AT`` and stops; run again (a new job), it loads what it saved and goes on.
    The plain run (``tmp`` None) goes through."""
    import torch

    import dlion_kernels as dk

    if not case.startswith("ckpt") or tmp is None:
        return 0, None
    where = os.path.join(tmp, f"{case}-replica{replica}")
    if not os.path.exists(os.path.join(where, "manifest.json")):
        return 0, SAVE_AT[case]
    saved = torch.load(os.path.join(where, "model.pt"), weights_only=False)
    model.load_state_dict(saved["model"])
    if inner is not None:
        inner.load_state_dict(saved["inner"])
    dk.load_state(obj, where)
    return SAVE_AT[case], None


def _save(case, replica, tmp, model, obj, inner) -> None:
    import torch

    import dlion_kernels as dk

    where = os.path.join(tmp, f"{case}-replica{replica}")
    dk.save_state(obj, where)
    torch.save({"model": model.state_dict(),
                "inner": None if inner is None else inner.state_dict()},
               os.path.join(where, "model.pt"))


# ----------------------------------------------------------------------------- the two runs


def _replica_rank(cases, replica, position, ranks, house, ports, tmp, out) -> None:
    """One rank of one replica through ``cases``, each under its own Manager's quorum (and its
    own store: a Manager's rank 0 publishes its address there, under a key of its own)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    results = {}
    try:
        if ranks > 1:  # the replica's own job: its default group holds its ranks
            store = dist.TCPStore("localhost", ports[0], is_master=False,
                                  wait_for_workers=False)
            dist.init_process_group("gloo", store=dist.PrefixStore("replica", store),
                                    rank=position, world_size=ranks)
        for case, port in zip(cases, ports[1:]):
            manager = launch.replica_manager(
                f"{case}_{replica}", house, rank=position, world_size=ranks,
                store_port=port if ranks > 1 else None, min_replica_size=REPLICAS,
                timeout=30.0, quorum_timeout=60.0)
            results[case] = run_case(case, replica, position, manager, tmp)
            if case == cases[-1] and ranks == 1 and replica == 0 and "overlap" in cases:
                _refuse_ddp_hook(manager)
            launch.end_replica(manager, leave=False)  # the replica's ranks meet first
        torch.save(results, out)
    except BaseException:
        import traceback

        with open(out + ".err", "w") as f:
            f.write(traceback.format_exc())
    os._exit(0)  # torchft's threads: leave at once


def _elastic(cases, ranks, tmp) -> dict:
    """Both replicas through ``cases`` under one Lighthouse; results per (replica, position)."""
    from torch.distributed import TCPStore

    house = launch.lighthouse(min_replicas=REPLICAS, join_timeout_ms=10000)
    # per replica: a store for its gloo job and one per case for its Manager, kept here
    stores = [[TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
               for _ in range(1 + len(cases))] for _ in range(REPLICAS)]
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*launch.PRELOAD, "torchft", "torch.distributed.fsdp",
                                "dlion_kernels.optim.dlion", "dlion_kernels.local_steps.diloco",
                                "dlion_kernels.kernels.native"])
    out = os.path.join(tmp, "r{}-p{}.pt").format
    procs = {(r, q): ctx.Process(target=_replica_rank, args=(
        cases, r, q, ranks, house.address(), [s.port for s in stores[r]], tmp, out(r, q)))
        for r in range(REPLICAS) for q in range(ranks)}
    try:
        for p in procs.values():
            p.start()
        for p in procs.values():
            p.join(timeout=300)
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
        house.shutdown()
    import torch

    errors = []
    for (r, q), p in procs.items():
        if os.path.exists(out(r, q) + ".err"):
            with open(out(r, q) + ".err") as f:
                errors.append(f"replica {r} rank {q}:\n{f.read()}")
        elif not os.path.exists(out(r, q)):
            errors.append(f"replica {r} rank {q}: exit code {p.exitcode}, no result")
    if errors:
        pytest.fail("\n".join(errors))
    return {(r, q): torch.load(out(r, q), weights_only=False) for (r, q) in procs}


def _plain_rank(rank, n, cases, ranks):
    replica, position = divmod(rank, ranks)
    return {case: run_case(case, replica, position) for case in cases}


def _plain(cases, ranks) -> dict:
    res = launch.spawn(REPLICAS * ranks, _plain_rank, cases, ranks, timeout=300)
    return {divmod(rank, ranks): r for rank, r in enumerate(res)}


def _same(elastic, plain, cases) -> None:
    """Bit for bit after every step, skipped where the plain run skipped, and every step (sync)
    committed by both replicas (the plain run's stats read as 2 participants, committed)."""
    for key, mine in elastic.items():
        for case in cases:
            assert mine[case] == plain[key][case], (case, key, mine[case], plain[key][case])


def test_replicas_of_one_process_match_the_plain_run(tmp_path):
    elastic = _elastic(ONE, 1, str(tmp_path))
    # every replica stopped at its checkpoint: a new job (new processes, a new Lighthouse)
    # loads it and goes on
    resumed = _elastic([c for c in ONE if c.startswith("ckpt")], 1, str(tmp_path))
    plain = _plain(ONE, 1)
    for key in elastic:
        for case in resumed[key]:
            (before, seen), (after, seen_after) = elastic[key][case], resumed[key][case]
            elastic[key][case] = (before + after, seen + seen_after)
    _same(elastic, plain, ONE)
    seen = elastic[(0, 0)]["scaler"][1]
    assert seen[2][0] and not seen[1][0], "the step with the overflow was skipped everywhere"
    assert seen[2][-1] < seen[1][-1], "and every scale backed off"


def test_replicas_of_two_ranks_match_the_plain_run(tmp_path):
    elastic = _elastic(TWO, 2, str(tmp_path))
    plain = _plain(TWO, 2)
    _same(elastic, plain, TWO)
