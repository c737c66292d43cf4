"""Elastic training on torchft's quorum: the gate that a step (``DistributedLion(manager=)``) or a
sync (``DiLoCo(manager=)``) passes when the replicas that take part may change.

The gate is not a way of stepping: the optimizer runs the same path as without a manager (flat,
overlap, hierarchy, FSDP2 shards; every DiLoCo outer step), and asks the gate four things:

    open     ``manager.start_quorum()``: torchft's Lighthouse decides which replicas take part
             and reconfigures the manager's process group for them. A replica that starts, or
             fell behind, heals here (torchft copies the state registered below from a live
             replica) before it computes anything, so its vote counts only once healed.
    group    the manager's process group of this quorum, as the exchange calls a group
             (``ManagerGroup``; n = the quorum's replicas). Every collective between replicas runs
             on it; a replica of several ranks (an FSDP2 shard group, a hierarchy's node) keeps
             its own default group for what stays inside it.
    commit   ``manager.should_commit()``, asked once every collective of the step has returned
             and before anything is applied: the step applies only where it says True. A
             collective that fails (a peer died) is reported (``manager.report_error``) and never
             raised: should_commit then says False, nothing is applied, and the next quorum goes
             on with the replicas left.
    state    what a healing replica copies (``manager.register_state_dict_fn``, under the
             owner's key): the tensors every replica holds alike (parameters, DiLoCo's theta_bar
             and Nesterov's momentum), the counters, and the private momenta by the policy below.

Without a failure a step through the gate is the step without it, bit for bit: the same path,
the same step counter, on a group of the same replicas.

When the quorum is asked. ``DistributedLion`` opens it in ``zero_grad()``. A replica that is
current (its last step committed, and that step's quorum did not heal it) asks in the background,
so the Lighthouse's round trip and the wait for the slowest replica overlap forward and backward;
the step's first collective waits for it. Any other replica (a fresh process, one whose step did
not commit) asks and waits in ``zero_grad()``, so it heals before it computes anything. Should a
quorum asked ahead find the replica behind after all (it missed the quorums the others formed
while it was late, past the Lighthouse's join timeout), the peer's state it received is applied
at ``step()`` (forward and backward may be reading the parameters until then), and its vote,
computed before the heal, counts nowhere: the replica gives the step up (every replica skips it,
each commits it with nothing applied). After such a step the replica asks at ``zero_grad()``
for a while (1 step, then 2, 4, ... up to ``MAX_BACKOFF``), so that one that keeps missing
quorums does not make every other step of everyone a step given up. ``DiLoCo`` opens one quorum
per sync (per fragment), at the sync: a replica that restarts takes its local steps alone until
the next sync of the others, heals there and syncs with them.

Momentum on heal (``heal_momentum``, the same on every replica; default ``"own"``): the private
state of a replica (D-Lion's momenta, DiLoCo's D-Lion outer momenta and error-feedback
residuals, SparseLoCo's accumulators):
- ``"own"``: the replica keeps what it has: zero for a fresh process, what it loaded from its own
  checkpoint (``dk.load_state``), its live state if it only fell behind. Votes stay independent.
- ``"peer"``: the copy of the replica it heals from (the transfer doubles); the two then vote
  alike for a while (about 1 / (1 - beta2) steps).
- ``"zero"``: zero, whatever the replica had.

A replica of several ranks: each replica is its own torch.distributed job of L ranks (its default
group), and each rank has its own Manager with ``rank`` = its position in the replica and
``world_size`` = L. torchft's process group of position r joins rank r of every live replica:
the ranks that hold the same shard (FSDP2) or the same node shard (hierarchy), the voters of it.
Every rank of a replica opens the quorum and asks ``should_commit``, which torchft makes the same
on all ranks of a replica; a replica's ranks agree with each other over their own group. Healing
is per position: rank r copies from rank r of a live replica.

``import dlion_kernels`` never imports torchft: a manager is checked here, when one is passed.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .exchange.collectives import DistributedStepError
from .exchange.pipeline import StepAbortedError

HEAL_MOMENTUM = ("own", "peer", "zero")
DEFAULT_HEAL_MOMENTUM = "own"
# the most steps a replica waits for its quorum in zero_grad() after a heal that came late
MAX_BACKOFF = 64


def check_manager(manager) -> None:
    """``manager`` must be a ``torchft.Manager`` with a synchronous quorum."""
    try:
        from torchft.manager import Manager
    except ImportError as e:  # the optional dependency
        raise ImportError("manager= needs torchft: from a checkout of dlion_kernels, "
                          "pip install -e '.[elastic]' (or pip install torchft==0.2.0)") from e
    if not isinstance(manager, Manager):
        raise TypeError(f"manager must be a torchft.Manager or None, got {type(manager).__name__}")
    if getattr(manager, "_use_async_quorum", False):
        raise ValueError(
            "manager must be made with use_async_quorum=False: with an asynchronous quorum a "
            "healing replica takes part in the step's collectives before it has healed, and a "
            "1-bit vote cannot abstain")


def check_heal_momentum(heal_momentum, manager) -> None:
    if heal_momentum not in HEAL_MOMENTUM:
        raise ValueError(f"heal_momentum must be one of {HEAL_MOMENTUM}, got {heal_momentum!r}")
    if manager is None and heal_momentum != DEFAULT_HEAL_MOMENTUM:
        raise ValueError(f"heal_momentum={heal_momentum!r} applies only with manager=")


def check_replica(manager, position: int, size: int) -> None:
    """A manager made for this rank's place in its replica: ``rank`` = ``position`` and
    ``world_size`` = ``size`` (the replica's ranks); ValueError otherwise."""
    # the Manager keeps its group rank and size only as attributes (torchft has no getter)
    rank = getattr(manager, "_group_rank", position)
    world = getattr(manager, "_group_world_size", size)
    if (rank, world) != (position, size):
        raise ValueError(
            f"manager must be made with rank={position} and world_size={size} (this rank's "
            f"position in its replica and the replica's ranks), got rank={rank}, "
            f"world_size={world}: torchft's process group of position r joins rank r of every "
            "replica, the voters of the same shard")


def _live_holder(manager, key: str):
    """The live gate that holds ``key`` on ``manager``; None when the key is free, or held by
    a gate whose owner was collected or closed."""
    taken = getattr(manager, "_user_state_dicts", {}).get(key)
    if taken is None:
        return None
    holder = getattr(taken, "__self__", None)
    if isinstance(holder, Gate) and (holder.owner is None or holder.closed):
        return None
    return holder if holder is not None else taken


def check_key(manager, key: str) -> None:
    """ValueError if another live object's state is registered under ``key`` on ``manager``."""
    if _live_holder(manager, key) is not None:
        raise ValueError(
            f"this manager already serves the state of another live object under {key!r}: one "
            "per manager; close that one first (its .elastic.close()), or use param groups")


class ManagerGroup:
    """The manager's process group of one quorum, as the exchange's collectives call a group:
    ``dist.all_to_all_single``, ``dist.all_gather_into_tensor`` and ``dist.all_reduce`` call
    these methods on the group they are given. torchft's group provides ``alltoall_base``,
    ``allgather`` and ``allreduce`` on the group it reconfigured at this quorum; ``n`` is the
    quorum's number of participants, ``rank`` this replica's place among them."""

    def __init__(self, pg, n: int, rank: int):
        self.pg, self.n, self.rank_in_quorum = pg, int(n), int(rank)
        name = str(pg.getBackendName()).lower()
        self.backend_name = "nccl" if "nccl" in name else "gloo"  # check_group_device reads it

    def size(self) -> int:
        return self.n

    def rank(self) -> int:
        return self.rank_in_quorum

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts):
        even = [input.shape[0] // self.n] * self.n  # the exchange always splits evenly
        return self.pg.alltoall_base(output, input, list(output_split_sizes) or even,
                                     list(input_split_sizes) or even, opts)

    def all_gather_single(self, output, input, opts):
        return self.pg.allgather([list(output.chunk(self.n))], [input], opts)

    def allreduce(self, tensors, opts):
        return self.pg.allreduce(tensors, opts)


@dataclass
class HealState:
    """What a replica's owner (an optimizer, a DiLoCo) holds, as live tensors: ``shared`` every
    replica holds alike after a step or sync (parameters, theta_bar, Nesterov's momentum: a
    healing replica copies them), ``local`` a replica's own work since the last sync (DiLoCo's
    parameters: copied only when the replica is behind, its counters not the peer's; a replica
    at the peer's step keeps its own, so torchft's first heal of a new job, ``init_sync``, takes
    no replica's local steps away), ``private`` each replica's own state (momenta, residuals:
    ``heal_momentum`` decides), and ``counters`` (step counts), which
    ``set_counters(counters)`` sets once the tensors are copied."""

    shared: list
    private: list
    counters: dict = field(default_factory=dict)
    set_counters: Callable[[dict], None] | None = None
    local: list = field(default_factory=list)


def _copy_into(targets, saved, what: str) -> None:
    if len(saved) != len(targets) or any(tuple(s.shape) != tuple(t.shape)
                                         for s, t in zip(saved, targets)):
        raise ValueError(f"the {what} a peer sent for healing do not match this replica's: every "
                         "replica must build the same model and optimizer")
    with torch.no_grad():
        for t, s in zip(targets, saved):
            t.copy_(s)


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


def _unregister(manager_ref, key: str, gate_ref) -> None:
    """Take ``key`` off the manager, if the gate that registered it still holds it."""
    manager = manager_ref()
    if manager is None:
        return
    with contextlib.suppress(Exception):
        with manager._state_dict_lock.w_lock():
            holder = getattr(manager._user_state_dicts.get(key), "__self__", None)
            if holder is not None and holder is gate_ref():
                manager._user_state_dicts.pop(key, None)
                manager._load_state_dict_fns.pop(key, None)


class Gate:
    """torchft's quorum around the steps (syncs) of one owner (module docstring).

    ``owner``: the optimizer or DiLoCo, held weakly; ``heal_state``: a weak method of it
    returning its ``HealState``. ``key``: the name its state is registered under on the manager
    (the same on every replica; one live owner per key and manager: a second one raises
    ``ValueError``, ``close()`` frees it, and so does the owner's collection). ``replica_group``:
    the process group of this replica's own ranks (None: one process per replica).

    Per step: ``open()`` (zero_grad, or the sync), ``join()`` at the step's first collective,
    ``group()`` for the collectives, ``commit()`` between them and the apply, all inside
    ``turn()``, which reports a failed collective instead of raising it and asks
    ``should_commit`` once whatever happened."""

    def __init__(self, owner, manager, *, key: str, heal_state,
                 heal_momentum: str = DEFAULT_HEAL_MOMENTUM, replica_group=None):
        check_manager(manager)
        check_heal_momentum(heal_momentum, manager)
        check_key(manager, key)
        stale = getattr(getattr(manager, "_user_state_dicts", {}).get(key), "__self__", None)
        if stale is not None:  # a gate whose owner was collected or closed: its key is free
            _unregister(weakref.ref(manager), key, weakref.ref(stale))
        self._owner, self._heal_state = weakref.ref(owner), heal_state
        self.manager, self.key, self.heal_momentum = manager, key, heal_momentum
        self.replica_group = replica_group
        manager.register_state_dict_fn(key, self._load, self._save)
        self._finalizer = weakref.finalize(owner, _unregister, weakref.ref(manager), key,
                                           weakref.ref(self))
        self.closed = False  # close(): the owner steps no more through this gate
        self.opened = False  # this step's quorum was asked for
        self.joined = False  # ... and waited for (the turn's collectives may run)
        self.ahead = None  # a quorum asked ahead, running in the background (_Background)
        self.deferring = False  # while it runs (or backward does): a peer's state waits in late
        self.late = None  # a peer's state received while deferring: applied at the step
        self.behind = False  # this turn's vote predates a heal: the turn is given up
        self.healed = False  # this turn's quorum healed this replica
        self.failure = None  # a collective of this turn that failed (reported to the manager)
        self.committed = None  # what should_commit said this turn (None: not asked yet)
        # asking ahead pays only when this replica is at the others' step: after a step that
        # committed here without a heal. After a heal that came late, wait for the quorum at
        # zero_grad() for a while, twice as long each time
        self.current, self.sync_left, self.backoff = False, 0, 0
        self.step, self.error = 0, {}  # the turn's step and its words for a failed commit

    @property
    def owner(self):
        return self._owner()

    def close(self) -> None:
        """Stop serving this owner's state to healing replicas (its key is free again). The
        owner's later steps raise."""
        self._finalizer()
        self.closed = True

    # ------------------------------------------------------------------------- open

    def open(self, ahead: bool = False) -> None:
        """This turn's quorum, once per turn. ``ahead`` (``zero_grad()``): in the background
        while forward and backward run, if this replica is current; else here and now."""
        if self.closed:
            raise RuntimeError("this object's manager was closed (.elastic.close()): it no "
                               "longer steps elastically; build a new one on the manager")
        if self.opened:
            return
        self.opened, self.joined = True, False
        self.healed = self.behind = False
        self.failure = self.committed = None
        if ahead and self.current and self.sync_left == 0:
            self.deferring = True  # a heal in it waits for the step (_load)
            self.ahead = _Background(self.manager.start_quorum)
        else:
            self.manager.start_quorum()

    def join(self, in_backward: bool = False) -> None:
        """Wait for this turn's quorum (opening it if ``open`` was not called). A peer's state
        that arrived in a quorum asked ahead is applied now, unless ``in_backward`` (the first
        bucket of an overlapped step: then at the step); either way this turn's vote does not
        count (``behind``)."""
        self.open()
        if self.joined:
            if self.late is not None and not in_backward:
                self._heal(self._take_late())
            return
        ahead, self.ahead = self.ahead, None
        try:
            if ahead is not None:
                ahead.result()
        finally:
            self.joined = True
            self.deferring = in_backward and self.late is not None
        if self.late is not None:
            self.behind = True  # its gradients predate the heal
            if not in_backward:
                self._heal(self._take_late())

    def _take_late(self):
        late, self.late = self.late, None
        self.deferring = False
        return late

    # ------------------------------------------------------------------------- group

    def group(self) -> ManagerGroup:
        """The manager's group of this quorum (``join`` first)."""
        m = self.manager
        return ManagerGroup(m._pg, max(1, m.num_participants()), m.participating_rank() or 0)

    @property
    def participants(self) -> int:
        return max(1, self.manager.num_participants())

    # ------------------------------------------------------------------------- commit

    def fail(self, e: Exception) -> None:
        """A collective of this turn failed (a peer died): reported, not raised; the turn
        commits nothing."""
        if self.failure is None:
            self.failure = e
            self.manager.report_error(e)

    def commit(self) -> bool:
        """torchft's decision for this turn, the same on every rank of the replica (asked once
        per turn). When a rank of this replica has died, torchft fails it after the manager's
        timeout and this replica cannot go on: ``DistributedStepError`` then, nothing applied
        (the other replicas go on without it)."""
        if self.committed is not None:
            return self.committed
        self.committed = False
        try:
            self.committed = bool(self.manager.should_commit()) and self.failure is None
        except Exception as e:  # torchft's client: a timeout, or its ManagerServer gone
            raise DistributedStepError(
                self.step, "should_commit", f"{type(e).__name__}: {e}", **self.error,
                advice="If that peer is a rank of this replica, the replica cannot go on: "
                       "restart all its ranks; they heal from a live replica, and the other "
                       "replicas keep training meanwhile.") from e
        return self.committed

    def begin(self, step: int, **error) -> None:
        """A turn (one step, one sync) starts: its quorum is joined (``join``). ``step``:
        what the owner counts it as; ``error``: its words for a failed ``should_commit``
        (label, applied)."""
        self.step, self.error = step, error
        try:
            self.join()
        except BaseException:  # no quorum: nothing to commit; the next turn asks again
            self.opened = self.joined = False
            self.ahead = None
            raise

    def absorb(self, e: BaseException) -> bool:
        """Whether ``e``, raised inside the turn, is the gate's to handle: a collective that
        failed before the commit (a peer died: reported, the turn commits nothing), or a step
        that a replica gave up (one that healed late, or set apart on its own: the turn
        commits with nothing applied). Anything else is the caller's."""
        if isinstance(e, DistributedStepError) and self.committed is None:
            self.fail(e)
            return True
        if isinstance(e, StepAbortedError):
            self.commit()
            return True
        return False

    def end(self) -> bool:
        """The turn ends: ``should_commit`` is asked if the turn has not asked it yet (every
        rank of the replica asks once per turn, whatever happened). Returns its answer."""
        self.opened = self.joined = False
        try:
            return self.commit()
        finally:
            self._settle()

    @contextlib.contextmanager
    def turn(self, step: int, **error):
        """``begin``, the body (whose apply asks ``commit``), ``end``; what the body raises is
        ``absorb``-ed or raised."""
        self.begin(step, **error)
        try:
            yield self
        except (DistributedStepError, StepAbortedError) as e:
            if not self.absorb(e):
                raise
        finally:
            self.end()

    def _settle(self) -> None:
        """Whether the next quorum may be asked ahead (``open``)."""
        committed = bool(self.committed)
        if self.behind:
            self.backoff = min(max(1, 2 * self.backoff), MAX_BACKOFF)
            self.sync_left = self.backoff
        elif committed and self.sync_left:
            self.sync_left -= 1
        self.current = committed and not self.behind and not self.healed

    # ------------------------------------------------------------------------- state

    def _state(self) -> HealState | None:
        heal_state = self._heal_state()
        return None if heal_state is None else heal_state()

    def _save(self) -> dict:
        state = self._state()
        if state is None:
            raise RuntimeError(f"the object registered under {self.key!r} was collected")
        out = {"shared": [t.detach().clone() for t in state.shared],
               "local": [t.detach().clone() for t in state.local],
               "counters": dict(state.counters)}
        if self.heal_momentum == "peer":
            out["private"] = [t.detach().clone() for t in state.private]
        return out

    def _load(self, saved: dict) -> None:
        if self.deferring:  # forward and backward may be reading the parameters
            self.late = saved
            return
        self._heal(saved)

    def _heal(self, saved: dict) -> None:
        state = self._state()
        if state is None:
            return
        self.healed = True
        _copy_into(state.shared, saved["shared"], "parameters and shared state")
        if saved["counters"] != state.counters:  # behind: the peer's work since the last sync
            _copy_into(state.local, saved["local"], "parameters")
        if self.heal_momentum == "peer":
            _copy_into(state.private, saved["private"], "momenta")
        elif self.heal_momentum == "zero":
            with torch.no_grad():
                for t in state.private:
                    t.zero_()
        state.set_counters(saved["counters"])


__all__ = ["DEFAULT_HEAL_MOMENTUM", "Gate", "HEAL_MOMENTUM", "HealState", "ManagerGroup",
           "check_heal_momentum", "check_key", "check_manager", "check_replica"]
