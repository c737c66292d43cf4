"""Run a function on n real processes joined by a gloo process group, and collect results."""

import rankserver
import torch.distributed as dist

_COLLECTIVES = ("all_to_all_single", "all_gather_into_tensor", "all_gather_single", "all_reduce",
                "all_gather", "broadcast", "reduce_scatter_tensor",
                "reduce_scatter_single", "send", "recv")


def run_workers(n: int, fn, *args, timeout: float = 300.0) -> list:
    """fn(rank, n, *args) on n fresh gloo processes, one thread each; returns the list of
    per-rank results. As ``dlion_kernels.launch.spawn`` (with a bound for tests), but the ranks
    are forked from a server that imported torch once per pytest process (``rankserver``)."""
    return rankserver.run(n, fn, *args, timeout=timeout)


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
