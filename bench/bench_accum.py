"""AccumAdamW / AccumLion step benchmark: GB/s of the fused kernels against a copy, and time
against Decent-DP's ``_foreach`` AccumAdamW (PyPI decent-dp 0.2.3, the paper's code), in one run.

Bytes each step must move, per element (xs = parameter/gradient bytes; a, m, v fp32):

| optimizer              | bytes / element                                 | fp32 | bf16 |
|------------------------|-------------------------------------------------|------|------|
| AccumAdamW, K > 1      | x 2xs + g xs + a 8 + m 8 + v 8 (one pass)        | 36   | 30   |
| AccumAdamW, K = 1      | x 2xs + g xs + m 8 + v 8 (a untouched)           | 28   | 22   |
| AccumLion, K > 1       | x 2xs + g xs + a 8 + m 8                         | 28   | 22   |
| copy                   | read + write of a buffer (charged 8 bytes/fp32)  |      |      |

K > 1 is timed on non-flush steps (t mod K != 0, 3 of every 4 steps at K = 4), where m and v
are read but not written: each row is charged what its step really moves (``_bytes``).
Decent-DP's ``_foreach`` version (fp32 only: its state has the parameters' dtype) makes about
12 passes over the tensors; it is charged the same bytes, so its GB/s is effective bandwidth.

    python bench/bench_accum.py [--numel 16M] [--tensors 64] [--threads N] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from dlion_kernels.kernels import accum  # noqa: E402


def _bytes(kind: str, K: int, flush: bool, numel: int, xs: int) -> int:
    """What one fused step really reads and writes."""
    b = 3 * xs  # x read + write, g read
    if K > 1:
        b += 8  # a read + write
    if kind == "adamw":
        b += 16 if (flush or K == 1) else 8  # m, v read (+ write on flush steps)
    else:
        b += 8 if (flush or K == 1) else 4
    return b * numel


def _time(fn, reps: int, min_s: float) -> float:
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < reps or time.perf_counter() - start < min_s:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) > 200:
            break
    return common.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", default="16M", help="total elements (K, M suffixes)")
    parser.add_argument("--tensors", type=int, default=64, help="tensors the elements are in")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default all)")
    parser.add_argument("--reps", type=int, default=7)
    common.add_common_args(parser)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    numel = 1 << 18 if args.smoke else common.parse_count(args.numel)
    count = 4 if args.smoke else args.tensors
    reps = 2 if args.smoke else args.reps
    min_s = 0.0 if args.smoke else 1.0
    sizes = [numel // count + (1 if i < numel % count else 0) for i in range(count)]
    sizes[0] += 31  # an odd size, a tail that is not a whole block
    total = sum(sizes)
    backend = "cpu" if "cpu" in accum.backends.available_backends("cpu") else "torch"
    rows = []

    src = torch.randn(total)
    dst = torch.empty_like(src)
    t_copy = _time(lambda: dst.copy_(src), reps, min_s)
    copy_gbs = 8 * total / t_copy / 1e9
    rows.append(dict(variant="copy fp32", dtype="float32", K="", ms=t_copy * 1e3,
                     gb_s=copy_gbs, vs_copy=1.0, speedup_vs_foreach=""))

    try:
        from decent_dp.optim import accum_adamw_foreach
    except ImportError:
        accum_adamw_foreach = None

    for dtype in (torch.float32, torch.bfloat16):
        xs_b = torch.tensor([], dtype=dtype).element_size()
        for kind, K in (("adamw", 1), ("adamw", 4), ("lion", 1), ("lion", 4)):
            xs = [torch.randn(s).to(dtype) for s in sizes]
            gs = [torch.randn(s).to(dtype) * 1e-2 for s in sizes]
            st = [[torch.zeros(s) for s in sizes] for _ in range(3)]
            step = [1]

            def fused(kind=kind, K=K, xs=xs, gs=gs, st=st, step=step):
                # keep t on non-flush steps for K > 1 (3 of every 4 steps are such)
                t = step[0] if K == 1 else 1
                if kind == "adamw":
                    accum.adamw(xs, gs, st[0], st[1], st[2], lr=1e-4, beta1=0.9, beta2=0.999,
                                eps=1e-8, weight_decay=0.01, accum_steps=K, step=t,
                                backend=backend)
                else:
                    accum.lion(xs, gs, st[0], st[1], lr=1e-4, beta1=0.9, beta2=0.99,
                               weight_decay=0.01, accum_steps=K, step=t, backend=backend)
                step[0] += 1

            t_fused = _time(fused, reps, min_s)
            moved = _bytes(kind, K, K == 1, total, xs_b)
            row = dict(variant=f"Accum{'AdamW' if kind == 'adamw' else 'Lion'} fused "
                       f"({backend})", dtype=str(dtype).replace("torch.", ""), K=K,
                       ms=t_fused * 1e3, gb_s=moved / t_fused / 1e9,
                       vs_copy=moved / t_fused / 1e9 / copy_gbs, speedup_vs_foreach="")
            if kind == "adamw" and accum_adamw_foreach is not None and dtype == torch.float32:
                steps = [torch.tensor(0, dtype=torch.int64) for _ in sizes]

                def foreach(xs=xs, gs=gs, st=st, steps=steps, K=K):
                    if K > 1:  # stay on non-flush steps, as the fused run
                        torch._foreach_mul_(steps, 0)
                    accum_adamw_foreach(xs, gs, st[1], st[2], st[0], steps, 0.9, 0.999, 1e-4,
                                        0.01, 1e-8, K)

                t_fe = _time(foreach, reps, min_s)
                row["speedup_vs_foreach"] = t_fe / t_fused
                rows.append(row)
                rows.append(dict(variant="AccumAdamW _foreach (decent-dp)",
                                 dtype=row["dtype"], K=K, ms=t_fe * 1e3,
                                 gb_s=moved / t_fe / 1e9, vs_copy=moved / t_fe / 1e9 / copy_gbs,
                                 speedup_vs_foreach=1.0))
            else:
                rows.append(row)

    meta = common.metadata({"numel": total, "tensors": count, "threads": torch.get_num_threads(),
                            "loadavg": os.getloadavg()})
    out = common.results_dir("bench_accum", args.out)
    common.save(out, "bench_accum", rows, meta)
    table = common.markdown_table(
        rows, [("variant", "variant"), ("dtype", "dtype"), ("K", "K"), ("ms", "ms", ".3f"),
               ("gb_s", "GB/s", ".2f"), ("vs_copy", "of copy", ".2f"),
               ("speedup_vs_foreach", "x faster than _foreach", ".2f")],
        title=f"AccumAdamW / AccumLion step, {common.human_count(total)} elements in {count} "
              f"tensors, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}",
    )
    common.save_text(out, "bench_accum.md", table + "\n")
    print(table)
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
