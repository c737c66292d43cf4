"""Hierarchical D-Lion, step 5: gather the packed aggregate or gather the updated parameters?

After the inter-node exchange each of the L ranks of a node holds the tallied aggregate of its
1/L shard. Two ways to give every rank the whole update (the rest of the step is the same):

- ``aggregate``: intra-node all_gather_into_tensor of the packed aggregate shards (P_out bits per
  element), then every rank runs ``apply`` on all d elements (what hierarchy.py does);
- ``params``: every rank runs ``apply`` on its shard of a flat parameter buffer, then an
  intra-node all_gather_into_tensor of the updated shards in the parameters' storage dtype.
  The timing leaves out copying between the flat buffer and the model's tensors (a model whose
  parameters are views of one flat buffer needs none), so it favours this variant.

L gloo processes on this host (one node; loopback stands in for NVLink/PCIe), one thread each,
vote/binary. Median of ``--reps`` timings after a barrier, slowest rank.

    python bench/bench_hierarchy_gather.py            # L = 2, 4; d = 1M, 4M, 16M; fp32, bf16
    python bench/bench_hierarchy_gather.py --smoke
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# all_gather_into_tensor, under the name torch uses from 2.13 on
_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _time(fn, reps):
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        fn()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time
        times.append(elapsed.item())
    return common.median(times)


def _worker(rank, L, sizes, reps):
    from dlion_kernels.kernels import backends

    name = backends.resolve(None, torch.device("cpu"))
    kernels = backends.get(name)
    rows = []
    for d in sizes:
        blocks = -(-d // 32)
        shard = -(-blocks // L)
        gen = torch.Generator().manual_seed(0)
        owned = torch.randint(-2**31, 2**31 - 1, (shard,), dtype=torch.int32, generator=gen)
        for dname, dtype in DTYPES.items():
            params = torch.randn(L * shard * 32, generator=gen).to(dtype)
            aggregate = torch.empty(L * shard, dtype=torch.int32)
            # apply (kernel stages v2) also writes a momentum: a scratch one, as hierarchy.py
            scratch = torch.zeros(L * shard * 32, dtype=torch.float32)

            def gather_aggregate():
                _gather(aggregate, owned)
                kernels.apply([params[:d]], [None], [scratch[:d]], aggregate, [0], 1e-3, 0.0,
                              1.0, 2, "vote", False)

            mine = params[rank * shard * 32 : (rank + 1) * shard * 32]
            gathered = torch.empty_like(params)

            def gather_params():
                kernels.apply([mine], [None], [scratch[: mine.numel()]], owned, [0], 1e-3,
                              0.0, 1.0, 2, "vote", False)
                _gather(gathered, mine)

            for variant, fn in (("aggregate", gather_aggregate), ("params", gather_params)):
                fn()  # warm up (tables, buffers)
                ms = 1e3 * _time(fn, reps)
                sent = (L - 1) * (owned.numel() * 4 if variant == "aggregate"
                                  else mine.numel() * mine.element_size())
                rows.append(dict(L=L, d=d, dtype=dname, variant=variant, ms=round(ms, 3),
                                 intra_bytes_sent=sent, backend=name))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(ap)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args(argv)
    shapes = [(2, [1 << 14, 1 << 16])] if args.smoke else [(2, [1 << 20, 1 << 22, 1 << 24]),
                                                          (4, [1 << 20, 1 << 22, 1 << 24])]
    reps = 2 if args.smoke else args.reps
    rows = []
    for L, sizes in shapes:
        rows += common.run_ranks(L, _worker, sizes, reps, timeout=3600)[0]
    for r in rows:
        other = next(x for x in rows if (x["L"], x["d"], x["dtype"]) == (r["L"], r["d"],
                     r["dtype"]) and x["variant"] != r["variant"])
        r["vs_other"] = round(r["ms"] / other["ms"], 2)
    meta = common.metadata({"load_average": os.getloadavg()})
    out = common.results_dir("hierarchy-gather", args.out)
    common.save(out, "hierarchy_gather", rows, meta)
    table = common.markdown_table(
        rows, ["L", ("d", "d", ","), "dtype", "variant", ("ms", "ms (median, slowest rank)"),
               ("intra_bytes_sent", "intra-node bytes sent / rank", ","),
               ("vs_other", "time / other variant's")],
        title="Hierarchical step 5 on one node: gather aggregate vs gather parameters")
    common.save_text(out, "hierarchy_gather.md", table)
    print(table)
    print(f"load average {os.getloadavg()}; results in {out}")


if __name__ == "__main__":
    main()
