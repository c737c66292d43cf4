"""Local gloo ranks: ``spawn(n, fn, *args)`` runs ``fn(rank, n, *args)`` on n new processes of
this machine joined by a gloo process group (a file store: no port to pick), and returns their
results. The benchmarks (``bench/common.run_ranks``) and the demo use it; the tests' harness
(``python_tests/workers.py``) keeps its behaviour with a server of its own.

The ranks come from multiprocessing's fork server, which imports torch once for the whole
process: a rank then starts in a fraction of a second instead of paying torch's import (seconds
of CPU each). Each rank still starts clean (the server runs no torch code), with the caller's
environment, stdout and stderr of the moment (and, as spawned ones, its working directory and
``sys.path``). Where there is no fork server (Windows), the ranks are spawned.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

_SLICE = 1.0  # seconds between two looks at the ranks' exit codes
_GRACE = 60.0  # seconds for killed ranks to be reaped


def _err(tmp, rank):
    return os.path.join(tmp, f"rank{rank}.err")


def run_rank(fn, rank: int, n: int, store: str, out_dir: str, threads: int, args) -> int:
    """One rank's run: join the gloo group of the file store ``store``, ``fn(rank, n, *args)``,
    then leave ``rank{rank}.pt`` (the result) or ``rank{rank}.err`` (the traceback) in
    ``out_dir``; returns the exit code, 0 or 1. The tests' rank server runs its forked ranks
    through it too."""
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=n)
        torch.set_num_threads(threads)
        result = fn(rank, n, *args)
        dist.barrier()  # no rank tears down while another still talks to it
        dist.destroy_process_group()
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        return 0
    except BaseException:  # noqa: BLE001 - reported to the parent, whatever it is
        with open(_err(out_dir, rank), "w") as f:
            f.write(traceback.format_exc())
        return 1


def results(out_dir: str, n: int, fn, killed, why, exit_code) -> list:
    """The results ``run_rank`` left in ``out_dir``, in rank order; RuntimeError naming every
    rank that failed instead: its traceback, why it was killed (ranks ``killed``, for ``why``),
    or its exit code (``exit_code(rank)``)."""
    errors = []
    for r in range(n):
        err = _err(out_dir, r)
        if os.path.exists(err):
            with open(err) as f:
                errors.append(f"rank {r}:\n{f.read()}")
        elif r in killed:
            errors.append(f"rank {r}: {why or 'killed'}")
        elif exit_code(r) != 0:
            errors.append(f"rank {r}: exit code {exit_code(r)}")
    if errors:
        raise RuntimeError(f"{n} gloo ranks of {getattr(fn, '__name__', fn)} failed\n"
                           + "\n".join(errors))
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
            for r in range(n)]


# What a server that forks ranks imports first (the tests' rank server and the elastic demo add
# their own). torch._dynamo: torch.optim's zero_grad, state_dict and add_param_group import it
# at their first call (about 2 s of CPU, in nearly every rank).
PRELOAD = ("torch", "torch.distributed", "torch._dynamo")


class _Stdio:
    """The caller's stdout and stderr, handed to a rank as open files: a rank forked by the fork
    server would otherwise write wherever the server's were when it started (under pytest, the
    capture of another test)."""

    def __reduce__(self):
        from multiprocessing.reduction import DupFd  # only while a process is being started

        return _attach_stdio, (DupFd(1), DupFd(2))


def _attach_stdio(out, err) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, target in ((out.detach(), 1), (err.detach(), 2)):
        os.dup2(fd, target)
        os.close(fd)


def _context():
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD))  # no effect once this process's server runs
        return ctx
    return mp.get_context("spawn")


def _spawned(fn, rank, n, store, out_dir, threads, args, environ=None, stdio=None):
    # stdio: None here; unpickling the caller's _Stdio already attached its stdout and stderr
    if environ is not None:  # the caller's environment when it started the ranks
        os.environ.clear()
        os.environ.update(environ)
    code = run_rank(fn, rank, n, store, out_dir, threads, args)
    # Skip interpreter teardown: it can abort (SIGABRT) while gloo's threads are destroyed (seen
    # on CI after every result was written), which would read as a failed rank.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def spawn(n: int, fn, *args, timeout: float | None = None, threads: int = 1) -> list:
    """``fn(rank, n, *args)`` on n new processes of this machine joined by a gloo process
    group (``torch.set_num_threads(threads)`` each); returns the n results, rank order.

    ``fn`` must be a module-level function and its results picklable. When a rank raises, the
    others (waiting in a collective forever) are killed at once; after ``timeout`` seconds
    (None: no limit) every rank still running is killed. Either way RuntimeError names the
    ranks and holds the failed ones' tracebacks."""
    ctx = _context()
    with tempfile.TemporaryDirectory() as tmp:
        # a file store: no port to pick, so parallel runs on one machine cannot collide
        store = os.path.join(tmp, "store")
        forked = ctx.get_start_method() == "forkserver"
        extra = (dict(os.environ), _Stdio()) if forked else ()  # spawned ranks inherit both
        procs = [ctx.Process(target=_spawned, args=(fn, r, n, store, tmp, threads, args, *extra))
                 for r in range(n)]
        end = None if timeout is None else time.monotonic() + timeout
        why = None  # why the ranks still running were killed
        try:
            for p in procs:
                p.start()
            while why is None:
                # one list: a rank that ends between two checks must not leave wait([]) forever
                running = [p for p in procs if p.exitcode is None]
                if not running:
                    break
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    why = f"timed out after {timeout:g} s"
                    break
                # In slices: a sentinel can stay open after its rank ended when a process the
                # rank started still holds the pipe, so the exit codes are what is watched.
                wait([p.sentinel for p in running], _SLICE if left is None else min(left, _SLICE))
                failed = [r for r, p in enumerate(procs)
                          if p.exitcode not in (None, 0) or os.path.exists(_err(tmp, r))]
                if failed:
                    why = f"killed: rank {failed[0]} failed"
        finally:
            started = [p for p in procs if p.pid is not None]
            killed = [r for r, p in enumerate(started)
                      if p.exitcode is None and not os.path.exists(_err(tmp, r))]
            for p in started:
                if p.exitcode is None:
                    p.kill()
            # not join(): it waits on the sentinel, see above; a killed rank ends at once
            reaped_by = time.monotonic() + _GRACE
            for p in started:
                while p.exitcode is None and time.monotonic() < reaped_by:
                    time.sleep(0.01)
        return results(tmp, n, fn, killed, why, lambda r: procs[r].exitcode)


# ----------------------------------------------------------------------------- torchft replicas
# One way to start torchft's side of an elastic run on one machine, for the tests, the
# benchmarks and the demo (torchft itself is imported only here, and only when called).


def lighthouse(min_replicas: int = 2, join_timeout_ms: int = 60000, **options):
    """A torchft ``LighthouseServer`` on a free port of this machine (``.address()``,
    ``.shutdown()``). ``join_timeout_ms``: how long a quorum that has ``min_replicas`` waits for
    a live replica that has not asked yet (torchft's default, 60 s: shorter, a replica slowed
    by a heal or a loaded machine misses the next quorum and the quorums split)."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's per-quorum log lines
    from torchft.coordination import LighthouseServer

    return LighthouseServer(bind="[::]:0", min_replicas=min_replicas,
                            join_timeout_ms=join_timeout_ms, **options)


def replica_manager(replica_id: str, lighthouse_addr: str, *, rank: int = 0,
                    world_size: int = 1, store_port: int | None = None,
                    addr: str = "localhost", min_replica_size: int = 2, timeout: float = 30.0,
                    quorum_timeout: float = 120.0, **options):
    """A torchft ``Manager`` for rank ``rank`` of replica ``replica_id`` (``world_size`` ranks)
    on gloo, with the synchronous quorum ``DistributedLion(manager=)`` and ``DiLoCo(manager=)``
    need. The replica's ``TCPStore``: made here, with this rank its master, unless
    ``store_port`` names the one rank 0 made (its ``manager.dlion_store``, kept alive as long as
    the manager). ``options``: more of ``Manager``'s keywords (``state_dict``, ``hostname``...).
    """
    os.environ.setdefault("RUST_LOG", "warn")
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    store = None
    if store_port is None:
        store = TCPStore(addr, 0, is_master=True, wait_for_workers=False)
        store_port = store.port
    wait = timedelta(seconds=timeout)
    options.setdefault("load_state_dict", None)
    options.setdefault("state_dict", None)
    options.setdefault("connect_timeout", wait)
    manager = Manager(pg=ProcessGroupGloo(timeout=wait), min_replica_size=min_replica_size,
                      use_async_quorum=False, replica_id=replica_id, store_addr=addr,
                      store_port=store_port, rank=rank, world_size=world_size,
                      lighthouse_addr=lighthouse_addr, timeout=wait,
                      quorum_timeout=timedelta(seconds=quorum_timeout), **options)
    manager.dlion_store = store  # the store lives as long as the manager
    return manager


def log_to(path: str) -> None:
    """Send this process's stdout and stderr to ``path`` (appended): a replica's logs (torchft's
    quorum and checkpoint-server lines, its warnings) stay out of a demo's report, and are kept
    for when a replica fails."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def end_replica(manager, leave: bool = True) -> None:
    """A replica's clean end: its Manager shut down without waiting and, with ``leave``, the
    process ended at once (torchft's threads would hold it; stdout and stderr are flushed).

    The ranks of a replica of several meet first on the default process group (the ranks of
    this replica): its rank 0 serves the replica's Manager, and a rank still waiting for the
    answer to its last commit would see the connection drop as a transport error."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    manager.shutdown(wait=False)
    if leave:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
