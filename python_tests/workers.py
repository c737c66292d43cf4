"""Run a function on n real processes joined by a gloo process group, and collect results."""

import multiprocessing as mp
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist

_COLLECTIVES = ("all_to_all_single", "all_gather_into_tensor", "all_gather_single", "all_reduce",
                "all_gather", "broadcast", "reduce_scatter_tensor", "send", "recv")


def _entry(fn, rank, n, store_path, out_dir, args):
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                                world_size=n)
        torch.set_num_threads(1)  # n processes share 2 cores
        result = fn(rank, n, *args)
        dist.barrier()
        dist.destroy_process_group()
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    # Skip interpreter teardown: it can abort while gloo's threads are destroyed (seen on CI,
    # after every result was written), which would read as a failed rank.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_workers(n: int, fn, *args, timeout: float = 300.0) -> list:
    """fn(rank, n, *args) on n spawned processes; returns the list of per-rank results."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_entry, args=(fn, r, n, store, tmp, args)) for r in range(n)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        errors = []
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                errors.append(f"rank {r}: timed out after {timeout}s")
            err = os.path.join(tmp, f"rank{r}.err")
            if os.path.exists(err):
                errors.append(f"rank {r}:\n" + open(err).read())
            elif p.exitcode != 0:
                errors.append(f"rank {r}: exit code {p.exitcode}")
        if errors:
            raise RuntimeError("worker failure\n" + "\n".join(errors))
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(n)]


class CountingCollectives:
    """Adds up the bytes this rank hands to the collectives (what goes to the other ranks);
    ``calls`` lists the collectives in the order they were issued (``log`` is appended to as
    well, to interleave them with other events)."""

    def __init__(self, n, log=None):
        self.n, self.sent, self.calls = n, 0, []
        self.log = log if log is not None else []

    def __enter__(self):
        self.saved = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

        def all_to_all_single(output, input, *args, **kwargs):
            self.sent += input.numel() * input.element_size() * (self.n - 1) // self.n
            self.calls.append("all_to_all_single")
            self.log.append("all_to_all_single")
            return self.saved["all_to_all_single"](output, input, *args, **kwargs)

        def gather(name):
            def all_gather(output, input, *args, **kwargs):
                self.sent += input.numel() * input.element_size() * (self.n - 1)
                self.calls.append("all_gather")
                self.log.append("all_gather")
                return self.saved[name](output, input, *args, **kwargs)

            return all_gather

        def forbidden(*args, **kwargs):
            raise AssertionError("the step uses only all_to_all_single and all-gather")

        for name in self.saved:
            setattr(dist, name, forbidden)
        dist.all_to_all_single = all_to_all_single
        for name in ("all_gather_into_tensor", "all_gather_single"):
            if name in self.saved:
                setattr(dist, name, gather(name))
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)
