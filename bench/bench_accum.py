"""AccumAdamW / AccumLion step benchmark: GB/s of the fused kernels against a copy, and time
against a peer, in one run. On the CPU the peer is Decent-DP's ``_foreach`` AccumAdamW (PyPI
decent-dp 0.2.3, the paper's code); on a GPU (``--device cuda``) it is torch's own fused AdamW
(``torch.optim.AdamW(fused=True)``), and every backend that runs there (``cuda``, ``triton``) is
timed.

Bytes each step must move, per element (xs = parameter/gradient bytes; a, m, v fp32), counted
per stage (one fused pass: every read and every write once):

| optimizer              | bytes / element                                 | fp32 | bf16 |
|------------------------|-------------------------------------------------|------|------|
| AccumAdamW, K > 1      | x 2xs + g xs + a 8 + m 8 + v 8 (one pass)        | 36   | 30   |
| AccumAdamW, K = 1      | x 2xs + g xs + m 8 + v 8 (a untouched)           | 28   | 22   |
| AccumLion, K > 1       | x 2xs + g xs + a 8 + m 8                         | 28   | 22   |
| torch AdamW(fused)     | x 2xs + g xs + m 2xs + v 2xs (its state has x's dtype) | 28 | 14 |
| copy                   | read + write of a buffer (charged 8 bytes/fp32)  |      |      |

K > 1 is timed on non-flush steps (t mod K != 0, 3 of every 4 steps at K = 4), where m and v
are read but not written: each row is charged what its step really moves (``_bytes``).
Decent-DP's ``_foreach`` version (fp32 only: its state has the parameters' dtype) makes about
12 passes over the tensors; it is charged the same bytes, so its GB/s is effective bandwidth.
On the GPU the times are medians of ``triton.testing.do_bench`` (CUDA events when triton is
missing); the targets printed there: AccumAdamW >= 85% of copy, and faster than torch's fused
AdamW on the same tensors.

    python bench/bench_accum.py [--numel 16M] [--tensors 64] [--threads N] [--smoke]
    python bench/bench_accum.py --device cuda [--numel 256M]
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


def _time_cuda(fn, reps: int, min_s: float) -> float:
    """Median seconds of ``fn`` on the GPU: triton's do_bench, or CUDA events."""
    try:
        import triton.testing
    except ImportError:
        triton = None
    if triton is not None:
        rep_ms = max(50.0, 1000 * min_s)
        return triton.testing.do_bench(fn, warmup=rep_ms / 4, rep=rep_ms,
                                       return_mode="median") / 1e3
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(max(reps, 10)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return common.median(times)


def _torch_fused_adamw(xs, gs, K):
    """torch.optim.AdamW(fused=True) over the same tensors (its state in x's dtype), or None."""
    params = [torch.nn.Parameter(x.clone()) for x in xs]
    for p, g in zip(params, gs):
        p.grad = g.clone()
    try:
        opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.999), eps=1e-8,
                                weight_decay=0.01, fused=True)
        opt.step()
    except (RuntimeError, TypeError, ValueError) as e:  # no fused AdamW for this device/dtype
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
    return opt.step, None


COPY_TARGET = 0.85  # GPU: AccumAdamW at least this share of the copy's bandwidth


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cpu (default) or cuda: every GPU backend against torch's fused "
                             "AdamW")
    parser.add_argument("--numel", default=None,
                        help="total elements (K, M suffixes; default 16M on the CPU, 64M on a "
                             "GPU)")
    parser.add_argument("--tensors", type=int, default=64, help="tensors the elements are in")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default all)")
    parser.add_argument("--reps", type=int, default=7)
    common.add_common_args(parser)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    if on_gpu and not torch.cuda.is_available():
        print("--device cuda: no CUDA device is visible to torch", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    numel = 1 << 18 if args.smoke else common.parse_count(args.numel or
                                                          ("64M" if on_gpu else "16M"))
    count = 4 if args.smoke else args.tensors
    reps = 2 if args.smoke else args.reps
    min_s = 0.0 if args.smoke else (0.2 if on_gpu else 1.0)
    timer = _time_cuda if on_gpu else _time
    sizes = [numel // count + (1 if i < numel % count else 0) for i in range(count)]
    sizes[0] += 31  # an odd size, a tail that is not a whole block
    total = sum(sizes)
    available = accum.backends.available_backends(device)
    if on_gpu:
        names = [b for b in ("cuda", "triton") if b in available]
    else:
        names = ["cpu" if "cpu" in available else "torch"]
    rows, notes = [], []

    src = torch.randn(total, device=device)
    dst = torch.empty_like(src)
    t_copy = timer(lambda: dst.copy_(src), reps, min_s)
    copy_gbs = 8 * total / t_copy / 1e9
    rows.append(dict(variant="copy fp32", dtype="float32", K="", ms=t_copy * 1e3,
                     gb_s=copy_gbs, vs_copy=1.0, speedup_vs_foreach=""))
    src = dst = None

    try:
        from decent_dp.optim import accum_adamw_foreach
    except ImportError:
        accum_adamw_foreach = None
    peer = "torch AdamW(fused)" if on_gpu else "_foreach"

    for dtype in (torch.float32, torch.bfloat16):
        xs_b = torch.tensor([], dtype=dtype).element_size()
        dname = str(dtype).replace("torch.", "")
        for kind, K in (("adamw", 1), ("adamw", 4), ("lion", 1), ("lion", 4)):
            xs = [torch.randn(s, device=device).to(dtype) for s in sizes]
            gs = [torch.randn(s, device=device).to(dtype) * 1e-2 for s in sizes]
            st = [[torch.zeros(s, device=device) for s in sizes] for _ in range(3)]
            step = [1]
            name_of = "AccumAdamW" if kind == "adamw" else "AccumLion"
            moved = _bytes(kind, K, K == 1, total, xs_b)
            timed = []
            for backend in names:
                def fused(kind=kind, K=K, xs=xs, gs=gs, st=st, step=step, backend=backend):
                    # keep t on non-flush steps for K > 1 (3 of every 4 steps are such)
                    t = step[0] if K == 1 else 1
                    if kind == "adamw":
                        accum.adamw(xs, gs, st[0], st[1], st[2], lr=1e-4, beta1=0.9,
                                    beta2=0.999, eps=1e-8, weight_decay=0.01, accum_steps=K,
                                    step=t, backend=backend)
                    else:
                        accum.lion(xs, gs, st[0], st[1], lr=1e-4, beta1=0.9, beta2=0.99,
                                   weight_decay=0.01, accum_steps=K, step=t, backend=backend)
                    step[0] += 1

                t_fused = timer(fused, reps, min_s)
                row = dict(variant=f"{name_of} fused ({backend})", dtype=dname, K=K,
                           ms=t_fused * 1e3, gb_s=moved / t_fused / 1e9,
                           vs_copy=moved / t_fused / 1e9 / copy_gbs, speedup_vs_foreach="")
                rows.append(row)
                timed.append(row)
            if kind != "adamw" or (on_gpu and K != 1):
                xs = gs = st = None
                continue
            t_peer, moved_peer = None, moved
            if on_gpu:  # torch's fused AdamW (K = 1: it has no accumulation)
                peer_fn, problem = _torch_fused_adamw(xs, gs, K)
                if peer_fn is None:
                    notes.append(f"torch AdamW(fused) {dname}: not run ({problem})")
                else:
                    t_peer = timer(peer_fn, reps, min_s)
                    moved_peer = 7 * xs_b * total  # x, m, v read + write, g read: x's dtype
            elif accum_adamw_foreach is not None and dtype == torch.float32:
                steps = [torch.tensor(0, dtype=torch.int64) for _ in sizes]

                def foreach(xs=xs, gs=gs, st=st, steps=steps, K=K):
                    if K > 1:  # stay on non-flush steps, as the fused run
                        torch._foreach_mul_(steps, 0)
                    accum_adamw_foreach(xs, gs, st[1], st[2], st[0], steps, 0.9, 0.999, 1e-4,
                                        0.01, 1e-8, K)

                t_peer = timer(foreach, reps, min_s)
            if t_peer is not None:
                for row in timed:
                    row["speedup_vs_foreach"] = t_peer / (row["ms"] / 1e3)
                rows.append(dict(variant="AccumAdamW _foreach (decent-dp)" if not on_gpu
                                 else "torch AdamW(fused)", dtype=dname, K=K,
                                 ms=t_peer * 1e3, gb_s=moved_peer / t_peer / 1e9,
                                 vs_copy=moved_peer / t_peer / 1e9 / copy_gbs,
                                 speedup_vs_foreach=1.0))
            xs = gs = st = None
            if on_gpu:
                torch.cuda.empty_cache()

    meta = common.metadata({"numel": total, "tensors": count, "threads": torch.get_num_threads(),
                            "device": str(device), "loadavg": os.getloadavg()})
    if on_gpu:
        meta["gpu"] = torch.cuda.get_device_name(device)
    out = common.results_dir("bench_accum", args.out)
    common.save(out, "bench_accum", rows, meta, notes=notes)
    where = (meta["gpu"] if on_gpu else f"{torch.get_num_threads()} threads, load "
             f"{os.getloadavg()[0]:.1f}")
    table = common.markdown_table(
        rows, [("variant", "variant"), ("dtype", "dtype"), ("K", "K"), ("ms", "ms", ".3f"),
               ("gb_s", "GB/s", ".2f"), ("vs_copy", "of copy", ".2f"),
               ("speedup_vs_foreach", f"x faster than {peer}", ".2f")],
        title=f"AccumAdamW / AccumLion step, {common.human_count(total)} elements in {count} "
              f"tensors, {where}",
    )
    if on_gpu:
        table += "\n" + targets(rows) + "\n"
    if notes:
        table += "\nNotes:\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    common.save_text(out, "bench_accum.md", table + "\n")
    print(table)
    print(f"results: {out}")
    return 0


def targets(rows) -> str:
    """The GPU targets: AccumAdamW >= 85% of copy, and faster than torch's fused AdamW."""
    lines = ["### Targets", ""]
    for r in rows:
        if not r["variant"].startswith("AccumAdamW fused"):
            continue
        what = f"{r['variant']} {r['dtype']} K={r['K']}"
        ok = r["vs_copy"] >= COPY_TARGET
        lines.append(f"- {what} >= {COPY_TARGET:.0%} of copy: **{'PASS' if ok else 'FAIL'}** "
                     f"({r['vs_copy']:.0%})")
        if r["speedup_vs_foreach"] != "":
            ok = r["speedup_vs_foreach"] > 1.0
            lines.append(f"- {what} faster than torch AdamW(fused): "
                         f"**{'PASS' if ok else 'FAIL'}** ({r['speedup_vs_foreach']:.2f}x)")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
