"""Gloo ranks forked from one long-lived process that imported torch once.

``import torch`` (and torch.distributed's FSDP/DTensor/checkpoint packages, triton, the library)
costs seconds of CPU per process on this machine, and the suite starts hundreds of short gloo
runs. A plain spawn pays it in every rank. Here each pytest process keeps one server process
(spawned, so it starts from a clean interpreter) that imports those modules once and then, for
each run, forks its n ranks. A forked rank starts in the state the imports left, never in a state
an earlier run left: every run still gets fresh processes (module caches keyed on process groups,
the random generators, monkeypatched functions cannot leak from one run to the next), like spawn.

Each rank takes the caller's environment, ``sys.path`` and working directory of the moment. The
server never runs torch code itself, so no thread pool exists in it when it forks. When the
caller's environment differs from the one the server started with (modules may read it at
import), a new server is started first. Rank output is written to files and replayed on the
caller's stdout/stderr after the run, so that pytest shows it with the test that ran it.

The caller sees ``dlion_kernels.launch.spawn``'s behaviour: results in rank order; when a rank
fails the others are killed at once; after ``timeout`` every rank still running is killed; a
RuntimeError names each rank and holds the failed ones' tracebacks. If the server itself dies or
stops answering, it is discarded (its ranks die with it) and the next run starts a new one.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import importlib
import multiprocessing as mp
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import wait

from dlion_kernels.launch import PRELOAD as LAUNCH_PRELOAD

# Imported once by the server, before any fork: the launcher's list (torch, torch._dynamo), then
# what the tests' ranks use. Nothing here may start a thread that the ranks would need after the
# fork (numpy's BLAS pool handles fork itself).
PRELOAD = (*LAUNCH_PRELOAD, "torch.distributed.fsdp", "torch.distributed.tensor",
           "torch.distributed.checkpoint", "torch.nn.parallel", "numpy", "pytest", "hypothesis",
           "triton", "dlion_kernels")

# Environment variables that change from test to test without meaning anything to the ranks.
_VOLATILE = ("PYTEST_CURRENT_TEST",)
_GRACE = 30.0  # seconds for killed ranks to be reported before the server is given up


def _environment() -> dict:
    return {k: v for k, v in os.environ.items() if k not in _VOLATILE}


# ----------------------------------------------------------------------------- server side


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the process that forked it ends."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _rank(rank, n, job, payload):
    """One rank, in a process just forked from the server; never returns."""
    code = 1
    try:
        out = os.open(os.path.join(job["out_dir"], f"rank{rank}.stdout"),
                      os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        err = os.open(os.path.join(job["out_dir"], f"rank{rank}.stderr"),
                      os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.close(out)
        os.close(err)
        os.environ.clear()
        os.environ.update(job["env"])
        sys.path[:] = job["sys_path"]
        os.chdir(job["cwd"])
        from dlion_kernels.launch import run_rank

        try:
            fn, args = pickle.loads(payload)
            if job.get("bare"):  # fn makes its own process group and leaves its own results
                fn(rank, n, *args)
                code = 0
            else:  # as launch.spawn's ranks: the result or the traceback left in out_dir
                code = run_rank(fn, rank, n, job["store"], job["out_dir"], job["threads"], args)
        except BaseException:  # noqa: BLE001 - reported to the caller, whatever it is
            with open(os.path.join(job["out_dir"], f"rank{rank}.err"), "w") as f:
                f.write(traceback.format_exc())
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        # No interpreter teardown: gloo's threads may abort it, and the server's objects are not
        # this process's to finalize.
        os._exit(code)


def _serve(conn, preload):
    """The server's loop: import ``preload``, then fork the ranks of each run and report their
    exits; ("kill",) kills the ranks still running. Ends when the caller goes away."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's to handle
    for name in preload:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()  # the ranks do not copy pages just because the collector touched them
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            os._exit(0)
        if msg[0] != "run":  # a ("kill",) that crossed the end of the last run: nothing to kill
            continue
        _, n, job, payload = msg
        live = {}  # pidfd -> (rank, pid)
        for rank in range(n):
            pid = os.fork()
            if pid == 0:
                conn.close()
                for fd in live:
                    os.close(fd)
                _die_with_parent()
                if os.getppid() == 1:  # the server died before prctl took effect
                    os._exit(1)
                _rank(rank, n, job, payload)
            live[os.pidfd_open(pid)] = (rank, pid)
        conn.send(("started", [pid for _, pid in sorted(live.values())]))
        while live:
            ready = wait([conn, *live])
            for fd in ready:
                if fd is conn:
                    try:
                        conn.recv()  # ("kill",)
                    except (EOFError, OSError):
                        for pidfd in live:
                            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                        os._exit(0)
                    for pidfd in live:
                        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                    continue
                rank, pid = live.pop(fd)
                _, status = os.waitpid(pid, 0)
                os.close(fd)
                conn.send(("exit", rank, os.waitstatus_to_exitcode(status)))
        conn.send(("done",))


# ----------------------------------------------------------------------------- caller side


class _Server:
    def __init__(self):
        ctx = mp.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.env = _environment()
        self.proc = ctx.Process(target=_serve, args=(theirs, PRELOAD), daemon=True,
                                name="rank server")
        self.proc.start()
        theirs.close()
        self.ready = False

    def recv(self, timeout):
        """The server's next message, or None if it died or said nothing for ``timeout`` s."""
        ready = wait([self.conn, self.proc.sentinel], timeout)
        if self.conn in ready:
            try:
                return self.conn.recv()
            except (EOFError, OSError):
                pass
        if self.proc.sentinel in ready:
            # its sentinel fires when its files close, a moment before it can be reaped
            self.proc.join(_GRACE)
        return None

    def close(self):
        if self.proc.is_alive():
            self.proc.kill()  # its ranks die with it (PR_SET_PDEATHSIG)
        self.proc.join()
        self.conn.close()


_server: _Server | None = None


def _get_server() -> _Server:
    global _server
    if _server is not None and (not _server.proc.is_alive() or _server.env != _environment()):
        _discard()
    if _server is None:
        _server = _Server()
    return _server


def _discard():
    global _server
    if _server is not None:
        _server.close()
        _server = None


atexit.register(_discard)


def _replay(out_dir, n):
    for rank in range(n):
        for name, stream in (("stdout", sys.stdout), ("stderr", sys.stderr)):
            path = os.path.join(out_dir, f"rank{rank}.{name}")
            if os.path.exists(path) and os.path.getsize(path):
                with open(path, errors="replace") as f:
                    stream.write(f.read())
                stream.flush()


def _start(n: int, job: dict, payload: bytes, first_wait: float | None):
    """Send one run to the server: a server not yet ready is waited for up to ``first_wait`` s
    (its imports; RuntimeError if it does not come up), and one that died between two runs is
    replaced once. Returns (server, answer): the server now in use and its answer to the run,
    ``("started", pids)`` or whatever else it said (None for nothing); the caller decides what
    a run that did not start means."""
    server = _get_server()
    if not server.ready:  # the first run waits for its imports
        msg = server.recv(first_wait)
        if msg is None or msg[0] != "ready":
            raise RuntimeError(f"the rank server did not start: {msg!r}")
        server.ready = True
    msg = None
    for _ in range(2):  # a server that died between two runs is replaced once
        try:
            server.conn.send(("run", n, job, payload))
            msg = server.recv(_GRACE)
        except OSError:
            msg = None
        if msg is not None or server.proc.is_alive():
            break
        server = _get_server()
        msg = server.recv(600.0)  # its imports
        server.ready = msg is not None and msg[0] == "ready"
        if not server.ready:
            break
    return server, msg


def run(n: int, fn, *args, timeout: float | None = None, threads: int = 1) -> list:
    """``fn(rank, n, *args)`` on n ranks forked from the server, joined by a gloo process group
    (a file store in a fresh temporary directory); returns the n results in rank order."""
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    payload = pickle.dumps((fn, args))  # by value (tensors copied), loaded only by the ranks
    end = None if timeout is None else time.monotonic() + timeout
    with tempfile.TemporaryDirectory() as tmp:
        job = dict(env=dict(os.environ), sys_path=list(sys.path), cwd=os.getcwd(),
                   store=os.path.join(tmp, "store"), out_dir=tmp, threads=threads)
        codes: dict = {}
        killed: set = set()  # ranks still running when they were told to die
        why = None  # why they were
        broken = None  # why the server was given up
        told = False  # whether the server was told to kill the ranks still running
        try:
            server, msg = _start(n, job, payload,
                                 None if end is None else max(end - time.monotonic(), 0) + 600)
            if msg is None or msg[0] != "started":
                broken = f"the rank server did not start the ranks ({msg!r})"
                killed = set(range(n))
                why = broken
            while broken is None and len(codes) < n:
                if why is None and end is not None and time.monotonic() >= end:
                    why = f"timed out after {timeout:g} s"
                if why is not None and not told:
                    killed = set(range(n)) - set(codes)
                    server.conn.send(("kill",))
                    told = True
                msg = server.recv(_GRACE if told else
                                  None if end is None else max(end - time.monotonic(), 0))
                if msg is None:
                    if not server.proc.is_alive():
                        broken = "the rank server died"
                        if not told:
                            killed, why = set(range(n)) - set(codes), broken
                    elif told:
                        broken = "the rank server did not report its killed ranks"
                    continue  # else the deadline: killed on the next turn
                _, rank, code = msg
                codes[rank] = code
                if code != 0 and why is None:
                    why = f"killed: rank {rank} failed"
            if broken is None:
                msg = server.recv(_GRACE)
                if msg != ("done",):
                    broken = f"the rank server did not finish the run ({msg!r})"
        except BaseException:
            _discard()  # interrupted mid-run: the ranks die with the server
            raise
        if broken is not None:
            _discard()
        _replay(tmp, n)
        from dlion_kernels.launch import results

        return results(tmp, n, fn, killed, why, codes.get)


def run_bare(n: int, fn, *args, done, deadline: float) -> dict:
    """``fn(rank, n, *args)`` on n ranks forked from the server, with nothing around it: fn makes
    its own process group and leaves its results where the caller looks (the fault tests, whose
    ranks die or stall on purpose). A rank that fails does not end the others. Returns when
    ``done()`` is true, when every rank has ended, or after ``deadline`` seconds, killing the
    ranks still running; the result is {rank: exit code, or None for a rank that was killed}."""
    payload = pickle.dumps((fn, args))
    end = time.monotonic() + deadline
    with tempfile.TemporaryDirectory() as tmp:
        job = dict(env=dict(os.environ), sys_path=list(sys.path), cwd=os.getcwd(), store=None,
                   out_dir=tmp, threads=1, bare=True)
        codes: dict = {}
        try:
            server, msg = _start(n, job, payload, 600.0)
            if msg is None or msg[0] != "started":
                raise RuntimeError(f"the rank server did not start the ranks ({msg!r})")
            while len(codes) < n and not done() and time.monotonic() < end:
                msg = server.recv(0.05)
                if msg is None:
                    if not server.proc.is_alive():
                        raise RuntimeError("the rank server died")
                    continue
                codes[msg[1]] = msg[2]
            if len(codes) < n:
                server.conn.send(("kill",))
                for rank in set(range(n)) - set(codes):
                    codes[rank] = None
                while True:
                    msg = server.recv(_GRACE)
                    if msg is None:
                        raise RuntimeError("the rank server did not report its killed ranks")
                    if msg[0] == "done":
                        break
            else:
                msg = server.recv(_GRACE)
                if msg != ("done",):
                    raise RuntimeError(f"the rank server did not finish the run ({msg!r})")
        except BaseException:
            _discard()  # its ranks die with it
            raise
        finally:
            _replay(tmp, n)
    return codes
