"""Per-rank optimizer checkpoints: ``save_state(opt, directory)`` / ``load_state(opt, directory)``.

D-Lion's momentum differs on every rank, so saving rank 0's optimizer state the way one does
with DDP silently gives every rank rank 0's momentum on resume. Here every rank writes its own
file and rank 0 writes a manifest last:

    directory/
      rank00000-of-00004.<tag>.pt      torch.save of that rank's state dict
      ...
      manifest.json                    format, world size, the job's world size and the saving
                                       ranks, kind, hierarchy, FSDP2 mesh, topology, versions,
                                       parameter shapes, and per file its name, bytes and sha256

The checkpoint's ranks are the ranks of the job that hold the object's state, never the group
its exchange runs in: an FSDP2 optimizer or DiLoCo votes in its replicate group, yet every rank
of the mesh holds its own piece of the state. By default they are the whole job (the default
group; file i is global rank i). ``group=`` names a subset of the job instead; one that lacks a
rank holding the object's state (the replicate group of a mesh, say) is refused with
``CheckpointError`` on every rank before anything is written: the files of several such groups
in one directory would overwrite and remove each other's.

``<tag>`` is new for every save, so a save never overwrites the files the current manifest names:
a crash mid-save leaves the previous checkpoint (its manifest and files) loadable. Files are
written to a temporary name, flushed to disk and renamed (``os.replace``); the manifest is written
the same way by rank 0 once every rank has reported its file, and only then are the previous
save's files removed. The directory must be visible to every rank (a shared file system, as for
``torch.distributed.checkpoint``'s ``FileSystemWriter``).

Loading: every rank reads and checks what it needs (manifest, sizes, sha256, that the saved state
fits the optimizer) without changing anything; the ranks then agree (one all_gather) and either
all load or all raise ``CheckpointError`` naming the file and what is wrong.

Failures: a rank that dies or stalls inside save_state/load_state makes the others raise
``DistributedStepError`` naming the call and the collective (``exchange/collectives.py``), bounded
by the group's timeout; the previous checkpoint stays loadable, and a load changes nothing.

Resizing (the manifest's world size differs from the group's): every new rank takes the MEAN of
the old ranks' floating-point state (momenta), accumulated in float64 in rank order, so all new
ranks start with the same momentum; integer and other entries (step counts) are taken from old
rank 0 and must agree on all old ranks. The mean of the momenta is the momentum of the mean
gradient, the natural estimate when the data split changes. Resizing a checkpoint saved with a
hierarchy (sharded momentum) is refused. A checkpoint of FSDP2-sharded state (``DistributedLion``
or ``DiLoCo`` over DTensor parameters) holds each rank's local shard: it loads on the same mesh
only (the same replicas x shards and the same rank at each position); another mesh or world
size is refused (``torch.distributed.checkpoint`` reshards a ``DistributedLion``'s momenta
between meshes with the same number of replicas: docs/fsdp.md).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import secrets
import time

import torch
import torch.distributed as dist

from ._version import __version__
from .exchange.collectives import collective
from .exchange.sharded import is_dtensor

FORMAT = "dlion_kernels.checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint cannot be saved or loaded; nothing was changed on any rank."""


# ----------------------------------------------------------------------------- helpers


def _get_state(obj) -> dict:
    if hasattr(obj, "optimizer_state_dict"):  # DecentralizedDataParallel
        return obj.optimizer_state_dict()
    if hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):
        return obj.state_dict()
    raise TypeError(
        "save_state/load_state need an optimizer (state_dict/load_state_dict) or an object with "
        f"optimizer_state_dict/load_optimizer_state_dict, got {type(obj).__name__}"
    )


def _set_state(obj, state: dict) -> None:
    if hasattr(obj, "load_optimizer_state_dict"):
        obj.load_optimizer_state_dict(state)
    else:
        obj.load_state_dict(state)


def _check_object(obj) -> None:
    ok = (hasattr(obj, "optimizer_state_dict") and hasattr(obj, "load_optimizer_state_dict")) or (
        hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"))
    if not ok:
        raise TypeError(
            "save_state/load_state need an optimizer (state_dict/load_state_dict) or an object "
            f"with optimizer_state_dict/load_optimizer_state_dict, got {type(obj).__name__}"
        )


def _sharding(obj):
    """The FSDP2 layout (``exchange.sharded.Sharding``) of a ``DistributedLion`` or ``DiLoCo``
    over DTensor parameters, else None."""
    if isinstance(getattr(type(obj), "sharding", None), property):
        return obj.sharding  # DistributedLion (a copy makes its runtime state here)
    return getattr(obj, "_sharding", None)


def _mesh_record(sharding) -> dict | None:
    """The mesh of FSDP2-sharded state as the manifest records it: replicas N, shards L and the
    global rank at each (replica, shard) position (N lists of L)."""
    if sharding is None:
        return None
    layout = sharding.mesh.mesh
    if sharding.replicate_dim is None:
        layout = layout.reshape(1, -1)
    elif sharding.replicate_dim == 1:
        layout = layout.t()
    return dict(replicas=sharding.replicas, shards=sharding.shards, ranks=layout.tolist())


def _holders(obj, mesh) -> list[int]:
    """The global ranks that hold a part of ``obj``'s state: its mesh's (FSDP2), its group's
    (None: the whole job), or this rank alone (an object without a group: a plain optimizer)."""
    if mesh is not None:
        return sorted(r for row in mesh["ranks"] for r in row)
    group = getattr(obj, "group", False)
    if group is None:
        group = dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        return [dist.get_rank()]
    return sorted(dist.get_process_group_ranks(group))


def _rank_and_size(obj, group, directory):
    """(group, rank in it, its size, problem): the ranks that save or load together; None: the
    whole job. A problem (a string) is a ``group`` without every rank that holds the object's
    state; it must reach every rank of the group before anyone raises. Raises
    ``CheckpointError`` at once where this rank is not in ``group``."""
    if not (dist.is_available() and dist.is_initialized()):
        return None, 0, 1, None
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be None (the whole job) or a "
                        f"torch.distributed.ProcessGroup, got {type(group).__name__}")
    if group is None:  # the job's ranks, whatever group the object exchanges in
        return dist.group.WORLD, dist.get_rank(), dist.get_world_size(), None
    me, holders = dist.get_rank(), _holders(obj, _mesh_record(_sharding(obj)))
    what = type(obj).__name__
    members = dist.get_process_group_ranks(group)
    if me not in members:
        raise CheckpointError(f"checkpoint {directory}: rank {me} is not in group= (ranks "
                              f"{members}); every rank of the group calls it with its own object")
    problem = None
    missing = sorted(set(holders) - set(members))
    if missing:
        problem = (f"group= has ranks {sorted(members)}, but the {what}'s state is held by ranks "
                   f"{holders} (its exchange may run in a subgroup, such as an FSDP2 mesh's "
                   f"replicate group): ranks {missing} would be left out of the checkpoint, or "
                   "write theirs over it. Pass group=None (the whole job) or a group with all "
                   "of them")
    return group, dist.get_rank(group), dist.get_world_size(group), problem


def _call(directory, what: str, name: str, fn, *args, **kwargs) -> None:
    """An object collective of save_state/load_state: a dead or stalled peer raises
    ``DistributedStepError`` naming the call, the directory and the collective."""
    applied = ("this save may not be complete: the directory's manifest names a complete "
               "checkpoint, this one or the previous" if what == "save"
               else "nothing was loaded on this rank")
    collective(name, directory, fn, *args, label=f"checkpoint {what} of", applied=applied,
               **kwargs)


def _all_gather_object(value, group, n, directory, what: str, name: str):
    if n == 1:
        return [value]
    out = [None] * n
    _call(directory, what, f"all_gather_object({name})", dist.all_gather_object, out, value,
          group=group)
    return out


def _broadcast_object(values: list, group, directory, name: str) -> None:
    """Rank 0 of ``group``'s ``values`` (a one-element list) on every rank."""
    _call(directory, "save", f"broadcast_object_list({name})", dist.broadcast_object_list,
          values, src=dist.get_global_rank(group, 0), group=group)


def _describe(obj) -> dict:
    """What must match between the saving and the loading object: its class, the hierarchy L
    (``DistributedLion.ranks_per_node``; None when flat), the gossip topology's name
    (``DecentralizedDataParallel.topology``, a ``Topology``), the FSDP2 mesh (``_mesh_record``;
    None for plain tensors) and the parameter shapes."""
    kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
    ranks_per_node = getattr(obj, "ranks_per_node", 1)
    topology = getattr(obj, "topology", None)
    topology = getattr(topology, "name", topology)  # the name: its world size may change
    shapes = None
    if isinstance(getattr(obj, "param_groups", None), list):
        shapes = [[list(p.shape) for p in g["params"]] for g in obj.param_groups]
    return dict(kind=kind, hierarchy=ranks_per_node if ranks_per_node > 1 else None,
                topology=None if topology is None else str(topology),
                mesh=_mesh_record(_sharding(obj)), param_shapes=shapes)


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- save


def save_state(obj, directory, *, group=None) -> str:
    """Save this rank's state of ``obj`` into ``directory``: any object the library makes
    (``DistributedLion`` on every path, ``DiLoCo``, ``DecentralizedDataParallel``), any torch
    optimizer, or an object with ``optimizer_state_dict()``. Every rank of the group calls it
    with its own object. Returns the manifest's path.

    group: the ranks that save together, one file each. None: the whole job (the default
    group; every rank calls it). A group that lacks a rank holding the object's state (the
    replicate group of an FSDP2 mesh, the subgroup of a flat optimizer on the whole job) raises
    ``CheckpointError`` on every rank of it before anything is written. Raises
    ``CheckpointError`` on every rank if any rank could not write its file; the previous
    checkpoint in ``directory`` then stays loadable.
    """
    _check_object(obj)
    directory = os.fspath(directory)
    group, rank, n, problem = _rank_and_size(obj, group, directory)
    # One tag per save, the same on every rank: rank 0's. The same gather tells every rank
    # whether any refuses the group, before anything is written.
    tag = f"{time.strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(4)}"
    first = _all_gather_object((tag, problem), group, n, directory, "save", "tag and checks")
    tag = first[0][0]
    problems = [f"rank {r}: {p}" for r, (_, p) in enumerate(first) if p is not None]
    if problems:
        raise CheckpointError(f"checkpoint {directory} not saved (nothing written): "
                              + "; ".join(problems))
    name = f"rank{rank:05d}-of-{n:05d}.{tag}.pt"
    try:
        os.makedirs(directory, exist_ok=True)
        buf = io.BytesIO()
        torch.save(_get_state(obj), buf)
        data = buf.getvalue()
        _write_atomic(os.path.join(directory, name), data)
        record = dict(file=name, bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    except Exception as e:  # every rank must still reach the gather below
        record = dict(error=f"rank {rank}: cannot write {os.path.join(directory, name)}: {e}")
    records = _all_gather_object(record, group, n, directory, "save", "file records")
    errors = [r["error"] for r in records if "error" in r]

    status = [None]
    if rank == 0:
        try:
            if errors:
                raise CheckpointError("; ".join(errors))
            manifest = dict(format=FORMAT, format_version=FORMAT_VERSION, world_size=n,
                            job_world_size=dist.get_world_size() if group is not None else 1,
                            ranks=(dist.get_process_group_ranks(group) if group is not None
                                   else [0]),
                            library_version=__version__, torch_version=torch.__version__,
                            saved_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"), tag=tag,
                            **_describe(obj), files=records)
            _write_atomic(os.path.join(directory, MANIFEST),
                          json.dumps(manifest, indent=1).encode())
            _fsync_dir(directory)
            keep = {r["file"] for r in records}
            for old in os.listdir(directory):  # the previous saves' files, now unreferenced
                if old.startswith("rank") and ".pt" in old and old not in keep:
                    try:
                        os.remove(os.path.join(directory, old))
                    except OSError:
                        pass
        except Exception as e:
            status = [f"checkpoint {directory!s} not saved: {e}"]
    if n > 1:  # nobody returns before the manifest is in place (or the save failed everywhere)
        _broadcast_object(status, group, directory, "status")
    if status[0] is not None:
        # Remove this rank's orphan file; the previous manifest does not name it.
        if "error" not in record:
            try:
                os.remove(os.path.join(directory, name))
            except OSError:
                pass
        raise CheckpointError(status[0])
    return os.path.join(directory, MANIFEST)


# ----------------------------------------------------------------------------- load


def read_manifest(directory) -> dict:
    """The checked manifest of a checkpoint directory (raises CheckpointError)."""
    path = os.path.join(os.fspath(directory), MANIFEST)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (not a checkpoint, or its save never finished)")
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read: {e}") from e
    try:
        manifest = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON (corrupted or truncated): {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a {FORMAT} manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format version {manifest.get('format_version')!r}, this "
                              f"library reads version {FORMAT_VERSION}")
    files, n = manifest.get("files"), manifest.get("world_size")
    if (not isinstance(n, int) or n < 1 or not isinstance(files, list) or len(files) != n
            or not all(isinstance(r, dict) and {"file", "bytes", "sha256"} <= set(r)
                       for r in files)):
        raise CheckpointError(f"{path}: world_size and files do not agree (corrupted manifest)")
    for r in files:
        if os.path.basename(str(r["file"])) != r["file"]:
            raise CheckpointError(f"{path}: file name {r['file']!r} leaves the directory")
    return manifest


def _read_rank_file(directory: str, record: dict):
    path = os.path.join(directory, record["file"])
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (named by {MANIFEST})")
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read: {e}") from e
    if len(data) != record["bytes"]:
        raise CheckpointError(f"{path}: {len(data)} bytes, {MANIFEST} says {record['bytes']} "
                              "(truncated or overwritten)")
    if hashlib.sha256(data).hexdigest() != record["sha256"]:
        raise CheckpointError(f"{path}: sha256 differs from {MANIFEST} (corrupted)")
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{path}: cannot be unpickled: {e}") from e


def _accumulate(acc, value, where: str, path: str):
    """acc + value over a state structure: floating tensors summed in float64, everything else
    must be equal."""
    if isinstance(value, dict):
        if not isinstance(acc, dict) or set(acc) != set(value):
            raise CheckpointError(f"{where}: the old ranks' states differ in structure at {path}")
        return {k: _accumulate(acc[k], value[k], where, f"{path}/{k}") for k in value}
    if isinstance(value, (list, tuple)):
        if not isinstance(acc, (list, tuple)) or len(acc) != len(value):
            raise CheckpointError(f"{where}: the old ranks' states differ in structure at {path}")
        return type(value)(_accumulate(a, v, where, f"{path}/{i}")
                           for i, (a, v) in enumerate(zip(acc, value)))
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        if not isinstance(acc, torch.Tensor) or acc.shape != value.shape:
            raise CheckpointError(f"{where}: the old ranks' states differ in shape at {path}")
        return acc + value.double()
    if isinstance(value, torch.Tensor):
        same = isinstance(acc, torch.Tensor) and torch.equal(acc, value)
    else:
        same = acc == value
    if not same:
        raise CheckpointError(f"{where}: the old ranks disagree at {path} ({acc!r} vs {value!r}); "
                              "only floating-point state can be averaged when resizing")
    return acc


def _to_float64(value):
    if isinstance(value, dict):
        return {k: _to_float64(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_float64(v) for v in value)
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.double()
    return value


def _finish_mean(acc, like, n_old: int):
    if isinstance(like, dict):
        return {k: _finish_mean(acc[k], like[k], n_old) for k in like}
    if isinstance(like, (list, tuple)):
        return type(like)(_finish_mean(a, v, n_old) for a, v in zip(acc, like))
    if isinstance(like, torch.Tensor) and like.is_floating_point():
        return (acc / n_old).to(like.dtype)
    return like


def _check_fits(obj, state, where: str) -> None:
    """The saved state matches the optimizer's param groups and parameter shapes."""
    groups = getattr(obj, "param_groups", None)
    if not (isinstance(groups, list) and isinstance(state, dict)
            and isinstance(state.get("param_groups"), list)
            and isinstance(state.get("state"), dict)):
        return
    saved = state["param_groups"]
    if len(saved) != len(groups):
        raise CheckpointError(f"{where}: {len(saved)} param groups saved, the optimizer has "
                              f"{len(groups)}")
    params = []
    for i, (s, g) in enumerate(zip(saved, groups)):
        if len(s.get("params", ())) != len(g["params"]):
            raise CheckpointError(f"{where}: param group {i} has {len(s.get('params', ()))} "
                                  f"parameters saved, the optimizer has {len(g['params'])}")
        params += list(zip(s["params"], g["params"]))
    current = getattr(obj, "state", {})
    for pid, p in params:
        mine = current.get(p, {}) if isinstance(current, dict) else {}
        entry = state["state"].get(pid, {})
        shard = entry.get("exp_avg_range")  # hierarchy: exp_avg is elements lo..hi of p, 1-D
        for key, value in entry.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            # the optimizer's own state when it has one (FSDP2 momenta: (replicas, *p.shape))
            like = mine.get(key) if isinstance(mine.get(key), torch.Tensor) else p
            if key == "exp_avg" and shard is not None:
                lo, hi = shard
                if not (value.dim() == 1 and 0 <= lo <= hi <= p.numel()
                        and value.numel() == hi - lo):
                    raise CheckpointError(
                        f"{where}: state 'exp_avg' of parameter {pid} has shape "
                        f"{tuple(value.shape)} for elements {lo}..{hi} (exp_avg_range), the "
                        f"parameter has {p.numel()} elements")
            elif value.shape != like.shape:
                raise CheckpointError(f"{where}: state {key!r} of parameter {pid} has shape "
                                      f"{tuple(value.shape)}, this optimizer's is "
                                      f"{tuple(like.shape)}")


def _has_dtensor(state) -> bool:
    """Whether an optimizer state dict holds DTensors (FSDP2 parameters' momenta)."""
    per_param = state.get("state") if isinstance(state, dict) else None
    return isinstance(per_param, dict) and any(
        is_dtensor(v) for s in per_param.values() if isinstance(s, dict) for v in s.values())


def _mesh_text(mesh) -> str:
    if mesh is None:
        return "plain (unsharded) parameters"
    return (f"an FSDP2 mesh of {mesh['replicas']} replicas x {mesh['shards']} shards (ranks "
            f"{mesh['ranks']})")


def _mesh_problem(manifest: dict, mine: dict, n_old: int, n: int) -> str | None:
    """Why FSDP2-sharded state cannot load here (None: it can): each rank's file holds its own
    local shards, so it loads on the same mesh only, each rank at the position it saved from."""
    saved, mesh = manifest.get("mesh"), mine["mesh"]
    if saved is None and mesh is None:
        return None
    if saved is not None and n_old != n:
        return (f"saved on {n_old} ranks with FSDP2 parameters ({_mesh_text(saved)}): each rank's "
                f"file holds its local shards, so it loads on that mesh only, not on {n} ranks "
                f"({_mesh_text(mesh)}); torch.distributed.checkpoint reshards a DistributedLion's "
                "momenta onto a mesh with the same number of replicas (docs/fsdp.md)")
    if saved != mesh:
        return (f"saved with {_mesh_text(saved)}, loading into {_mesh_text(mesh)}: a checkpoint "
                "of FSDP2-sharded state loads on the same mesh only (the same replicas x shards "
                "and the same rank at each position); torch.distributed.checkpoint reshards a "
                "DistributedLion's momenta onto a mesh with the same number of replicas "
                "(docs/fsdp.md)")
    return None


def _check_own(obj, state, where: str) -> None:
    """The object's own check of a state, where it has one that changes nothing (``DiLoCo``):
    a state it would refuse is refused here, before the ranks agree, not by one rank after."""
    check = getattr(obj, "check_state", None)
    if callable(check):
        try:
            check(state)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{where}: {e}") from e


def _prepare(obj, directory: str, rank: int, n: int):
    """Read and check everything this rank needs; return (state to load, manifest). Changes
    nothing."""
    manifest = read_manifest(directory)
    where = os.path.join(directory, MANIFEST)
    mine = _describe(obj)
    n_old, files = manifest["world_size"], manifest["files"]
    if manifest.get("hierarchy") is not None and n_old != n:
        # each rank holds its shard of its node's momentum: there is no mean to take
        raise CheckpointError(f"{where}: saved with hierarchy {manifest['hierarchy']!r} on "
                              f"{n_old} ranks (sharded momentum); it loads on {n_old} ranks "
                              f"only, not {n}")
    if "mesh" in manifest and (manifest["mesh"] is None) != (mine["mesh"] is None):
        raise CheckpointError(f"{where}: {_mesh_problem(manifest, mine, n_old, n)}")
    for key in ("kind", "hierarchy", "topology"):
        if manifest.get(key) != mine[key]:
            raise CheckpointError(f"{where}: saved with {key} {manifest.get(key)!r}, loading "
                                  f"into {key} {mine[key]!r}")
    if mine["param_shapes"] is not None and manifest.get("param_shapes") != mine["param_shapes"]:
        raise CheckpointError(f"{where}: parameter shapes differ: saved "
                              f"{manifest.get('param_shapes')}, optimizer {mine['param_shapes']}")
    mesh_problem = _mesh_problem(manifest, mine, n_old, n) if "mesh" in manifest else None
    if n_old == n:
        state = _read_rank_file(directory, files[rank])
        where_file = os.path.join(directory, files[rank]["file"])
        try:
            _check_fits(obj, state, where_file)
        except CheckpointError as e:
            raise CheckpointError(f"{e}; {mesh_problem}" if mesh_problem else str(e)) from None
        if mesh_problem:
            raise CheckpointError(f"{where}: {mesh_problem}")
        _check_own(obj, state, where_file)
        return state, manifest
    if mesh_problem:
        raise CheckpointError(f"{where}: {mesh_problem}")
    first = _read_rank_file(directory, files[0])
    if _has_dtensor(first):
        raise CheckpointError(f"{where}: saved on {n_old} ranks with FSDP2 parameters (a "
                              "DTensor momentum piece per rank); it can be loaded on the same "
                              f"mesh of {n_old} ranks only, not {n} (torch.distributed.checkpoint "
                              "reshards it: docs/fsdp.md)")
    acc = _to_float64(first)
    for record in files[1:]:
        acc = _accumulate(acc, _read_rank_file(directory, record),
                          os.path.join(directory, record["file"]), "state")
    state = _finish_mean(acc, first, n_old)
    _check_fits(obj, state, os.path.join(directory, files[0]["file"]))
    _check_own(obj, state, where)
    return state, manifest


def load_state(obj, directory, *, group=None) -> dict:
    """Load the state ``save_state`` wrote into ``obj``, on every rank of the group (all call
    it; ``group`` as for ``save_state``). Same world size: each rank gets its own state back, bit
    for bit. Different world size: every rank gets the mean of the old ranks' momenta (module
    docstring); refused for a hierarchy's sharded momentum and for FSDP2-sharded state, which
    loads on the same mesh only. Returns the manifest.

    Every rank first checks the manifest, the sizes and sha256 of the files it reads, and that the
    state fits ``obj``; if any rank finds a problem, every rank raises ``CheckpointError`` naming
    the file and what is wrong, and no rank changes anything.
    """
    _check_object(obj)
    directory = os.fspath(directory)
    group, rank, n, problem = _rank_and_size(obj, group, directory)
    state, manifest = None, None
    try:
        if problem is None:
            state, manifest = _prepare(obj, directory, rank, n)
    except CheckpointError as e:
        problem = f"rank {rank}: {e}"
    except Exception as e:  # anything else must not leave the other ranks waiting
        problem = f"rank {rank}: {type(e).__name__}: {e}"
    problems = [p for p in _all_gather_object(problem, group, n, directory, "load", "problems")
                if p is not None]
    if problems:
        raise CheckpointError(f"checkpoint {directory} not loaded on any rank: "
                              + "; ".join(problems))
    _set_state(obj, state)
    return manifest
