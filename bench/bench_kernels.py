"""Kernel benchmarks: each stage and a whole step without communication, in bytes moved.

For every backend that can run on the device (GPU: cuda, triton, torch; CPU: cpu, torch; the
Triton interpreter on the CPU is skipped: it is a correctness tool, not a timing target), fp32
and bf16, flat tensors of ``--sizes`` elements and the 148 tensors of GPT-2 124M, it times

- ``local_step``            votes = binary
- ``tally vote n=8``        8 binary vote vectors -> vote/binary aggregate
- ``tally avg n=8``         8 binary vote vectors -> average/binary aggregate (4 planes)
- ``apply vote``            vote/binary aggregate (1 plane)
- ``apply avg/bin n=8``     average/binary aggregate, n = 8 (4 planes)
- ``apply avg/ter n=8``     average/ternary aggregate, n = 8 (5 planes)
- ``step``                  local_step + tally(n=1) + apply, vote/binary: a whole D-Lion step
                            without communication

and on the GPU, at the ``--graph-sizes`` (default 1M, where a step is bound by its launches):

- ``step graph``            the same three stages captured once in a CUDA graph and replayed
                            (the step counter on the device): the kernels' own time
- ``fused_dlion_step``      the library's whole step on one rank (``nonfinite="skip"``, the step
                            counter on the device): check, stages, header, decision, as launched
                            from Python
- ``fused_dlion_step graph`` that step captured in a CUDA graph and replayed: what a training
                            loop that captures its step pays
- ``step kernels``, ``fused_dlion_step kernels``: the sum of the device durations of each one's
                            kernels (torch's profiler): the time no launch overhead is added to.
                            Targets: each graph row within 1.5x its kernels' time

and, as peers of ``step`` on the same tensors (x and g of the dtype, m fp32):

- ``lion-pytorch triton``   ``lion_pytorch.triton.update_fn``, one launch per tensor (CUDA only)
- ``foreach lion (timm)``   plain Lion written with ``torch._foreach_*`` ops, the way timm does
- ``unfused sign-pack``     D-Lion from plain torch ops, the way the unofficial D-Lion code and
                            DeepSpeed's compressed backend do it: update, sign, pack the signs to
                            uint8 with ``reshape(-1, 8) * 2**k`` + ``sum``, unpack, vote, update;
                            one pass per tensor (our own re-implementation)

Bytes each variant must move, per element (xs, gs = bytes of the parameter / gradient dtype,
4 for fp32, 2 for bf16; m is fp32; P = bit planes of layout.py; n = vote vectors):

| variant            | bytes / element                          | fp32    | bf16 x, g |
|--------------------|------------------------------------------|---------|-----------|
| local_step         | g gs + m 4 read + votes 1/8              | 8.125   | 6.125     |
| tally vote n=8     | n P_in/8 + P_out/8 = 8/8 + 1/8           | 1.125   | 1.125     |
| tally avg n=8      | n P_in/8 + P_out/8 = 8/8 + 4/8           | 1.5     | 1.5       |
| apply vote         | x 2 xs + g gs + m 8 + aggregate 1/8      | 20.125  | 14.125    |
| apply avg/bin n=8  | 2 xs + gs + 8 + P/8, P = 4               | 20.5    | 14.5      |
| apply avg/ter n=8  | 2 xs + gs + 8 + P/8, P = 5               | 20.625  | 14.625    |
| step (vote/binary) | local_step + tally(1, 1, 1) + apply(1)   | 28.5    | 20.5      |
| step graph, fused_dlion_step (graph) | counted as ``step``     | 28.5    | 20.5      |
| Lion peers         | x 2 xs + g gs + m 8 (one fused pass)     | 20      | 14        |
| unfused sign-pack  | counted as ``step`` (same algorithm)     | 28.5    | 20.5      |

The peers are charged only the bytes of one fused pass, so their GB/s is *effective* bandwidth:
the unfused variants really move several times more. GB/s = bytes / time. ``of copy`` is the
bandwidth of the row over that of a device-to-device ``dst.copy_(src)`` moving the same number of
bytes (B/2 read + B/2 written), measured in the same run.

Timing: GPU ``triton.testing.do_bench`` (median), the copy timed the same way once per byte
count. CPU: median of repeated ``time.perf_counter`` runs after a warm-up (at least
``--min-reps``, more until ``--rep-seconds`` are spent, at most ``--max-reps``; a variant whose
warm-up takes over ``--slow-seconds`` is timed once), each run followed by a run of the copy of
the same bytes, so that kernel and copy see the same machine (memory bandwidth on the VM this was
written on drifts by 2x from one second to the next). Stages run in place (m and x drift; that
does not change their cost).

On the CPU, in-place kernels (local_step's m, apply's x) can exceed 100% of copy: a copy into a
separate buffer also pays the write-allocate read of the destination's cache lines, an in-place
update does not (up to 1.5x). The copy is still the honest "same bytes" reference.

Targets (printed as PASS/FAIL with the numbers):
- CPU: the cpu backend's local_step and applies >= 70% of copy at 16M fp32 (flat).
- GPU: cuda and triton local_step and applies >= 90% of copy at 64M elements and above (flat).
- GPU: the whole D-Lion step (cuda, triton) no slower than lion-pytorch's Triton Lion on a flat
  tensor, and >= 3x faster on the GPT-2 list.

    python bench/bench_kernels.py                      # CPU: 1M 4M 16M 64M, fp32 bf16, ~6 min
    python bench/bench_kernels.py --smoke              # 1M fp32, few reps, < 60 s
    python bench/bench_kernels.py --device cuda        # GPU: 1M ... 1G, what fits
    python bench/bench_kernels.py --sizes 16M --dtypes fp32 --backends cpu --shapes flat
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (adds the repository root to sys.path)
import torch  # noqa: E402

from dlion_kernels import accounting  # noqa: E402
from dlion_kernels.kernels import backends as dk_backends  # noqa: E402
from dlion_kernels.kernels.layout import aggregate_planes, block_offsets  # noqa: E402

NAME = "bench_kernels"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CPU_SIZES = "1M,4M,16M,64M"
GPU_SIZES = "1M,4M,16M,64M,256M,1G"
LR, WD, BETAS = 1e-4, 0.1, (0.9, 0.99)
N_TALLY = 8  # vote vectors of the tally and average-apply rows
CPU_TARGET, GPU_TARGET, GPT2_SPEEDUP = 0.70, 0.90, 3.0
GRAPH_TARGET = 1.5  # a captured whole step within this factor of its kernels' time
GRAPH_OPS = ["step kernels", "step graph", "fused_dlion_step kernels", "fused_dlion_step",
             "fused_dlion_step graph"]

PEER_LION = "lion-pytorch triton"
PEER_FOREACH = "foreach lion (timm)"
PEER_UNFUSED = "unfused sign-pack"


# ----------------------------------------------------------------------------- shapes


def gpt2_shapes(layers: int = 12, scale: float = 1.0) -> list[tuple[int, ...]]:
    """The 148 parameter tensors of GPT-2 124M (HF names, Conv1D weights are [in, out]).
    ``scale`` < 1 shrinks every dimension (same number of tensors, fewer elements)."""

    def d(v: int) -> int:
        return max(1, round(v * scale))

    vocab, ctx, h = d(50257), d(1024), d(768)
    shapes = [(vocab, h), (ctx, h)]  # wte, wpe
    for _ in range(layers):
        shapes += [(h,), (h,),  # ln_1 weight, bias
                   (h, 3 * h), (3 * h,),  # attn.c_attn
                   (h, h), (h,),  # attn.c_proj
                   (h,), (h,),  # ln_2
                   (h, 4 * h), (4 * h,),  # mlp.c_fc
                   (4 * h, h), (h,)]  # mlp.c_proj
    shapes += [(h,), (h,)]  # ln_f
    return shapes


def numel_of(shapes) -> int:
    return sum(math.prod(s) for s in shapes)


# ----------------------------------------------------------------------------- bytes


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def bytes_per_elt(op: str, dtype: torch.dtype) -> float:
    """Bytes per element the variant must move (see the module docstring): the stage counts of
    ``dlion_kernels.accounting`` with x and g in ``dtype``."""
    xs = gs = dtype_bytes(dtype)
    avg, ter = (aggregate_planes("average", votes, N_TALLY) for votes in ("binary", "ternary"))
    if op == "local_step":
        return accounting.local_step_bytes(gs)
    if op == "tally vote n=8":
        return accounting.tally_bytes(N_TALLY)
    if op == "tally avg n=8":
        return accounting.tally_bytes(N_TALLY, avg)
    if op == "apply vote":
        return accounting.apply_bytes(xs, gs)
    if op == "apply avg/bin n=8":
        return accounting.apply_bytes(xs, gs, avg)
    if op == "apply avg/ter n=8":
        return accounting.apply_bytes(xs, gs, ter)
    if op in ("step", PEER_UNFUSED, *GRAPH_OPS):
        return (accounting.local_step_bytes(gs) + accounting.tally_bytes()
                + accounting.apply_bytes(xs, gs))
    if op in (PEER_LION, PEER_FOREACH):
        return accounting.apply_bytes(xs, gs, planes=0)
    raise ValueError(op)


# ----------------------------------------------------------------------------- timing


class Timer:
    """Median time of ``fn`` in seconds: do_bench on the GPU, perf_counter loops on the CPU."""

    def __init__(self, device: torch.device, min_reps: int, max_reps: int, rep_seconds: float,
                 slow_seconds: float = 1.0):
        self.device = device
        self.min_reps, self.max_reps, self.rep_seconds = min_reps, max_reps, rep_seconds
        self.slow_seconds = slow_seconds
        self.last_reps = None  # CPU: timed runs behind the last median

    def __call__(self, fn) -> float:
        if self.device.type == "cuda":
            import triton.testing

            rep_ms = max(20.0, 1000 * self.rep_seconds)
            try:
                ms = triton.testing.do_bench(fn, warmup=max(5.0, rep_ms / 4), rep=rep_ms,
                                             return_mode="median")
            except TypeError:  # older triton: no return_mode
                ms = triton.testing.do_bench(fn, warmup=max(5.0, rep_ms / 4), rep=rep_ms,
                                             quantiles=[0.5])
            self.last_reps = None
            return float(ms) / 1e3
        t0 = time.perf_counter()
        fn()  # warm-up (first-touch, caches, thread pool)
        warm = time.perf_counter() - t0
        # A call slower than --slow-seconds (the torch reference at 64M+) is timed once more
        # only: a median of 3 would triple the run for rows that are 50x off the target anyway.
        min_reps = 1 if warm >= self.slow_seconds else self.min_reps
        times: list[float] = []
        start = time.perf_counter()
        while len(times) < self.max_reps:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            if len(times) >= min_reps and time.perf_counter() - start >= self.rep_seconds:
                break
        self.last_reps = len(times)
        return common.median(times)

    def pair(self, fn, copy_fn) -> tuple[float, float]:
        """CPU: median times of ``fn`` and of ``copy_fn``, run alternately (fn, copy, fn, ...) so
        that both see the same machine state; a VM's memory bandwidth drifts by 2x between
        seconds here, and a copy timed apart from the kernel made the fractions meaningless."""
        t0 = time.perf_counter()
        fn()
        copy_fn()
        warm = time.perf_counter() - t0
        min_reps = 1 if warm >= self.slow_seconds else self.min_reps
        ts, tc = [], []
        start = time.perf_counter()
        while len(ts) < self.max_reps:
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            copy_fn()
            t2 = time.perf_counter()
            ts.append(t1 - t0)
            tc.append(t2 - t1)
            if len(ts) >= min_reps and time.perf_counter() - start >= self.rep_seconds:
                break
        self.last_reps = len(ts)
        return common.median(ts), common.median(tc)


# ----------------------------------------------------------------------------- peers


def foreach_lion(params, grads, exp_avgs, lr, wd, beta1, beta2):
    """Lion with torch._foreach ops, the way timm's multi-tensor Lion is written."""
    torch._foreach_mul_(params, 1 - lr * wd)
    updates = torch._foreach_mul(exp_avgs, beta1)
    torch._foreach_add_(updates, grads, alpha=1 - beta1)
    if hasattr(torch, "_foreach_sign"):
        updates = torch._foreach_sign(updates)
    else:
        updates = [u.sign() for u in updates]
    torch._foreach_add_(params, updates, alpha=-lr)
    torch._foreach_mul_(exp_avgs, beta2)
    torch._foreach_add_(exp_avgs, grads, alpha=1 - beta2)


_POW2_CACHE: dict = {}


def _pow2(device) -> torch.Tensor:
    key = str(device)
    if key not in _POW2_CACHE:
        _POW2_CACHE[key] = (2 ** torch.arange(8, device=device)).to(torch.uint8)
    return _POW2_CACHE[key]


def unfused_dlion(params, grads, exp_avgs, lr, wd, beta1, beta2):
    """D-Lion (vote, binary, n = 1) from plain torch ops, one tensor at a time: compute the update,
    take its sign, pack the signs 8 to a byte with torch arithmetic, (here the all-gather would
    go), unpack, vote, update. Our re-implementation of the approach of the unofficial D-Lion code
    and of DeepSpeed's compressed backend (sign + bit packing in torch)."""
    pow2 = _pow2(params[0].device)
    for x, g, m in zip(params, grads, exp_avgs):
        gf = g.reshape(-1).float()
        mf = m.view(-1)
        c = mf * beta1 + gf * (1 - beta1)
        mf.mul_(beta2).add_(gf, alpha=1 - beta2)
        bits = c > 0
        pad = (-bits.numel()) % 8
        if pad:
            bits = torch.cat([bits, bits.new_zeros(pad)])
        packed = (bits.view(-1, 8).to(torch.uint8) * pow2).sum(-1, dtype=torch.uint8)
        gathered = packed.unsqueeze(0)  # [n = 1, bytes]: what an all-gather would return
        unpacked = (gathered.unsqueeze(-1) & pow2) != 0  # [n, bytes, 8]
        votes = unpacked.view(gathered.shape[0], -1)[:, : x.numel()].to(torch.float32) * 2 - 1
        d = torch.sign(votes.sum(0))
        xf = x.view(-1)
        xf.mul_(1 - lr * wd).add_(d.to(x.dtype), alpha=-lr)


def lion_pytorch_triton():
    """``lion_pytorch.triton.update_fn``, or (None, reason)."""
    try:
        from lion_pytorch.triton import update_fn
    except (Exception, SystemExit) as e:  # noqa: BLE001 - it calls exit() without triton
        return None, f"skipped: lion_pytorch.triton not importable ({type(e).__name__}: {e})"
    return update_fn, None


# ----------------------------------------------------------------------------- setup


class Workload:
    """The tensors of one (shape, dtype): params, grads, fp32 momenta, and the packed buffers."""

    def __init__(self, shapes, dtype, device, gen):
        self.shapes = shapes
        self.numel = numel_of(shapes)
        self.params = [torch.randn(s, device=device, generator=gen).to(dtype) for s in shapes]
        self.grads = [torch.randn(s, device=device, generator=gen).to(dtype) for s in shapes]
        self.exp_avgs = [torch.randn(s, device=device, generator=gen) * 0.01 for s in shapes]
        self.offsets, self.blocks = block_offsets([math.prod(s) for s in shapes])
        i32 = dict(dtype=torch.int32, device=device)
        self.votes = torch.zeros(self.blocks, **i32)
        self.agg1 = torch.zeros(self.blocks, **i32)

        def rand_words(count):
            return torch.randint(-(2**31), 2**31 - 1, (count,), generator=gen, device=device,
                                 dtype=torch.int64).to(torch.int32)

        self.stacked = rand_words(N_TALLY * self.blocks).view(N_TALLY, self.blocks)
        p_bin = aggregate_planes("average", "binary", N_TALLY)
        p_ter = aggregate_planes("average", "ternary", N_TALLY)
        self.tally_out_vote = torch.zeros(self.blocks, **i32)
        self.tally_out_avg = torch.zeros(p_bin * self.blocks, **i32)
        # Aggregates holding valid counts (q <= n, q <= 2n), packed like layout.py says.
        self.agg_avg_bin = self._counts(N_TALLY, p_bin, gen, device)
        self.agg_avg_ter = self._counts(2 * N_TALLY, p_ter, gen, device)

    def _counts(self, top, planes, gen, device):
        """Random packed counts q in 0..top (top = 2**(planes-1) for n = 8): the top plane is
        random and the lower planes are random where it is clear, so q <= top everywhere."""
        if top != 1 << (planes - 1):
            raise ValueError(f"count generator needs top = 2**(planes-1), got {top}, {planes}")
        words = torch.randint(-(2**31), 2**31 - 1, (self.blocks, planes), generator=gen,
                              device=device, dtype=torch.int64).to(torch.int32)
        words[:, : planes - 1] &= ~words[:, planes - 1 :]
        return words.view(-1)

    def free(self):
        for name in list(vars(self)):
            setattr(self, name, None)


def stage_fns(be, w: Workload) -> dict:
    b1, b2 = BETAS
    step_counter = [0]

    def local_step():
        be.local_step(w.grads, w.exp_avgs, w.votes, w.offsets, b1, False)

    def tally_vote():
        be.tally(w.stacked, w.tally_out_vote, N_TALLY, "vote", False, 0)

    def tally_avg():
        be.tally(w.stacked, w.tally_out_avg, N_TALLY, "average", False, 0)

    def apply_vote():
        be.apply(w.params, w.grads, w.exp_avgs, w.votes, w.offsets, LR, WD, b2, 1, "vote", False)

    def apply_avg_bin():
        be.apply(w.params, w.grads, w.exp_avgs, w.agg_avg_bin, w.offsets, LR, WD, b2, N_TALLY,
                 "average", False)

    def apply_avg_ter():
        be.apply(w.params, w.grads, w.exp_avgs, w.agg_avg_ter, w.offsets, LR, WD, b2, N_TALLY,
                 "average", True)

    def step():
        step_counter[0] += 1
        be.local_step(w.grads, w.exp_avgs, w.votes, w.offsets, b1, False)
        be.tally(w.votes.view(1, -1), w.agg1, 1, "vote", False, step_counter[0])
        be.apply(w.params, w.grads, w.exp_avgs, w.agg1, w.offsets, LR, WD, b2, 1, "vote", False)

    return {"local_step": local_step, "tally vote n=8": tally_vote, "tally avg n=8": tally_avg,
            "apply vote": apply_vote, "apply avg/bin n=8": apply_avg_bin,
            "apply avg/ter n=8": apply_avg_ter, "step": step}


def graphed(fn, warmup: int = 3):
    """``fn`` captured in a CUDA graph after ``warmup`` calls on a side stream (which build the
    launch tables); returns the graph's replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph.replay


def kernel_seconds(fn, reps: int = 20) -> float:
    """Seconds per call of ``fn`` spent in device kernels (and copies): the sum of their
    durations, from torch's profiler, without the gaps between them."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total_us = 0.0
    for e in prof.key_averages():
        total_us += (getattr(e, "self_device_time_total", None)
                     or getattr(e, "self_cuda_time_total", 0) or 0)
    return total_us / 1e6 / reps


def graph_fns(name, be, w: Workload) -> dict:
    """The GPU rows of one backend at a ``--graph-sizes`` size: the three stages and the
    library's whole step, launched from Python and replayed from a CUDA graph. The step counter
    is an int64 tensor on the device, as a captured step needs."""
    import dlion_kernels as dk

    b1, b2 = BETAS
    counter = torch.zeros(1, dtype=torch.int64, device=w.votes.device)

    def stages():
        be.local_step(w.grads, w.exp_avgs, w.votes, w.offsets, b1, False)
        be.tally(w.votes.view(1, -1), w.agg1, 1, "vote", False, counter)
        be.apply(w.params, w.grads, w.exp_avgs, w.agg1, w.offsets, LR, WD, b2, 1, "vote", False)
        counter.add_(1)

    def whole():
        dk.fused_dlion_step(w.params, w.grads, w.exp_avgs, lr=LR, betas=BETAS, weight_decay=WD,
                            backend=name, step=counter, nonfinite="skip")

    return {"step kernels": stages, "step graph": graphed(stages),
            "fused_dlion_step kernels": whole, "fused_dlion_step": whole,
            "fused_dlion_step graph": graphed(whole)}


SHAPE_OPS = {  # tally does not depend on the tensor list: flat only
    "flat": ["local_step", "tally vote n=8", "tally avg n=8", "apply vote", "apply avg/bin n=8",
             "apply avg/ter n=8", "step"],
    "gpt2": ["local_step", "apply vote", "apply avg/bin n=8", "step"],
}


# ----------------------------------------------------------------------------- memory


def free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def needed_bytes(numel: int, dtype: torch.dtype) -> int:
    """Rough footprint of one workload: x, g, m, packed buffers, the copy buffers (as large as the
    largest row's bytes) and room for the torch reference's temporaries."""
    xs = dtype_bytes(dtype)
    base = numel * (2 * xs + 4 + 2.5)  # x, g, m, votes + stacked + aggregates
    copy = numel * bytes_per_elt("step", dtype)
    return int(base + copy + numel * 8)  # + one int64 temporary per element


# ----------------------------------------------------------------------------- run


def parse_list(text: str) -> list[str]:
    return [t.strip() for t in text.replace(" ", ",").split(",") if t.strip()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="cpu | cuda (default: cuda if visible)")
    ap.add_argument("--sizes", default=None,
                    help=f"flat sizes, suffixes k/M/G (default CPU {CPU_SIZES}, GPU {GPU_SIZES})")
    ap.add_argument("--dtypes", default="fp32,bf16", help="fp32,bf16[,fp16]")
    ap.add_argument("--backends", default=None, help="default: every one that can run here")
    ap.add_argument("--shapes", default="flat,gpt2", help="flat,gpt2")
    ap.add_argument("--peers", default="lion,foreach,unfused",
                    help="peers of the whole step: lion,foreach,unfused (or none)")
    ap.add_argument("--graph-sizes", default="1M",
                    help="GPU: flat sizes that also time the step replayed from a CUDA graph and "
                         "the library's whole step, launched and replayed (none: skip)")
    ap.add_argument("--gpt2-layers", type=int, default=12)
    ap.add_argument("--gpt2-scale", type=float, default=1.0,
                    help="shrink every GPT-2 dimension by this factor (148 tensors kept)")
    ap.add_argument("--min-reps", type=int, default=3)
    ap.add_argument("--max-reps", type=int, default=30)
    ap.add_argument("--slow-seconds", type=float, default=1.0,
                    help="CPU: a variant whose warm-up call takes longer is timed once more only")
    ap.add_argument("--rep-seconds", type=float, default=0.4,
                    help="CPU: keep repeating until this long is spent; GPU: do_bench rep")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny: 1M flat + GPT-2 at 1/8 scale, fp32, few reps (< 60 s)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--out", default=None,
                    help="results folder (default bench/results/bench_kernels-<timestamp>/)")
    args = ap.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device is visible to torch", file=sys.stderr)
        return 2
    on_gpu = device.type == "cuda"
    if args.smoke:
        args.sizes = args.sizes or "1M"
        args.dtypes = "fp32"
        args.gpt2_scale = min(args.gpt2_scale, 0.125)
        args.min_reps, args.max_reps, args.rep_seconds = 2, 5, 0.05
    sizes = [common.parse_count(s) for s in parse_list(args.sizes or
                                                       (GPU_SIZES if on_gpu else CPU_SIZES))]
    dtypes = [DTYPES[d] for d in parse_list(args.dtypes)]
    shapes = parse_list(args.shapes)
    peers = [] if args.peers == "none" else parse_list(args.peers)
    graph_sizes = set() if args.graph_sizes == "none" or not on_gpu else {
        common.parse_count(s) for s in parse_list(args.graph_sizes)}

    notes: list[str] = []
    wanted = parse_list(args.backends) if args.backends else (
        ["cuda", "triton", "torch"] if on_gpu else ["cpu", "torch"])
    names = []
    for name in wanted:
        if name == "triton" and not on_gpu:
            notes.append("triton: skipped on the CPU (only the TRITON_INTERPRET interpreter runs "
                         "there; it is not a timing target)")
            continue
        problem = dk_backends._problem(name, device.type)
        if problem is not None:
            notes.append(f"{name}: skipped ({problem})")
            continue
        names.append(name)
    impls = {}
    for name in names:
        try:
            impls[name] = dk_backends.get(name)
        except Exception as e:  # noqa: BLE001 - e.g. a backend module that fails to import
            notes.append(f"{name}: skipped ({type(e).__name__}: {e})")
    names = list(impls)

    lion_fn, lion_problem = (None, None)
    if "lion" in peers:
        if not on_gpu:
            lion_problem = "n/a (needs CUDA)"
        else:
            lion_fn, lion_problem = lion_pytorch_triton()
        notes.append(f"{PEER_LION}: {lion_problem}" if lion_problem else
                     f"{PEER_LION}: lion_pytorch.triton.update_fn, one launch per tensor")

    timer = Timer(device, args.min_reps, args.max_reps, args.rep_seconds, args.slow_seconds)
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    threads = torch.get_num_threads()
    out_dir = common.results_dir(NAME, args.out)
    meta = common.metadata({"device": str(device), "torch_threads": threads,
                            "cpu_avx2_clone_disabled": os.environ.get("DLION_CPU_NO_AVX2", "")})

    workloads = []
    for shape in shapes:
        if shape == "flat":
            workloads += [("flat", human(s), [(s,)]) for s in sizes]
        elif shape == "gpt2":
            label = "gpt2" if (args.gpt2_layers, args.gpt2_scale) == (12, 1.0) else \
                f"gpt2 L{args.gpt2_layers} x{args.gpt2_scale:g}"
            workloads.append(("gpt2", label, gpt2_shapes(args.gpt2_layers, args.gpt2_scale)))
        else:
            raise SystemExit(f"--shapes: unknown {shape!r} (flat, gpt2)")

    rows: list[dict] = []
    t_start = time.perf_counter()
    print(f"# bench_kernels on {device} ({meta['gpu'] if on_gpu else meta['cpu_model']}, "
          f"{threads} torch threads); backends {names}; peers {peers}")
    for n in notes:
        print(f"- {n}")
    for dtype in dtypes:
        dname = next(k for k, v in DTYPES.items() if v == dtype)
        for kind, label, shp in workloads:
            numel = numel_of(shp)
            need, have = needed_bytes(numel, dtype), free_bytes(device)
            if need > 0.8 * have:
                msg = (f"{kind} {label} {dname}: skipped, needs ~{common.human_bytes(need)}, "
                       f"{common.human_bytes(have)} free")
                print(f"- {msg}")
                notes.append(msg)
                continue
            w = Workload(shp, dtype, device, gen)
            copy_numel = math.ceil(numel * bytes_per_elt("step", dtype) / 2 / 4) + 1
            src = torch.randn(copy_numel, device=device, generator=gen)
            dst = torch.empty_like(src)
            copy_cache: dict[int, float] = {}

            def copy_fn(nbytes: float):
                k = max(1, math.ceil(nbytes / 2 / 4))  # fp32 elements read (and written)
                s, d = src[:k], dst[:k]
                return lambda: d.copy_(s)

            def timed(fn, nbytes: float, kernels_only=False) -> tuple[float, float]:
                """(kernel s, copy s): GPU do_bench each (copies cached per size), or with
                ``kernels_only`` the profiler's sum of the kernels; CPU interleaved."""
                if not on_gpu:
                    return timer.pair(fn, copy_fn(nbytes))
                t = kernel_seconds(fn) if kernels_only else timer(fn)
                k = max(1, math.ceil(nbytes / 2 / 4))
                if k not in copy_cache:
                    copy_cache[k] = timer(copy_fn(nbytes))
                return t, copy_cache[k]

            def record(op, impl, fn, kernels_only=False):
                bpe = bytes_per_elt(op, dtype)
                nbytes = bpe * numel
                row = {"shape": kind, "size": label, "numel": numel, "tensors": len(shp),
                       "dtype": dname, "op": op, "impl": impl, "bytes_per_elt": round(bpe, 4),
                       "bytes": int(nbytes)}
                try:
                    t, tc = timed(fn, nbytes, kernels_only)
                except Exception as e:  # noqa: BLE001 - OOM or a backend bug: say so, go on
                    if on_gpu:
                        torch.cuda.empty_cache()
                    row.update(ms=None, gbps=None, copy_gbps=None, of_copy=None,
                               note=f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
                    rows.append(row)
                    print(f"  {kind} {label} {dname} {op} {impl}: FAILED {row['note']}")
                    return
                reps = timer.last_reps
                row.update(reps=reps, ms=t * 1e3, gbps=nbytes / t / 1e9,
                           copy_gbps=nbytes / tc / 1e9, of_copy=tc / t, note="")
                rows.append(row)
                print(f"  {kind:4} {label:>6} {dname} {op:18} {impl:20} {t * 1e3:9.3f} ms "
                      f"{row['gbps']:7.1f} GB/s  {100 * row['of_copy']:5.0f}% of copy",
                      flush=True)

            for name, be in impls.items():
                fns = stage_fns(be, w)
                for op in SHAPE_OPS[kind]:
                    if op.startswith("tally") and dtype != dtypes[0]:
                        continue  # the tally reads and writes int32 words only: one dtype
                    record(op, name, fns[op])
                if kind == "flat" and numel in graph_sizes and name != "torch":
                    try:
                        graphs = graph_fns(name, be, w)
                    except Exception as e:  # noqa: BLE001 - a capture that fails: say so
                        msg = f"{name} {label} {dname}: no CUDA graph ({type(e).__name__}: {e})"
                        print(f"- {msg}")
                        notes.append(msg)
                    else:
                        for op, fn in graphs.items():
                            record(op, name, fn, kernels_only=op.endswith(" kernels"))
                        graphs = None
            b1, b2 = BETAS
            if "lion" in peers:
                if lion_fn is None:
                    rows.append({"shape": kind, "size": label, "numel": numel,
                                 "tensors": len(shp), "dtype": dname, "op": PEER_LION,
                                 "impl": PEER_LION, "note": lion_problem})
                else:
                    def lion_step():
                        for x, g, m in zip(w.params, w.grads, w.exp_avgs):
                            lion_fn(x, g, m, LR, WD, b1, b2)

                    record(PEER_LION, PEER_LION, lion_step)
            if "foreach" in peers:
                record(PEER_FOREACH, PEER_FOREACH,
                       lambda: foreach_lion(w.params, w.grads, w.exp_avgs, LR, WD, b1, b2))
            if "unfused" in peers:
                record(PEER_UNFUSED, PEER_UNFUSED,
                       lambda: unfused_dlion(w.params, w.grads, w.exp_avgs, LR, WD, b1, b2))
            w.free()
            src = dst = w = None  # freed before the next workload (closures above are done)
            if on_gpu:
                torch.cuda.empty_cache()

    elapsed = time.perf_counter() - t_start
    text = report(rows, device, names, dtypes)
    if notes:
        text += "Notes:\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    print()
    print(text)
    print(f"elapsed {elapsed:.0f} s")
    meta["elapsed_s"] = round(elapsed, 1)
    json_path, csv_path = common.save(out_dir, NAME, rows, meta, notes=notes)
    common.save_text(out_dir, f"{NAME}.md", text)
    png = None if args.no_plot else plot(rows, out_dir, device)
    print(f"saved {json_path}, {csv_path}, {os.path.join(out_dir, NAME + '.md')}"
          + (f", {png}" if png else " (no plot: matplotlib missing or --no-plot)"))
    return 0


def human(n: int) -> str:
    return common.human_count(n)


# ----------------------------------------------------------------------------- report


COLUMNS = [("op", "op"), ("impl", "impl"), ("size", "size"), ("bytes_per_elt", "B/elt", ".4g"),
           ("bytes", "bytes"), ("ms", "ms", ".3f"), ("gbps", "GB/s", ".1f"),
           ("copy_gbps", "copy GB/s", ".1f"), ("of_copy_pct", "of copy", ".0f"), ("reps", "reps"),
           ("note", "note")]


def report(rows, device, names, dtypes) -> str:
    shown = []
    for r in rows:
        r2 = dict(r)
        r2["bytes"] = common.human_bytes(r["bytes"]) if r.get("bytes") else None
        r2["of_copy_pct"] = None if r.get("of_copy") is None else 100 * r["of_copy"]
        if r2["of_copy_pct"] is not None:
            r2["of_copy_pct"] = f"{r2['of_copy_pct']:.0f}%"
        shown.append(r2)
    text = ""
    keys = []
    for r in shown:
        k = (r["shape"], r["dtype"])
        if k not in keys:
            keys.append(k)
    for shape, dname in keys:
        sel = [r for r in shown if (r["shape"], r["dtype"]) == (shape, dname)]
        sel.sort(key=lambda r: (order_of(r["op"]), r["impl"], r["numel"]))
        title = f"{shape} {'tensor' if shape == 'flat' else 'parameter list'}, {dname}"
        if shape == "gpt2" and sel:
            title += f" ({sel[0]['tensors']} tensors, {sel[0]['numel']:,} elements)"
        text += common.markdown_table(sel, COLUMNS, title) + "\n"
    text += targets(rows, device, names) + "\n"
    return text


def order_of(op: str) -> int:
    ops = SHAPE_OPS["flat"] + GRAPH_OPS + [PEER_LION, PEER_FOREACH, PEER_UNFUSED]
    return ops.index(op) if op in ops else len(ops)


def find(rows, **kw):
    return [r for r in rows if all(r.get(k) == v for k, v in kw.items())]


def targets(rows, device, names) -> str:
    lines = ["### Targets", ""]
    bw_ops = ["local_step", "apply vote", "apply avg/bin n=8", "apply avg/ter n=8"]

    def verdict(ok):
        return "PASS" if ok else "FAIL"

    if device.type == "cpu":
        size16 = 16 << 20
        for op in bw_ops:
            hits = find(rows, shape="flat", impl="cpu", dtype="fp32", op=op, numel=size16)
            if not hits or hits[0].get("of_copy") is None:
                lines.append(f"- cpu {op} >= {CPU_TARGET:.0%} of copy at 16M fp32: not measured "
                             "(size/dtype/backend not in this run)")
                continue
            r = hits[0]
            lines.append(f"- cpu {op} >= {CPU_TARGET:.0%} of copy at 16M fp32: "
                         f"**{verdict(r['of_copy'] >= CPU_TARGET)}** ({r['of_copy']:.0%}: "
                         f"{r['gbps']:.1f} GB/s vs copy {r['copy_gbps']:.1f} GB/s)")
        lines.append("- whole D-Lion step vs lion-pytorch Triton Lion (flat: no slower; GPT-2 "
                     "list: >= 3x faster): not measured (no GPU)")
        return "\n".join(lines) + "\n"

    for name in [b for b in ("cuda", "triton") if b in names]:
        for op in bw_ops:
            hits = [r for r in find(rows, shape="flat", impl=name, op=op)
                    if r["numel"] >= (64 << 20) and r.get("of_copy") is not None]
            if not hits:
                lines.append(f"- {name} {op} >= {GPU_TARGET:.0%} of copy at 64M+: not measured")
                continue
            worst = min(hits, key=lambda r: r["of_copy"])
            detail = ", ".join(f"{r['size']} {r['dtype']} {r['of_copy']:.0%}" for r in hits)
            lines.append(f"- {name} {op} >= {GPU_TARGET:.0%} of copy at 64M+: "
                         f"**{verdict(worst['of_copy'] >= GPU_TARGET)}** ({detail})")
        step_targets = (("flat", 1.0, "no slower than"),
                        ("gpt2", GPT2_SPEEDUP, f">= {GPT2_SPEEDUP:g}x faster than"))
        for shape, need, what in step_targets:
            pairs = []
            for r in find(rows, shape=shape, impl=name, op="step"):
                peer = find(rows, shape=shape, impl=PEER_LION, size=r["size"], dtype=r["dtype"])
                if r.get("ms") and peer and peer[0].get("ms"):
                    pairs.append((r, peer[0]["ms"] / r["ms"], peer[0]["ms"]))
            if not pairs:
                lines.append(f"- {name} step {what} lion-pytorch Triton ({shape}): not measured "
                             "(lion_pytorch missing or the step failed)")
                continue
            ok = all(sp >= need for _, sp, _ in pairs)
            detail = ", ".join(f"{r['size']} {r['dtype']}: {r['ms']:.3f} vs {pm:.3f} ms = "
                               f"{sp:.2f}x" for r, sp, pm in pairs)
            lines.append(f"- {name} step {what} lion-pytorch Triton ({shape}): "
                         f"**{verdict(ok)}** ({detail})")
        for graph_op, kernels_op in (("step graph", "step kernels"),
                                     ("fused_dlion_step graph", "fused_dlion_step kernels")):
            for r in find(rows, shape="flat", impl=name, op=graph_op):
                kernels = find(rows, shape="flat", impl=name, op=kernels_op, size=r["size"],
                               dtype=r["dtype"])
                if not (r.get("ms") and kernels and kernels[0].get("ms")):
                    continue
                launched = find(rows, shape="flat", impl=name,
                                op=graph_op.replace(" graph", ""), size=r["size"],
                                dtype=r["dtype"])
                ratio = r["ms"] / kernels[0]["ms"]
                extra = (f"; launched from Python {launched[0]['ms']:.3f} ms" if launched and
                         launched[0].get("ms") else "")
                lines.append(f"- {name} {graph_op} within {GRAPH_TARGET:g}x its kernels' time "
                             f"({r['size']} {r['dtype']}): "
                             f"**{verdict(ratio <= GRAPH_TARGET)}** ({r['ms']:.3f} ms vs "
                             f"{kernels[0]['ms']:.3f} ms of kernels = {ratio:.2f}x{extra})")
    return "\n".join(lines) + "\n"


def plot(rows, out_dir, device):
    """GB/s vs flat size, one panel per op, one line per implementation and dtype."""
    plt = common.pyplot()
    if plt is None:
        return None
    flat = [r for r in rows if r["shape"] == "flat" and r.get("gbps")]
    if not flat:
        return None
    ops = [op for op in SHAPE_OPS["flat"] + [PEER_LION, PEER_FOREACH, PEER_UNFUSED]
           if any(r["op"] == op for r in flat)]
    step_panel = [PEER_LION, PEER_FOREACH, PEER_UNFUSED]
    panels = [op for op in ops if op not in step_panel]
    cols = min(4, len(panels))
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False)
    for ax, op in zip(axes.flat, panels):
        members = [op] + (step_panel if op == "step" else [])
        series = {}
        for r in flat:
            if r["op"] in members:
                series.setdefault((r["impl"], r["dtype"]), []).append(r)
        for (impl, dname), rs in sorted(series.items()):
            rs.sort(key=lambda r: r["numel"])
            ax.plot([r["numel"] for r in rs], [r["gbps"] for r in rs], marker="o",
                    label=f"{impl} {dname}")
        copies = sorted({(r["numel"], r["copy_gbps"]) for r in flat if r["op"] == op
                         and r["dtype"] == "fp32"})
        if copies:
            ax.plot([c[0] for c in copies], [c[1] for c in copies], "k--", marker="x",
                    label="copy, same bytes (fp32)")
        ax.set_xscale("log", base=2)
        ax.set_title(op if op != "step" else "step (with peers)")
        ax.set_xlabel("elements")
        ax.set_ylabel("GB/s")
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"bench_kernels on {device}")
    return common.save_figure(fig, out_dir, NAME)


if __name__ == "__main__":
    sys.exit(main())
