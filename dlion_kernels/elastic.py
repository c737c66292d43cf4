"""Elastic training on torchft's quorum: ``DistributedLion(..., manager=)`` and
``DiLoCo(..., manager=)`` keep training when a replica dies, and a replica that (re)starts heals
from a live one.

A thin layer around a step, not a new exchange. For each step (each DiLoCo sync):

    quorum   manager.start_quorum(): torchft's Lighthouse decides which replicas take part and
             reconfigures the manager's process group for them; a replica that starts or fell
             behind heals here (torchft's recovery copies the state registered below from a live
             replica) before it computes anything, so its vote counts only once healed
    vote     the library's exchange (fused stages, all_to_all of the packed votes, all_gather of
             the tally) on that group, n = manager.num_participants(); ``ManagerGroup`` is the
             small adapter that gives torchft's group the two calls the exchange makes
    commit   manager.should_commit(); the step (the sync) applies only where it says True.
             A collective that fails (a peer died) is reported with manager.report_error and
             never raised: should_commit then says False, nothing is applied, and the next
             quorum goes on with the replicas left.

``DistributedLion`` opens the quorum in ``zero_grad()``; ``step()`` opens it if ``zero_grad()``
did not. The quorum ahead: a replica that is current (its last step committed, and that step's
quorum did not heal it) asks for the next quorum in the background, so the Lighthouse's round
trip and the wait for the slowest replica to ask overlap forward and backward; ``step()`` waits
for it before the vote. Any other replica (a fresh process, one whose step did not commit) asks
in ``zero_grad()`` and waits, so it heals before it computes anything. Should a quorum asked
ahead find the replica behind after all (it missed the quorums the others formed while it was
late, past the Lighthouse's join timeout), the peer's state it received is applied in
``step()``, and its vote, computed before the heal, counts nowhere: it takes part in the step's
collectives with the step given up (``ABORTED`` in its headers), every replica commits that step
with nothing applied, and the next step is a normal one. After such a step the replica asks at
``zero_grad()`` for a while (1 step, then 2, 4, ... up to ``MAX_BACKOFF``), so one that keeps
missing quorums does not make every other step of everyone a step given up.
``DiLoCo`` opens one quorum per sync (per fragment), at the sync: a replica that restarts takes
its local steps alone until the next sync of the others, heals there and syncs with them.

Recovery (``manager.register_state_dict_fn``): ``DistributedLion`` registers its parameters, the
step count and, with ``heal_momentum="peer"``, its momenta; ``DiLoCo`` registers theta_bar, the
inner step, the model's trainable parameters and the outer momenta with ``"peer"`` or with
``outer="nesterov"`` (Nesterov's momentum follows the mean pseudo-gradient: it is the same on
every replica, shared state that a healing replica must copy whatever ``heal_momentum`` says).
Copies are taken when a peer asks (torchft serves them while the sender's step runs; nothing the
sender later changes reaches the healing replica).

Momentum on heal (``heal_momentum``, the same on every replica; default ``"own"``):
- ``"own"``: the replica keeps the momentum it has: zero for a fresh process, what it loaded from
  its own checkpoint (``dk.load_state``) if it did, its live momentum if it only fell behind by a
  step. Votes stay independent: momentum is private to a replica in Distributed Lion.
- ``"peer"``: the momentum of the replica it heals from (the transfer doubles); the two then vote
  alike for about 1 / (1 - beta2) steps.
- ``"zero"``: zero, whatever the replica had.

A replica may be one FSDP2 shard group (torchft's HSDP layout): each replica is its own
torch.distributed job of L ranks that ``fully_shard`` the model over their default group, and
each rank has its own Manager with ``rank`` = its position in that shard group and
``world_size`` = L. torchft's process group of group rank r then joins rank r of every live
replica: the ranks holding the same shard, which vote it between them (the exchange on the local
shards, n = the step's replicas). Every rank of a replica opens the quorum (the replica's
ManagerServer waits for all of them); after the vote the replica's ranks gather each other's
received headers over their shard group (two words per replica each, inside the replica), so a
non-finite gradient anywhere skips (or raises) alike on every rank of every replica; then
``should_commit``, which torchft makes the same on all ranks of a replica. Healing is per group
rank: a rank gets its own shard's parameters, step and (``"peer"``) momentum from the rank at
its position in a live replica. No collective of a step runs over more than the manager's group
and the replica's own shard group, so a dead replica stalls nothing but the step in flight.

Limits: ``use_async_quorum=False`` (an asynchronous quorum lets a healing replica into the step's
collectives before it has healed, and a 1-bit vote cannot abstain); no ``overlap``,
``hierarchy`` or ``group``; FSDP2 parameters sharded over the replica's own ranks (``device_mesh``
None or that 1-D mesh: the replicas are torchft's, not a mesh dimension); DiLoCo with one process
per replica and without ``overlap_steps``. ``import dlion_kernels`` never imports torchft: it is
imported here, when a manager is passed.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .decentralized.wrapper import gossip_bytes_per_step
from .exchange import sharded
from .exchange.checks import check_hyperparameters, check_tensors
from .exchange.collectives import DistributedStepError, collective
from .exchange.pipeline import (
    Exchange,
    NonFiniteGradientError,
    Segment,
    StepAbortedError,
    StepStats,
    all_gather,
)
from .kernels.layout import HEADER_WORDS, WORD_BYTES, block_offsets
from .local_steps import fragments as frag

HEAL_MOMENTUM = ("own", "peer", "zero")
ALL_REDUCE = "all_reduce(pseudo-gradient)"
# the gather of the vote's headers inside an FSDP2 replica (errors and fault tests)
REPLICA_HEADERS = "all_gather(replica headers)"
# the most steps a replica waits for its quorum in zero_grad() after a heal that came late
MAX_BACKOFF = 64


class _Background:
    """``fn()`` on a daemon thread (a quorum that never forms must not keep the process from
    exiting); ``result()`` waits for it and raises what it raised."""

    def __init__(self, fn):
        self.error = None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True,
                                       name="dlion-quorum")
        self.thread.start()

    def _run(self, fn) -> None:
        try:
            fn()
        except BaseException as e:  # raised again in the caller's thread
            self.error = e

    def result(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


@dataclass(frozen=True)
class ElasticStepStats(StepStats):
    """A ``StepStats`` of a step run on torchft's quorum: ``world_size`` (and ``participants``)
    is the step's number of participating replicas, ``committed`` what ``should_commit`` said
    (False: nothing was applied on this replica, ``skipped`` is True), ``manager_step`` the
    manager's step count after it. ``numel`` counts this rank's elements (its local shards on
    an FSDP2 replica group). ``bytes_sent`` is the total: the vote between replicas
    (``inter_node_bytes_sent``: the flat wire figure for ``numel`` elements and n replicas) plus,
    on a replica of ``shards`` > 1 ranks, the headers gathered inside the replica
    (``intra_node_bytes_sent``)."""

    participants: int = 0
    committed: bool = False
    manager_step: int = 0
    inter_node_bytes_sent: int = 0
    intra_node_bytes_sent: int = 0
    shards: int = 1


def check_manager(manager) -> None:
    """``manager`` must be a ``torchft.Manager`` with a synchronous quorum."""
    try:
        from torchft.manager import Manager
    except ImportError as e:  # the optional dependency: pip install "dlion-kernels[elastic]"
        raise ImportError("manager= needs torchft (pip install 'dlion-kernels[elastic]')") from e
    if not isinstance(manager, Manager):
        raise TypeError(f"manager must be a torchft.Manager or None, got {type(manager).__name__}")
    if getattr(manager, "_use_async_quorum", False):
        raise ValueError(
            "manager must be made with use_async_quorum=False: with an asynchronous quorum a "
            "healing replica takes part in the step's collectives before it has healed, and a "
            "1-bit vote cannot abstain")


def check_heal_momentum(heal_momentum) -> None:
    if heal_momentum not in HEAL_MOMENTUM:
        raise ValueError(f"heal_momentum must be one of {HEAL_MOMENTUM}, got {heal_momentum!r}")


def _register(manager, name: str, load, save) -> str:
    """Register ``load``/``save`` for recovery under a key no other object of this process took
    (every replica makes its objects in the same order, so the keys match)."""
    taken = getattr(manager, "_user_state_dicts", {})
    k = 0
    while f"{name}.{k}" in taken:
        k += 1
    key = f"{name}.{k}"
    manager.register_state_dict_fn(key, load, save)
    return key


class ManagerGroup:
    """The manager's process group of one quorum, as the exchange's collectives call a group:
    ``dist.all_to_all_single`` and ``dist.all_gather_single`` (and Nesterov's
    ``dist.all_reduce``) call these methods on the group they are given. torchft's group
    provides ``alltoall_base``, ``allgather`` and ``allreduce`` on the group it reconfigured at
    this step's quorum; ``n`` is the quorum's number of participants."""

    def __init__(self, pg, n: int):
        self.pg, self.n = pg, int(n)
        name = str(pg.getBackendName()).lower()
        self.backend_name = "nccl" if "nccl" in name else "gloo"  # check_group_device reads it

    def size(self) -> int:
        return self.n

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts):
        even = [input.shape[0] // self.n] * self.n  # the exchange always splits evenly
        return self.pg.alltoall_base(output, input, list(output_split_sizes) or even,
                                     list(input_split_sizes) or even, opts)

    def all_gather_single(self, output, input, opts):
        return self.pg.allgather([list(output.chunk(self.n))], [input], opts)

    def allreduce(self, tensors, opts):
        return self.pg.allreduce(tensors, opts)


def _quorum_group(manager) -> ManagerGroup:
    return ManagerGroup(manager._pg, max(1, manager.num_participants()))


def _copy_into(targets, saved, what: str) -> None:
    if len(saved) != len(targets) or any(tuple(s.shape) != tuple(t.shape)
                                         for s, t in zip(saved, targets)):
        raise ValueError(f"the {what} a peer sent for healing do not match this replica's: every "
                         "replica must build the same model and optimizer")
    with torch.no_grad():
        for t, s in zip(targets, saved):
            t.copy_(s)


# ----------------------------------------------------------------------------- DistributedLion


def should_commit(manager, step, **error) -> bool:
    """torchft's commit decision, the same on every rank of the replica. It waits for each rank
    of the replica group; when one of them has died it fails after the manager's timeout, and
    this replica cannot go on: ``DistributedStepError`` then, with nothing applied (the other
    replicas go on without this one). ``error``: the error's ``label`` and ``applied``."""
    try:
        return manager.should_commit()
    except Exception as e:  # torchft's client: a timeout, or its ManagerServer gone
        raise DistributedStepError(
            step, "should_commit", f"{type(e).__name__}: {e}", **error,
            advice="If that peer is a rank of this replica group, the replica cannot go on: "
                   "restart all its ranks; they heal from a live replica, and the other replicas "
                   "keep training meanwhile.") from e


def replica_sharding(params, device_mesh, manager) -> sharded.Sharding:
    """The ``Sharding`` of FSDP2 parameters whose replica is one shard group (module docstring):
    sharded over this replica's own ranks, with ``manager`` made for this rank's position in
    that group. ValueError otherwise."""
    sharding = sharded.resolve(params, device_mesh, None)
    if sharding.replicas != 1:
        raise ValueError(
            f"manager= with FSDP2 parameters: a replica is one shard group and the replicas are "
            f"torchft's replica groups, but device_mesh holds {sharding.replicas} replicas; pass "
            "device_mesh=None (or the 1-D mesh the parameters are sharded over) and start each "
            "replica as its own torch.distributed job")
    position = params[0].device_mesh.get_local_rank()
    # the Manager keeps its group rank and size only as attributes (torchft has no getter)
    rank = getattr(manager, "_group_rank", position)
    size = getattr(manager, "_group_world_size", sharding.shards)
    if (rank, size) != (position, sharding.shards):
        raise ValueError(
            f"manager must be made with rank={position} and world_size={sharding.shards} (this "
            f"rank's position in its replica's shard group and the group's size), got rank={rank}"
            f", world_size={size}: the manager's process group of group rank r joins the ranks "
            "that hold the same shard in every replica, the voters of that shard")
    return sharding


class ElasticLion:
    """``DistributedLion(..., manager=)``'s steps (module docstring)."""

    def __init__(self, opt, manager, heal_momentum: str = "own"):
        check_manager(manager)
        check_heal_momentum(heal_momentum)
        if opt.overlap or opt.ranks_per_node > 1 or opt.group is not None:
            raise ValueError("manager= votes over the manager's process group: it does not "
                             "combine with overlap=True, hierarchy or group")
        self.sharding = None  # FSDP2: the replica's shard group (module docstring)
        if opt.sharded:
            self.sharding = replica_sharding(self._all(opt), opt.device_mesh, manager)
        self.opt, self.manager, self.heal_momentum = opt, manager, heal_momentum
        self.quorum_open = False
        self.ahead = None  # a quorum asked ahead, running in the background (_Background)
        self.deferring = False  # while it runs: a peer's state for healing waits in self.late
        self.healed = False  # this step's quorum healed this replica
        self.late = None  # a peer's state a quorum asked ahead received, applied in step()
        # asking ahead pays only when this replica is at the others' step: after a step that
        # committed here without healing. After a heal that came late, wait for the quorum in
        # zero_grad() for a while, twice as long each time (a replica that keeps missing
        # quorums would otherwise give up every other step of everyone)
        self.current, self.sync_left, self.backoff = False, 0, 0
        self.key = _register(manager, "dlion_kernels.DistributedLion", self._load, self._save)

    @staticmethod
    def _all(opt) -> list:
        return [p for g in opt.param_groups for p in g["params"]]

    def _params(self) -> list:
        return [p for g in self.opt.param_groups for p in g["params"] if p.requires_grad]

    def _local(self, t):
        """What this rank steps of ``t``: its local shard on an FSDP2 replica, else ``t``."""
        return sharded.own_shard(t) if self.sharding is not None else t

    def _momentum(self, p):
        """The momentum of ``p`` this rank steps (the local piece of an FSDP2 momentum, laid out
        as ``DistributedLion`` keeps it with one replica per mesh), created zero if missing."""
        state = self.opt.state[p]
        if "exp_avg" not in state:
            state["step"] = state.get("step", 0)
            state["exp_avg"] = (
                self.sharding.zero_momentum(p) if self.sharding is not None
                else torch.zeros(p.shape, dtype=torch.float32, device=p.device))
        m = state["exp_avg"]
        return sharded.momentum_local(m) if self.sharding is not None else m

    def start_quorum(self, ahead: bool = False) -> None:
        """This step's quorum, once per step. ``ahead`` (``zero_grad()``): while forward and
        backward run, if this replica is current (module docstring, The quorum ahead); else
        here and now, healing before anything is computed."""
        if self.quorum_open:
            return
        self.quorum_open = True
        self.healed = False
        if ahead and self.current and self.sync_left == 0:
            self.deferring = True  # a heal in it waits for step() (_load)
            self.ahead = _Background(self.manager.start_quorum)
        else:
            self.manager.start_quorum()

    def _join_quorum(self):
        """Wait for a quorum asked ahead (its error, if any, raised here); return a peer's state
        received in it (this replica was behind after all), or None."""
        ahead, self.ahead = self.ahead, None
        try:
            if ahead is not None:
                ahead.result()
        finally:
            self.deferring = False
        late, self.late = self.late, None
        return late

    def _agree_in_replica(self, ex, n: int, step: int, device) -> torch.Tensor:
        """The headers every rank of this replica received in its vote, gathered over the
        replica's shard group ([1, L * n, 2]): the ranks of other shard positions saw other
        replicas' flags, and all must decide alike. ``ex`` None (this rank's vote failed): a
        header of zeros keeps the group's collectives matched (the step will not commit)."""
        if ex is not None and ex.works:
            mine = torch.cat([w.header for w in ex.works]).to(torch.int32).contiguous()
        else:
            mine = torch.zeros(n, HEADER_WORDS, dtype=torch.int32, device=device)
        shards = self.sharding.shards
        gathered = torch.empty(shards * mine.numel(), dtype=torch.int32, device=mine.device)
        collective(REPLICA_HEADERS, step, all_gather, gathered, mine.view(-1),
                   self.sharding.shard, timeout=getattr(self.opt, "timeout", None))
        return gathered.view(1, -1, HEADER_WORDS)

    def step(self) -> None:
        opt, manager = self.opt, self.manager
        self.start_quorum()
        self.quorum_open = False
        late = self._join_quorum()
        if late is not None:  # behind after all: heal now; this step's gradient predates it
            self._load(late)
        params = self._params()
        segments, rows = [], []
        for g in opt.param_groups:
            beta1, beta2 = check_hyperparameters(g["lr"], g["betas"], g["weight_decay"])
            seg = Segment([], [], [], float(g["lr"]), beta1, beta2, float(g["weight_decay"]))
            segments.append(seg)
            rows += [(p, seg) for p in g["params"] if p.requires_grad]
        local = [self._local(p) for p, _ in rows]
        grads = [self._local(p.grad) for p, _ in rows]
        momenta = [self._momentum(p) for p, _ in rows]
        check_tensors(local, grads, momenta)  # bad input raises on every replica
        step = manager.current_step()  # the same on every participant after the quorum
        group = _quorum_group(manager)
        n = group.n
        device = local[0].device if local else torch.device("cpu")
        ex, failed = None, manager.errored() is not None
        if not failed:
            try:
                ex = Exchange(device=device, mode=opt.mode, votes=opt.votes, group=group,
                              backend=opt.backend, step=step, nonfinite=opt.nonfinite,
                              timeout=getattr(opt, "timeout", None))
                offsets, blocks = block_offsets(t.numel() for t in local)
                if late is None:
                    ex.add([ex.row(p, g, m, off, seg) for p, (_, seg), g, m, off
                            in zip(local, rows, grads, momenta, offsets)], blocks)
                else:  # a vote from before the heal must not count: every replica skips
                    ex.add_aborted(blocks)
                ex.abandon()  # every collective of the step is done; nothing applied yet
            except Exception as e:  # a peer died: the step is dropped everywhere, not raised
                manager.report_error(e)
                failed = True
        agreed, intra = None, 0
        if self.sharding is not None:
            try:  # every rank of the replica takes part, failed or not (matched collectives)
                agreed = self._agree_in_replica(None if failed else ex, n, step, device)
                intra = (self.sharding.shards - 1) * n * HEADER_WORDS * WORD_BYTES
            except Exception as e:  # a rank of this replica died: this replica's step fails
                manager.report_error(e)
                failed = True
        committed = should_commit(manager, step)
        stats = None
        if committed and not failed:
            try:  # the apply (raises NonFiniteGradientError alike everywhere)
                stats = ex.finish(agree=None if agreed is None else lambda headers, word: agreed)
            except StepAbortedError:  # a replica healed late: nothing applied anywhere
                pass
        self._settle(committed and not failed, late is not None)
        for p in params:
            self.opt.state[p]["step"] = manager.current_step()
        numel = sum(t.numel() for t in local)
        sent = ex.sent if ex else 0
        base = stats or StepStats(sent, sent, numel, n, opt.mode, opt.votes,
                                  ex.backend if ex else "none", skipped=True)
        opt.last_stats = ElasticStepStats(
            base.bytes_sent + intra, base.bytes_received + intra, numel, n, base.mode,
            base.votes, base.backend, skipped=base.skipped or not committed,
            buckets=base.buckets, participants=n, committed=committed and not failed,
            manager_step=manager.current_step(), inter_node_bytes_sent=base.bytes_sent,
            intra_node_bytes_sent=intra,
            shards=self.sharding.shards if self.sharding is not None else 1)

    def _settle(self, committed: bool, late: bool) -> None:
        """Whether the next quorum may be asked ahead (``start_quorum``)."""
        if late:
            self.backoff = min(max(1, 2 * self.backoff), MAX_BACKOFF)
            self.sync_left = self.backoff
        elif committed and self.sync_left:
            self.sync_left -= 1
        self.current = committed and not late and not self.healed

    def _save(self) -> dict:
        params = self._params()
        out = {"params": [self._local(p).detach().clone() for p in params],
               "step": max((self.opt.state[p].get("step", 0) for p in params), default=0)}
        if self.heal_momentum == "peer":
            out["exp_avg"] = [self._momentum(p).clone() for p in params]
        return out

    def _load(self, saved: dict) -> None:
        if self.deferring:  # forward and backward may be reading the parameters
            self.late = saved
            return
        self.healed = True
        params = self._params()
        _copy_into([self._local(p) for p in params], saved["params"], "parameters")
        if self.heal_momentum == "peer":
            _copy_into([self._momentum(p) for p in params], saved["exp_avg"], "momenta")
        elif self.heal_momentum == "zero":
            for p in params:
                self._momentum(p).zero_()
        for p in params:
            self._momentum(p)
            self.opt.state[p]["step"] = int(saved["step"])


# ----------------------------------------------------------------------------- DiLoCo


@dataclass(frozen=True)
class ElasticSyncStats:
    """A sync on torchft's quorum: the ``SyncStats`` of the sync (``sync``; its fields read
    through, ``world_size`` being the sync's number of participating replicas), ``participants``,
    ``committed`` (what ``should_commit`` said; False: theta_bar and the outer momenta are
    unchanged and the fragment's parameters went back to theta_bar) and ``manager_step`` (the
    manager's step count after it)."""

    sync: object
    participants: int = 0
    committed: bool = False
    manager_step: int = 0

    def __getattr__(self, name):
        if name == "sync":  # not set yet (copying): no recursion
            raise AttributeError(name)
        return getattr(self.sync, name)


def check_diloco(*, group, device_mesh, overlap_steps, outer, outer_options) -> None:
    """The arguments ``DiLoCo(..., manager=)`` takes (module docstring, Limits)."""
    if outer not in ("dlion", "nesterov") or outer_options is not None:
        raise ValueError("DiLoCo with manager= runs the plain outer steps: outer='dlion' or "
                         f"'nesterov' with outer_options=None, got outer={outer!r}, "
                         f"outer_options={outer_options!r}")
    if group is not None or device_mesh is not None:
        raise ValueError("DiLoCo with manager= syncs over the manager's process group: pass "
                         "group=None and device_mesh=None (one process per replica)")
    if overlap_steps:
        raise ValueError(f"DiLoCo with manager= needs overlap_steps=0 (a sync's quorum and commit "
                         f"close within the step), got {overlap_steps}")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError("DiLoCo with manager= runs one process per replica; this process's "
                         "default process group has several ranks")


class ElasticDiLoCo:
    """``DiLoCo(..., manager=)``'s syncs (module docstring)."""

    def __init__(self, diloco, manager, sync_stats, heal_momentum: str = "own", error=None):
        check_manager(manager)
        check_heal_momentum(heal_momentum)
        self.d, self.manager, self.heal_momentum = diloco, manager, heal_momentum
        self.sync_stats = sync_stats  # DiLoCo's SyncStats class
        self.error = error or {}  # DiLoCo's words for a failed sync (label, applied)
        self.key = _register(manager, "dlion_kernels.DiLoCo", self._load, self._save)

    def step(self):
        d, manager = self.d, self.manager
        t = d.inner_step + 1
        if frag.due(t, d.sync_every, d.fragments) is None:
            d.inner_step = t
            return None
        manager.start_quorum()  # may heal: inner step, theta_bar, parameters
        t = d.inner_step + 1
        f = frag.due(t, d.sync_every, d.fragments)
        group = _quorum_group(manager)
        n = group.n
        failed = manager.errored() is not None or f is None
        fragment = d.fragment_states[f if f is not None else 0]
        ex = summed = None
        if not failed:
            try:
                grad = fragment.pseudo_gradient()
                if d.outer == "dlion":
                    ex = Exchange(device=fragment.theta.device, mode=d.mode, votes=d.votes,
                                  group=group, backend=d.backend, step=t,
                                  nonfinite=d.nonfinite, timeout=d.timeout)
                    ex.add([ex.row(x, g, m, off, fragment.segment) for x, g, m, off in zip(
                        fragment.views(fragment.theta), fragment.views(grad),
                        fragment.views(fragment.momentum), fragment.offsets)], fragment.blocks)
                    ex.abandon()  # every collective of the sync is done; nothing applied yet
                else:
                    summed = grad
                    if n > 1:
                        collective(ALL_REDUCE, t, dist.all_reduce, summed, group=group)
            except Exception as e:  # a peer died: the sync is dropped everywhere, not raised
                manager.report_error(e)
                failed = True
        committed = should_commit(manager, t, **self.error) and not failed
        skipped, sent = True, 0
        if ex is not None:
            sent = ex.sent
        if committed:
            if ex is not None:
                skipped = ex.finish().skipped  # the apply (raises on a non-finite alike)
            else:
                mean = summed.div_(n) if n > 1 else summed
                skipped = not bool(torch.isfinite(mean).all())
                if skipped and d.nonfinite == "raise":
                    raise NonFiniteGradientError(
                        f"DiLoCo sync at inner step {t}: a pseudo-gradient holds inf or NaN on at "
                        "least one replica; nothing was applied on any replica")
                if not skipped:
                    d.nesterov_update(fragment, mean)
                sent = round(gossip_bytes_per_step(fragment.numel, 4, n))
        # theta_i = theta_bar: the new one, or (not committed) the last synced one, so a
        # replica never carries a window that was not synced into the next
        fragment.set_params()
        d.inner_step = t
        stats = self.sync_stats(step=t, applied_step=t, fragment=fragment.index, outer=d.outer,
                          numel=fragment.numel, world_size=n, bytes_sent=sent,
                          bytes_received=sent, skipped=skipped,
                          mode=d.mode if d.outer == "dlion" else None,
                          votes=d.votes if d.outer == "dlion" else None,
                          backend=ex.backend if ex is not None else None)
        d.last_stats = ElasticSyncStats(stats, participants=n, committed=committed,
                                        manager_step=manager.current_step())
        d.bytes_sent += sent
        return d.last_stats

    def _params(self) -> list:
        return [p for f in self.d.fragment_states for p in f.params]

    def _peer_momentum(self) -> bool:
        # Nesterov's u is built from the mean pseudo-gradient: the same on every replica, part
        # of the shared state (only D-Lion's momenta are private to a replica)
        return self.heal_momentum == "peer" or self.d.outer == "nesterov"

    def _save(self) -> dict:
        d = self.d
        out = {"inner_step": d.inner_step,
               "theta_bar": [f.theta.clone() for f in d.fragment_states],
               "params": [p.detach().clone() for p in self._params()]}
        if self._peer_momentum():
            out["momentum"] = [f.momentum.clone() for f in d.fragment_states]
        return out

    def _load(self, saved: dict) -> None:
        d = self.d
        _copy_into([f.theta for f in d.fragment_states], saved["theta_bar"], "theta_bar")
        _copy_into(self._params(), saved["params"], "parameters")
        if self._peer_momentum():
            _copy_into([f.momentum for f in d.fragment_states], saved["momentum"], "outer momenta")
        elif self.heal_momentum == "zero":
            for f in d.fragment_states:
                f.momentum.zero_()
        d.inner_step = int(saved["inner_step"])


__all__ = ["ElasticStepStats", "ElasticSyncStats", "ManagerGroup", "ElasticLion", "ElasticDiLoCo",
           "HEAL_MOMENTUM", "REPLICA_HEADERS", "replica_sharding"]
