"""Collectives that fail loudly: a dead or stalled rank becomes a ``DistributedStepError`` that
names the step and the collective, instead of a hang or a bare backend message.

Every collective of the D-Lion exchange goes through ``collective()`` (or ``wait()`` for the
asynchronous ones). How long a collective may take is the process group's own timeout, set where
the group is made::

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=60))

gloo and NCCL then raise on every surviving rank when a peer dies (its connections close) or
stalls (nothing arrives before the timeout). ``timeout=`` here is an extra, shorter bound for one
call: the collective is started with ``async_op=True`` and its ``Work`` is waited on for at most
that long (``DistributedLion(timeout=)`` and ``DecentralizedDataParallel(timeout=)`` pass theirs).

Subgroups the library makes itself (hierarchy's node groups, the mesh's group, the decentralized
topologies) are made with the default group's timeout (or the object's ``timeout=``;
``new_group`` here and ``groups.py``): ``dist.new_group`` alone would give them the backend's
default of 30 minutes (gloo). A collective that fails on one of them retires
it (``groups.retire``): work may be left pending on it, so it is made again, never reused.

After such an error the group is unusable (peers may be inside different collectives): destroy it
(``dist.destroy_process_group()``), restart the job and resume from the last checkpoint
(``dlion_kernels.load_state``). Nothing of the failed step was applied to the parameters: the
exchange applies only after its last collective has returned (see ``step.py``); on a mesh that
last collective runs over every rank, so no rank has applied it (``sharded.py``,
``hierarchy.commit``).
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import datetime
import functools
import inspect

import torch.distributed as dist

NOTHING_APPLIED = "nothing of this step was applied to the parameters on this rank"


def gather_into_tensor():
    """``dist.all_gather_into_tensor`` under the name torch uses from 2.13 on
    (``all_gather_single``), looked up at each call (tests wrap either name)."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_into_tensor():
    """``dist.reduce_scatter_tensor`` under the name torch uses from 2.13 on
    (``reduce_scatter_single``; 2.13 warns at every call of the old name)."""
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


RESTART_THE_JOB = ("The process group is no longer usable: destroy it, restart the job and resume "
                   "from the last checkpoint (dlion_kernels.load_state).")


def rebuilt_error(cls, args, state):
    """An error as it was pickled (its message and attributes), not made again: the library's
    errors take more than a message, and this one would read the receiving process's rank."""
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class DistributedStepError(RuntimeError):
    """A collective of a D-Lion step failed or timed out on this rank (a peer died or stalled).

    Attributes: ``step`` (the step counter passed to the exchange; for decentralized training the
    iteration), ``collective`` (its name) and ``rank`` (this process's rank in the default group,
    or -1 without one). The backend's own exception is chained as ``__cause__``. ``label`` names
    what ``step`` counts in the message; ``applied`` says what this rank had already applied;
    ``advice`` what to do next.
    """

    def __init__(self, step, collective: str, detail: str, *, label: str = "D-Lion step",
                 applied: str = NOTHING_APPLIED, advice: str = RESTART_THE_JOB):
        self.step, self.collective = step, collective
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else -1
        super().__init__(
            f"{label} {step}: collective {collective} failed on rank {self.rank}: {detail}. "
            f"A peer rank has probably died or stalled; {applied}. {advice}"
        )

    def __reduce__(self):  # sent between processes (multiprocessing, an elastic agent)
        return rebuilt_error, (type(self), self.args, self.__dict__)


_MAX_SECONDS = datetime.timedelta.max.total_seconds()


def as_timedelta(timeout, name: str = "timeout") -> datetime.timedelta | None:
    """``timeout`` (None, seconds > 0 or a timedelta > 0) as a timedelta; ValueError naming
    ``name`` otherwise."""
    if isinstance(timeout, datetime.timedelta) and timeout.total_seconds() <= 0:
        raise ValueError(f"{name} must be > 0, got {timeout!r}")
    if timeout is None or isinstance(timeout, datetime.timedelta):
        return timeout
    # inf, nan and more seconds than a timedelta holds are refused here, not by an OverflowError
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and \
            0 < timeout < _MAX_SECONDS:
        return datetime.timedelta(seconds=float(timeout))
    raise ValueError(f"{name} must be None, a finite number of seconds > 0 or a timedelta, got "
                     f"{timeout!r}")


def wait(work, step, name: str, timeout=None, *, label: str = "D-Lion step",
         applied: str = NOTHING_APPLIED) -> None:
    """Wait for an asynchronous collective's ``Work``; a failure or a wait longer than
    ``timeout`` (seconds or timedelta; None: the group's own timeout) raises
    ``DistributedStepError`` naming ``step`` and ``name`` (``label`` and ``applied``: see the
    error)."""
    limit = as_timedelta(timeout)
    error = dict(label=label, applied=applied)
    try:
        done = work.wait() if limit is None else work.wait(limit)
    except DistributedStepError:
        raise
    except Exception as e:  # gloo: RuntimeError; NCCL: DistBackendError (a RuntimeError)
        raise DistributedStepError(step, name, f"{type(e).__name__}: {e}", **error) from e
    if done is False:  # some backends report a timed-out wait by returning False
        raise DistributedStepError(step, name, f"not finished after {limit}", **error)


def collective(name: str, step, fn, *args, timeout=None, label: str = "D-Lion step",
               applied: str = NOTHING_APPLIED, **kwargs):
    """``fn(*args, **kwargs)`` (a torch.distributed collective) as step ``step``'s collective
    ``name``. Without ``timeout`` it runs synchronously under the group's timeout; with one, it
    runs with ``async_op=True`` and is waited on for at most ``timeout``. With ``async_op=True``
    it is only started and its ``Work`` returned: finish it with ``wait(work, step, name)``."""
    limit = as_timedelta(timeout)
    error = dict(label=label, applied=applied)
    started = kwargs.pop("async_op", False)  # the caller waits later, through wait()
    try:
        if not started and not _takes_async_op(fn):  # object collectives: synchronous only
            fn(*args, **kwargs)
            return None
        work = fn(*args, async_op=True, **kwargs)
    except Exception as e:
        raise DistributedStepError(step, name, f"{type(e).__name__}: {e}", **error) from e
    if work is not None:  # (None: a group of this rank alone ran nothing)
        _recent.append(work)  # see RECENT_WORKS
    if started:
        return work
    if work is not None:
        wait(work, step, name, limit, **error)
    return None


# gloo runs a collective on a thread of its own, which drops its reference to the collective
# (and so to its tensors) just after completing it, possibly after wait() has returned here. If
# that reference is the last one, that thread frees tensors Python made, which takes the GIL; once
# the interpreter has begun to exit it cannot, and the process aborts ("terminate called without
# an active exception") after the user's script has ended. So the library keeps the Work of its
# latest collectives: the last reference is this process's own, dropped on its own thread, and
# at exit those still kept are never freed (a gloo thread still holding one then only lets go).
RECENT_WORKS = 16
_recent: collections.deque = collections.deque(maxlen=RECENT_WORKS)


@atexit.register
def _keep_past_exit() -> None:
    for work in _recent:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(work))


@functools.cache
def _takes_async_op(fn) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read: a plain collective of torch's
        return True
    return "async_op" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def group_timeout(group=None) -> datetime.timedelta | None:
    """The timeout a process group (None: the default group) was made with, or None if the
    backend does not tell."""
    pg = group if group is not None else dist.group.WORLD
    for device in getattr(pg, "_device_types", ()):
        try:
            return pg._get_backend(device).options._timeout
        except Exception:  # a backend without options: try the next device type
            continue
    return None


def new_group(ranks, timeout=None):
    """``dist.new_group(ranks)`` whose timeout is ``timeout`` or else the default group's.

    ``dist.new_group`` without a timeout gives the backend's default (30 minutes for gloo, 10 for
    NCCL), not the timeout the user passed to ``init_process_group``: a stalled peer in a
    library-made subgroup would then hang the job that long."""
    limit = as_timedelta(timeout)
    if limit is None:
        limit = group_timeout()
    return dist.new_group(list(ranks), timeout=limit)
