"""D-Lion on FSDP2-sharded parameters (``device_mesh=``): the DTensor plumbing.

n = N x L ranks form a device mesh with a "replicate" dimension (N replicas of the model) and a
"shard" dimension (L ranks that FSDP2 shards each replica over, ``fully_shard(module,
mesh=mesh["shard"])``). A parameter is a DTensor whose local tensor is this rank's shard; after
``backward()`` its ``.grad`` is the reduced gradient shard (the mean over the L ranks of the
replica). The voters of a shard are the N ranks that hold it: this rank's *replicate group*.

What lives here (the exchange itself is ``pipeline.Exchange``, unchanged, on the replicate group,
over the local shards):

- ``resolve``: the parameters, ``device_mesh=`` and ``group=`` checked and turned into a
  ``Sharding``: the replicate group, the shard group and the mesh the momentum lives on.
- ``local``: a DTensor's local tensor (the same storage: writing it writes the parameter, which
  stays the DTensor FSDP2 manages).
- The momentum layout: one fp32 DTensor per parameter of global shape ``(N, *param.shape)``,
  ``Shard(0)`` over the replicate dimension and the parameter's own ``Shard(d)`` (as
  ``Shard(d + 1)``) over the shard dimension. Replica i's momentum is row i, so every replica's
  momentum is a distinct piece of the state: ``torch.distributed.checkpoint`` saves all N of them
  (a momentum shaped like the parameter would be deduplicated as a replicated tensor, keeping one
  replica's) and loads each back into its owner; on a mesh with the same N and another L it is
  resharded, element by element; another N does not fit the global shape and DCP refuses it.
- ``ShardAgreement``: one skip/raise decision for all n ranks, and the step's last collective.
  The replicate exchange's headers show this rank only its own replicate group, yet a non-finite
  value reaches only the reduced shard that holds the element, and ranks of different shard
  groups may be on different steps. So before anything is applied, every rank all-gathers its
  own header over the whole mesh (two words per rank, on a group of all n ranks the library
  makes), posted only once its exchange is complete: every rank decides from all n headers.
  It runs over the whole mesh, not inside the shard group, so that the step applies on every
  rank or on none: a collective of some ranks completes whatever happens outside it, so with
  the shard group last, one shard group could apply step t while a rank of another stalled
  before it. Over the whole mesh, completing it on any rank means every rank has finished its
  exchange; a rank that dies or stalls at any collective before it leaves every rank unapplied.
- ``memory_per_rank``: the bytes of parameters, gradients and optimizer state a rank holds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .collectives import DistributedStepError, collective
from .groups import cached, new_group, retire, solo_group
from .header import HEADER_WORDS, NONFINITE, SETTINGS_SHIFT
from .pipeline import ABORTED, StepStats, all_gather

REPLICATE, SHARD = "replicate", "shard"
# Name of the shard group's collective in errors (DistributedStepError) and fault tests
HEADERS = "all_gather(mesh headers)"
MESH_GROUP = "new_group(mesh)"  # the making of the whole mesh's group, at its first step


def _dtensor():
    from torch.distributed.tensor import DTensor, Shard

    return DTensor, Shard


def is_dtensor(t) -> bool:
    return dist.is_available() and isinstance(t, _dtensor()[0])


def own_shard(t):
    """This rank's shard of a DTensor (a view of its storage), or ``t`` itself (a plain tensor or
    None)."""
    if not is_dtensor(t):
        return t
    with torch.no_grad():  # to_local() then returns the local tensor itself, not an autograd view
        return t.to_local()


def sharded_params(params) -> bool:
    """Whether ``params`` are DTensors (all of them) or plain tensors (none); ValueError for a
    mix."""
    kinds = [is_dtensor(p) for p in params]
    if any(kinds) and not all(kinds):
        i, j = kinds.index(True), kinds.index(False)
        raise ValueError(
            f"params mixes DTensor parameters (FSDP2's, e.g. params[{i}]) and plain tensors (e.g. "
            f"params[{j}]): shard every parameter of the optimizer with fully_shard, or none")
    return bool(kinds) and all(kinds)


@dataclass(frozen=True)
class Sharding:
    """Where this rank sits in the mesh of N replicas x L shards."""

    mesh: object  # the DeviceMesh of the momentum (2-D; the parameters' own 1-D mesh when N = 1)
    replicate_dim: int | None  # its replicate dimension (None: a 1-D mesh)
    shard_dim: int  # its shard dimension
    replicate: object  # process group of the N ranks holding this rank's shard
    shard: object  # process group of the L ranks of this rank's replica (the parameters' mesh)
    replicas: int  # N
    shards: int  # L

    def momentum_placements(self, param) -> list:
        """The momentum's placements: Shard(0) over replicate, the parameter's Shard(d) as
        Shard(d + 1) over shard."""
        _, Shard = _dtensor()
        placements = [None] * self.mesh.ndim
        placements[self.shard_dim] = Shard(param.placements[0].dim + 1)
        if self.replicate_dim is not None:
            placements[self.replicate_dim] = Shard(0)
        return placements

    def zero_momentum(self, param):
        """A zero fp32 momentum for ``param`` (layout of the module docstring)."""
        mine = own_shard(param)
        return self._momentum(param, torch.zeros((1, *mine.shape), dtype=torch.float32,
                                                 device=mine.device))

    def _momentum(self, param, piece):
        DTensor, _ = _dtensor()
        shape = (self.replicas, *param.shape)
        return DTensor.from_local(piece, self.mesh, self.momentum_placements(param),
                                  run_check=False, shape=torch.Size(shape),
                                  stride=torch.empty(shape, device="meta").stride())

    def check_momentum(self, value, param, where: str) -> None:
        """ValueError naming ``where`` unless ``value`` is a momentum of ``param`` on this mesh
        (global shape (N, *param.shape), this rank's piece of (1, *local shape))."""
        expected = (self.replicas, *param.shape)
        piece = (1, *own_shard(param).shape)
        if not is_dtensor(value):
            raise ValueError(
                f"{where} is a {type(value).__name__}; a DistributedLion over FSDP2 parameters "
                f"keeps each momentum as a DTensor of global shape {expected} (replicas, "
                "*param.shape) on its device mesh: load a state saved by one")
        if tuple(value.shape) != expected or tuple(value.to_local().shape) != piece:
            raise ValueError(
                f"{where} has global shape {tuple(value.shape)} and local shape "
                f"{tuple(value.to_local().shape)}; this mesh needs {expected} and {piece} "
                f"({self.replicas} replicas x {self.shards} shards). A state saved on another "
                "mesh loads through torch.distributed.checkpoint when it has the same number "
                "of replicas (docs/fsdp.md)")

    def loaded_momentum(self, value, param):
        """An fp32 copy of a checked momentum ``value`` as a DTensor on this mesh."""
        return self._momentum(param, value.to_local().to(dtype=torch.float32, copy=True))


def momentum_local(m) -> torch.Tensor:
    """The local tensor of a momentum DTensor, shaped like the parameter's local shard (a view:
    writing it writes the momentum)."""
    return own_shard(m)[0]


# ----------------------------------------------------------------------------- the mesh


def _ranks(mesh) -> list[int]:
    return mesh.mesh.reshape(-1).tolist()


def mesh_group(sharding: Sharding, step, timeout=None):
    """A process group of every rank of ``sharding``'s mesh (the shard group when N = 1), made
    once at the mesh's first step (``groups.cached``) with the job's timeout: every rank of the
    job makes it when the mesh holds every rank, else its members only. A collective of step
    ``step``: a peer that dies then raises ``DistributedStepError`` naming ``MESH_GROUP``."""
    if sharding.replicas == 1:
        return sharding.shard
    ranks = sorted(_ranks(sharding.mesh))
    local_only = len(ranks) != dist.get_world_size()

    def make():
        made = []
        # (no Work to wait for: making the group is the collective)
        collective(MESH_GROUP, step, lambda async_op: made.append(
            new_group(ranks, timeout, use_local_synchronization=local_only)))
        return made[0]

    return cached("mesh", None, make, tuple(ranks))


def mesh_collective(sharding: Sharding, step, name: str, fn, *args, timeout=None, **kwargs):
    """``fn(*args, group=<the mesh's group>, **kwargs)`` as step ``step``'s collective ``name``
    (``collectives.collective``): one collective over every rank of ``sharding``'s mesh, the
    mesh-wide decision of a step. A failure retires the mesh's group (``groups.retire``: work may
    be left pending on it) and raises ``DistributedStepError``."""
    group = None
    try:
        group = mesh_group(sharding, step, timeout)
        collective(name, step, fn, *args, group=group, timeout=timeout, **kwargs)
    except DistributedStepError:
        retire(group)
        raise


def check_param(i: int, p, first) -> None:
    """``params[i]`` is an FSDP2 parameter (Shard(d) over one mesh dimension), sharded over the
    same ranks as ``first`` (None: no other to compare with); ValueError otherwise."""
    _, Shard = _dtensor()
    mesh, placements = p.device_mesh, tuple(p.placements)
    if mesh.ndim != 1:
        raise ValueError(
            f"params[{i}] is a DTensor on a {mesh.ndim}-D mesh with placements {placements}; "
            "D-Lion takes FSDP2 parameters sharded over the mesh's shard dimension only: "
            "fully_shard(module, mesh=mesh['shard']) (HSDP, fully_shard on the 2-D mesh, "
            "all-reduces the replicas' gradients itself, and tensor parallelism is not supported)")
    if type(placements[0]) is not Shard:
        raise ValueError(
            f"params[{i}] has placements {placements}; allowed: Shard(d) from fully_shard "
            "(a Replicate or other placement comes from another parallelism, whose gradients "
            "D-Lion cannot vote on)")
    if first is not None and _ranks(mesh) != _ranks(first.device_mesh):
        raise ValueError(
            f"params[{i}] is sharded over ranks {_ranks(mesh)}, params[0] over "
            f"{_ranks(first.device_mesh)}: every parameter must be sharded over one mesh")


def resolve(params, device_mesh=None, group=None) -> Sharding | None:
    """The ``Sharding`` of DTensor ``params`` (None for plain tensors), from ``device_mesh``
    (1-D: the shard mesh, N = 1; 2-D: dims named "replicate" and "shard", else the first is
    replicate) or, without one, from ``group`` (the replicate group; None: N = 1 when the
    parameters are sharded over every rank). Raises ValueError/TypeError that names what is
    allowed; with ``group`` it all-gathers the L ranks of each replica's shard group once."""
    params = list(params)
    if not sharded_params(params):
        if device_mesh is not None:
            raise ValueError(
                "device_mesh is for FSDP2's DTensor parameters (fully_shard), and these "
                "parameters are plain tensors: pass device_mesh=None")
        return None
    for i, p in enumerate(params):
        check_param(i, p, params[0] if i else None)
    shard_mesh = params[0].device_mesh
    shard_ranks = _ranks(shard_mesh)
    shard_group = shard_mesh.get_group()
    L = len(shard_ranks)
    if device_mesh is not None:
        if group is not None:
            raise ValueError("pass the replicate group either as device_mesh= or as group=, "
                             "not both")
        return _from_mesh(device_mesh, shard_mesh, shard_group, L)
    if group is None:
        world = dist.get_world_size()
        if L != world:
            raise ValueError(
                f"the parameters are sharded over ranks {shard_ranks}, {L} of the {world} "
                "ranks: pass device_mesh= (the 2-D mesh with dims 'replicate' and 'shard') or "
                "group= (the replicate group: the ranks holding this rank's shard)")
        return Sharding(shard_mesh, None, 0, solo_group(), shard_group, 1, L)
    return _from_group(group, shard_mesh, shard_group, L)


def _from_mesh(device_mesh, shard_mesh, shard_group, L) -> Sharding:
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"device_mesh must be a torch.distributed.device_mesh.DeviceMesh, got "
                        f"{type(device_mesh).__name__}")
    coordinate = device_mesh.get_coordinate()
    if coordinate is None:
        raise ValueError(f"device_mesh {device_mesh} does not hold this rank ({dist.get_rank()})")
    if device_mesh.ndim == 1:
        if _ranks(device_mesh) != _ranks(shard_mesh):
            raise ValueError(
                f"device_mesh {device_mesh} (1-D: the shard dimension, N = 1) does not match "
                f"the parameters' mesh {shard_mesh}: pass the mesh fully_shard sharded them over")
        return Sharding(shard_mesh, None, 0, solo_group(), shard_group, 1, L)
    if device_mesh.ndim != 2:
        raise ValueError(f"device_mesh must be 1-D (shard) or 2-D (replicate, shard), got "
                         f"{device_mesh.ndim}-D {device_mesh}")
    names = device_mesh.mesh_dim_names or ()
    if REPLICATE in names and SHARD in names:
        rep, shd = names.index(REPLICATE), names.index(SHARD)
    else:
        rep, shd = 0, 1
    # the ranks along the shard dimension through this rank: the parameters' mesh
    index = [slice(None)] * 2
    index[rep] = coordinate[rep]
    row = device_mesh.mesh[tuple(index)].tolist()
    if row != _ranks(shard_mesh):
        raise ValueError(
            f"device_mesh {device_mesh} does not match the parameters' mesh {shard_mesh}: "
            f"along its shard dimension (dim {shd}) this rank is with ranks {row}, the "
            f"parameters are sharded over {_ranks(shard_mesh)}; shard the model with "
            f"fully_shard(module, mesh=device_mesh['{SHARD}']) and name the dims "
            f"('{REPLICATE}', '{SHARD}') (else the first dim is replicate)")
    N = device_mesh.size(rep)
    return Sharding(device_mesh, rep, shd, device_mesh.get_group(rep), shard_group, N, L)


def _from_group(group, shard_mesh, shard_group, L) -> Sharding:
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup (the replicate group) "
                        f"or None, got {type(group).__name__}")
    me, shard_ranks = dist.get_rank(), _ranks(shard_mesh)
    replicate_ranks = dist.get_process_group_ranks(group)
    if me not in replicate_ranks or set(replicate_ranks) & set(shard_ranks) != {me}:
        raise ValueError(
            f"group= must be the replicate group: the ranks that hold this rank's shard, one per "
            f"replica; it has ranks {replicate_ranks}, and the parameters are sharded over "
            f"{shard_ranks} (they may share only this rank, {me})")
    N = len(replicate_ranks)
    if N == 1:
        return Sharding(shard_mesh, None, 0, group, shard_group, 1, L)
    # The momentum's 2-D mesh: row i is the shard group of the replicate group's rank i.
    device = torch.device("cpu")
    if "nccl" in str(dist.get_backend(group)).lower():
        device = torch.device("cuda", torch.cuda.current_device())
    mine = torch.tensor(shard_ranks, dtype=torch.int64, device=device)
    rows = torch.empty(N * L, dtype=torch.int64, device=device)
    collective("all_gather(shard ranks)", 0, all_gather, rows, mine, group,
               label="DistributedLion(group=) construction, step")
    rows = rows.view(N, L).cpu()
    column = shard_ranks.index(me)
    if rows[:, column].tolist() != replicate_ranks:
        raise ValueError(
            f"group= (ranks {replicate_ranks}) does not line up with the parameters' meshes "
            f"{rows.tolist()}: its rank i must hold the same shard as this rank (position "
            f"{column} of its replica's mesh)")
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh.from_group([group, shard_group], shard_mesh.device_type, mesh=rows,
                                 mesh_dim_names=(REPLICATE, SHARD))
    return Sharding(mesh, 0, 1, group, shard_group, N, L)


# ----------------------------------------------------------------------------- the decision


class ShardAgreement:
    """``Exchange.finish(agree=...)`` for sharded parameters: takes the headers this rank
    received in the replicate exchange ([buckets, N, 2]: flags and step of each replica of its
    shard), keeps its own (non-finite flag OR-ed over buckets, its step, and the exchange's last
    word: ``pipeline.ABORTED`` when it gave up the step, the settings digest) and all-gathers
    that over the whole mesh (``mesh_group``, the step's last collective: module docstring).
    Returns the n headers ([1, n, 2], mesh ranks in order), from which every rank takes the
    same decision: skip if any rank flagged a non-finite gradient or gave up or set other
    settings, ``StepMismatchError`` if any two ranks differ in step.
    ``sent``: the bytes this rank sent in that gather. A failure in it retires the mesh's group
    (``groups.retire``).

    ``replica``: a replica of several ranks on torchft (``elastic.py``), whose voters are other
    jobs: the mesh is then this replica's own group (the shard group), and each rank folds every
    header it received (every replica's, for its shard) into its own two words before the
    gather, so every rank of the replica decides from every rank of every replica. ``fold``
    gives those two words for a rank whose exchange failed (``failed``: flagged given up).

    ``DiLoCo`` makes the same mesh-wide decision for a pseudo-gradient (``mesh_collective``
    too) with an all-reduce (MAX) of one flag and every replica's step instead: it has no
    per-rank words to compare (no ABORTED, no settings digest), and its bytes are counted as that
    all-reduce."""

    def __init__(self, sharding: Sharding, step: int, timeout=None, replica: bool = False):
        self.sharding, self.shards = sharding, sharding.shards
        self.step, self.timeout, self.replica = step, timeout, replica
        self.sent = 0
        self.issued = False  # its gather was issued (a second one would pair with nothing)

    def fold(self, headers: torch.Tensor | None, word: torch.Tensor | None) -> torch.Tensor:
        """This rank's words for the gather: its own header's flags OR-ed with ``word``, and its
        step. ``replica``: the flags of every header it received, the step (-1 where the
        received steps differ), and the lowest and highest settings digest received (so a
        replica set apart is seen by every rank of this one). ``headers`` None: this rank's
        exchange failed; ``word`` then says it gave the step up."""
        if headers is None:
            flags = word.to(torch.int32).view(1)
            step = torch.full((1,), self.step % 2**31, dtype=torch.int32, device=flags.device)
            digest = flags >> SETTINGS_SHIFT
            return torch.cat([flags, step, digest, digest])
        rows = headers.reshape(-1, HEADER_WORDS) if self.replica else \
            headers[:, dist.get_rank(self.sharding.replicate)
                       if self.sharding.replicas > 1 else 0, :]
        if rows.shape[0]:
            flags = (rows[:, 0] & (NONFINITE | ABORTED if self.replica else NONFINITE)).amax()
            steps = rows[:, 1]
            step = torch.where((steps != steps[:1]).any(), -1, steps[0])
            digests = rows[:, 0] >> SETTINGS_SHIFT
            low, high = digests.amin(), digests.amax()
        else:
            flags = torch.zeros((), dtype=torch.int32, device=headers.device)
            step = torch.full((), self.step % 2**31, dtype=torch.int32, device=headers.device)
            low = high = flags
        flags = flags.view(1)
        if word is not None:
            flags = flags | word.to(flags.device)  # ABORTED, and the settings as step() reads them
        mine = [flags, step.view(1)] + ([low.view(1), high.view(1)] if self.replica else [])
        return torch.cat(mine).to(torch.int32).contiguous()

    def __call__(self, headers: torch.Tensor | None,
                 word: torch.Tensor | None = None) -> torch.Tensor:
        mine = self.fold(headers, word)
        n = self.shards if self.replica else self.sharding.replicas * self.shards
        if n == 1 and not self.replica:
            return mine.view(1, 1, HEADER_WORDS)
        gathered = torch.empty(n * mine.numel(), dtype=torch.int32, device=mine.device)
        self.issued = True
        if n == 1:
            gathered.copy_(mine)
        elif self.replica:
            collective(HEADERS, self.step, all_gather, gathered, mine, self.sharding.shard,
                       timeout=self.timeout)
        else:
            mesh_collective(self.sharding, self.step, HEADERS, all_gather, gathered, mine,
                            timeout=self.timeout)
        self.sent += (n - 1) * mine.numel() * mine.element_size()
        if not self.replica:
            return gathered.view(1, n, HEADER_WORDS)
        # each rank's words as two header rows, one with each settings digest it received
        words = gathered.view(n, 4)
        base = words[:, 0] & ~(-1 << SETTINGS_SHIFT)
        rows = torch.stack([torch.stack([base | (words[:, 2] << SETTINGS_SHIFT), words[:, 1]], 1),
                            torch.stack([base | (words[:, 3] << SETTINGS_SHIFT), words[:, 1]], 1)])
        return rows.reshape(1, 2 * n, HEADER_WORDS)


def step_stats(stats: StepStats, agreement: ShardAgreement) -> StepStats:
    """The exchange's stats with the agreement's bytes added (inside the node: FSDP2's header
    gather). ``numel`` counts this rank's local elements and ``world_size`` is N, the voters of
    each shard, so ``allreduce_fp32_bytes`` is what HSDP's fp32 all-reduce of the same shard
    between replicas would send."""
    total = stats.bytes_sent + agreement.sent
    return dataclasses.replace(stats, bytes_sent=total, bytes_received=total,
                               intra_node_bytes_sent=agreement.sent, shards=agreement.shards)


# ----------------------------------------------------------------------------- memory


def memory_per_rank(optimizer) -> dict:
    """Bytes this rank holds for ``optimizer`` (any ``torch.optim.Optimizer``), counted from the
    tensors: ``params`` and ``grads`` of its param groups and its ``optimizer_state`` (every
    tensor in ``optimizer.state``). A DTensor counts its local tensor; a tensor that is a view
    into a larger buffer counts its own elements (hierarchy's momentum views of one buffer).
    Integers (step counters) are not counted."""
    out = dict(params=0, grads=0, optimizer_state=0)

    def add(key, t):
        t = own_shard(t)
        if isinstance(t, torch.Tensor):
            out[key] += t.numel() * t.element_size()

    for g in optimizer.param_groups:
        for p in g["params"]:
            add("params", p)
            add("grads", p.grad)
    for state in optimizer.state.values():
        for value in state.values():
            add("optimizer_state", value)
    return out
