"""Running the docs' Python examples as a user would: each one a script under ``torchrun
--nproc-per-node 2`` on CPUs (gloo), or, for the elastic pages, as two torchft replicas under one
Lighthouse.

Every ```python block of README.md and docs/*.md runs, except one marked ``<!-- fragment -->``
on the line before its fence (a piece of a larger script, completed by a runnable example on the
same page). A block is a whole script: it makes its own process group, as it would under torchrun.

The ranks are forked from the tests' rank server (torch imported once), two per example, each
with torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), in a fresh working folder shared by the two
(checkpoints and output folders land there), without a GPU. After the script each rank reports
digests of what it trained: the parameters of ``model`` (and the training batch ``x``), so that the
test can check that the ranks hold the same weights and read different data.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import socket
import tempfile
import time
import traceback

import rankserver

TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _digest(tensor) -> str:
    import torch

    t = tensor.detach()
    if hasattr(t, "to_local"):  # an FSDP2 DTensor: this rank's shard
        t = t.to_local()
    raw = t.cpu().contiguous().view(-1).view(torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()[:16]


def _facts(scope: dict) -> dict:
    """What the example left behind, as digests the parent compares across ranks."""
    import torch

    facts = {}
    model = scope.get("model")
    if isinstance(model, torch.nn.Module):
        facts["model"] = [_digest(p) for p in model.parameters()]
    x = scope.get("x")
    if isinstance(x, torch.Tensor):
        facts["x"] = _digest(x)
    opt = scope.get("opt")
    stats = getattr(opt, "last_stats", None)
    if stats is not None and hasattr(stats, "bytes_sent"):
        facts["bytes_sent"] = stats.bytes_sent
        facts["inter_node_bytes_sent"] = getattr(stats, "inter_node_bytes_sent", None)
        facts["skipped"] = stats.skipped
    return facts


def _example(rank, n, code, name, port, folder, env, out, replica, per_node):
    """One rank of one example; leaves ``("ok", facts)`` or ``("error", traceback)``. With
    ``replica`` every rank is a torchft replica of its own: a one-process torchrun job (its own
    store, which torchrun's agent would host) with ``REPLICA`` = its number."""
    result = ("error", "did not finish")
    try:
        os.environ.update(env)
        if replica:
            os.environ["REPLICA"] = str(rank)
            rank, n, port = 0, 1, port + rank
        per_node = per_node or n
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank % per_node), WORLD_SIZE=str(n),
                          LOCAL_WORLD_SIZE=str(per_node), GROUP_RANK=str(rank // per_node),
                          ROLE_RANK=str(rank),
                          ROLE_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        os.chdir(folder)
        import torch

        torch.set_num_threads(1)
        if replica:
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # the store below is the agent's
            store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True,  # noqa: F841
                                               wait_for_workers=False)
        scope = {"__name__": "__main__", "__file__": name}
        exec(compile(code, name, "exec"), scope)
        result = ("ok", _facts(scope))
    except BaseException:  # noqa: BLE001 - reported to the test, whatever it is
        result = ("error", traceback.format_exc())
    with open(out + ".tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(out + ".tmp", out)
    os._exit(0)  # no teardown of groups a failed peer may have left waiting


def run_example(code: str, name: str, n: int = 2, env: dict | None = None,
                replicas: bool = False, per_node: int | None = None) -> list[dict]:
    """The example on n ranks in nodes of ``per_node`` (default: one node of n; ``replicas``: n
    torchft replicas of one rank each, under a Lighthouse started here); its facts per rank.
    AssertionError with every failed rank's traceback when it raised anywhere (the other ranks
    are killed at once), or when a rank left nothing within ``TIMEOUT_S``."""
    env = {"CUDA_VISIBLE_DEVICES": "", **(env or {})}
    lighthouse = None
    if replicas:
        from dlion_kernels import launch

        lighthouse = launch.lighthouse(min_replicas=n, join_timeout_ms=10000)
        env.update(TORCHFT_LIGHTHOUSE=lighthouse.address())
    try:
        return _run(code, name, n, env, replicas, per_node)
    finally:
        if lighthouse is not None:
            lighthouse.shutdown()


def _run(code, name, n, env, replicas, per_node):
    with tempfile.TemporaryDirectory() as folder:
        outs = [os.path.join(folder, f".rank{r}.result") for r in range(n)]

        def finished():
            ready = [os.path.exists(o) for o in outs]
            if all(ready):
                return True
            return any(_load(o)[0] == "error" for o, done in zip(outs, ready) if done)

        port = free_port()
        if replicas:  # one store per replica, on consecutive ports
            while not all(_port_free(port + r) for r in range(n)):
                port = free_port()
        start = time.monotonic()
        codes = rankserver.run_bare(n, _run_rank, code, name, port, folder, env, outs, replicas,
                                    per_node, done=finished, deadline=TIMEOUT_S)
        results = [_load(o) if os.path.exists(o) else None for o in outs]
    problems = []
    for r, res in enumerate(results):
        if res is None:
            problems.append(f"rank {r}: no result after {time.monotonic() - start:.0f} s "
                            f"(exit {codes.get(r)}; killed once another rank failed?)")
        elif res[0] == "error":
            problems.append(f"rank {r}:\n{res[1]}")
    if any(res is not None and res[0] == "error" for res in results) or problems:
        raise AssertionError(f"{name} failed\n" + "\n".join(problems))
    return [res[1] for res in results]


def _run_rank(rank, n, code, name, port, folder, env, outs, replicas, per_node):
    _example(rank, n, code, name, port, folder, env, outs[rank], replicas, per_node)


def _port_free(port) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _load(path):
    with open(path, "rb") as f:
        return pickle.load(f)
