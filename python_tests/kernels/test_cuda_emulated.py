"""The CUDA kernels run on the CPU, against the reference, in every CI run.

``csrc/cuda/ops.cu`` (with ``kernels.cuh``) and ``csrc/cuda/accum_kernels.cu`` are compiled as host
C++ with g++ against ``csrc/emu/cuda_emu.h``, an emulation of the CUDA builtins they use: one host
thread per CUDA thread, a 32-lane barrier per warp for the shuffles, a block barrier for
``__syncthreads``, checked vector alignment, own bf16/fp16 types. The only change to the sources
is the launch syntax (``k<<<g, b, s, st>>>(args)`` becomes an operator call, ``_rewrite``), so the
launchers' dispatch runs as written. The library is reached through ``native.py``'s and
``accum_native.py``'s own CUDA code paths (tables, argument order, skip flag), with host tensors
standing in for device memory, so that a table or argument bug shows up too.

Results must equal the reference bit for bit: votes and tallies by the layout contract, floats
because every backend does the same fp32 operations in the same order with one rounding each.
Every tensor lives inside a larger buffer whose margins are checked after each launch (no write
out of bounds). The library is cached in the temp directory under a hash of its sources.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections import OrderedDict

import pytest
import torch

from dlion_kernels.kernels import accum_native, accum_reference, native, reference
from dlion_kernels.kernels.layout import aggregate_planes, block_offsets

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CSRC = os.path.join(ROOT, "csrc")
KERNEL_SOURCES = ["cuda/ops.cu", "cuda/accum_kernels.cu"]  # rewritten launches
FLAGS = ["-std=c++17", "-O1", "-fPIC", "-pthread", "-ffp-contract=off", "-fno-strict-aliasing",
         "-Wall", "-Wno-unknown-pragmas"]
SIZES = [1, 31, 33, 4097]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_LAUNCH = re.compile(r"<<<(.*?)>>>(\s*)\(", re.DOTALL)


# ------------------------------------------------------------------------------------------------
# building the emulated library


def _rewrite(text: str) -> str:
    """``k<<<grid, block, shared, stream>>>(args)`` -> ``k ^ ::emu::Config(grid, block, shared,
    stream) ^ ::emu::Args(args)`` (cuda_emu.h); same lines, so messages point into the source."""
    return _LAUNCH.sub(lambda m: f" ^ ::emu::Config({m.group(1)}) ^ ::emu::Args{m.group(2)}(",
                       text)


def _emulation_library() -> str:
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler (g++) to build the CUDA emulation")
    digest = hashlib.sha256(" ".join(FLAGS).encode())
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False)
    digest.update(version.stdout.encode())
    for dirpath, _, files in sorted(os.walk(CSRC)):
        for name in sorted(files):
            with open(os.path.join(dirpath, name), "rb") as f:
                digest.update(name.encode() + f.read())
    cache = os.path.join(tempfile.gettempdir(), "dlion-cuda-emu", digest.hexdigest()[:16])
    lib = os.path.join(cache, "libdlion_cuda_emu.so")
    if os.path.exists(lib):
        return lib
    os.makedirs(cache, exist_ok=True)
    work = tempfile.mkdtemp(dir=cache)
    sources = []
    for rel in KERNEL_SOURCES:
        path = os.path.join(CSRC, rel)
        with open(path) as f:
            original = f.read()
        text = _rewrite(original)
        assert "<<<" in original and "<<<" not in text, f"launches of {rel} not rewritten"
        dst = os.path.join(work, os.path.basename(rel) + ".cpp")
        with open(dst, "w") as f:
            f.write(f'#line 1 "{path}"\n{text}')
        sources.append(dst)
    sources.append(os.path.join(CSRC, "emu", "emu_api.cpp"))
    includes = ["-I", os.path.join(CSRC, "emu"), "-I", CSRC]  # emu first: its cuda_*.h
    procs, objects = [], []
    for src in sources:
        obj = os.path.join(work, os.path.basename(src) + ".o")
        objects.append(obj)
        procs.append(subprocess.Popen([cxx, *FLAGS, *includes, "-c", src, "-o", obj],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [(p.communicate()[0], p.returncode) for p in procs]
    failed = [log for log, rc in logs if rc != 0]
    assert not failed, "the emulated CUDA build failed:\n" + "\n".join(failed)[-6000:]
    tmp_lib = os.path.join(work, "lib.so")
    subprocess.run([cxx, "-shared", "-pthread", "-o", tmp_lib, *objects], check=True)
    os.replace(tmp_lib, lib)  # atomic: a concurrent run sees the whole library or none
    shutil.rmtree(work, ignore_errors=True)
    return lib


class EmulatedError(RuntimeError):
    pass


class EmuC:
    """The CUDA half of ``_C``'s interface (bindings.cpp) on the emulated library."""

    def __init__(self, path: str):
        lib = ctypes.CDLL(path)
        i64, i32, f32, u32 = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_uint32
        err = [ctypes.c_char_p, ctypes.c_size_t]
        lib.emu_cuda_local_step.argtypes = [i64, i64, i64, i32, i64, f32, f32, i32, i32, i64, *err]
        lib.emu_cuda_tally.argtypes = [i64, i64, i64, i64, i64, i32, i32, u32, i64, i32, i64,
                                       *err]
        lib.emu_cuda_apply.argtypes = [i64, i64, i64, i32, i32, i64, f32, f32, f32, f32, i64, i32,
                                       i32, i64, i32, i64, *err]
        fs = ctypes.POINTER(ctypes.c_float)
        lib.emu_cuda_accum_adamw.argtypes = [i64, i64, i64, i32, fs, i32, i32, i32, i64, *err]
        lib.emu_cuda_accum_lion.argtypes = [i64, i64, i64, i32, fs, i32, i32, i32, i64, *err]
        lib.emu_selftest.argtypes = [i32, ctypes.c_void_p, ctypes.c_void_p, *err]
        lib.emu_set_max_grid.argtypes = [ctypes.c_uint]
        lib.emu_set_os_threads.argtypes = [ctypes.c_int]
        lib.emu_cuda_chunk_elems.restype = i64
        lib.emu_cuda_accum_chunk_elems.restype = i64
        for name in ("emu_f32_to_bf16", "emu_f32_to_f16", "emu_f16_to_f32", "emu_bf16_to_f32"):
            getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_void_p, i64]
        self.lib = lib

    def _call(self, fn, *args):
        buf = ctypes.create_string_buffer(4096)
        code = fn(*args, buf, len(buf))
        if code == 2:
            raise ValueError(buf.value.decode())
        if code != 0:
            raise EmulatedError(buf.value.decode())

    # the names and argument order of bindings.cpp
    def cuda_chunk_elems(self):
        return self.lib.emu_cuda_chunk_elems()

    def cuda_accum_chunk_elems(self):
        return self.lib.emu_cuda_accum_chunk_elems()

    def cuda_local_step(self, *args):
        self._call(self.lib.emu_cuda_local_step, *args)

    def cuda_tally(self, *args):
        self._call(self.lib.emu_cuda_tally, *args)

    def cuda_apply(self, *args):
        self._call(self.lib.emu_cuda_apply, *args)

    def cuda_accum_adamw(self, table, count, chunks, code, *rest):
        scalars, (k1, flush, device, stream) = rest[:9], rest[9:]
        self._call(self.lib.emu_cuda_accum_adamw, table, count, chunks, code,
                   (ctypes.c_float * 9)(*scalars), k1, flush, device, stream)

    def cuda_accum_lion(self, table, count, chunks, code, *rest):
        scalars, (k1, flush, device, stream) = rest[:7], rest[7:]
        self._call(self.lib.emu_cuda_accum_lion, table, count, chunks, code,
                   (ctypes.c_float * 7)(*scalars), k1, flush, device, stream)

    def selftest(self, which, inp=None, out=None):
        def ptr(t):
            return None if t is None else t.data_ptr()

        self._call(self.lib.emu_selftest, which, ptr(inp), ptr(out))


class EmuBackend(native._NativeBackend):
    """native.py's 'cuda' backend (tables, launches, skip flag) on host memory: device 0, the
    default stream; no record_stream (the launches are synchronous)."""

    def __init__(self, emu: EmuC):
        self._C = emu
        self.cuda = True
        self._chunk = emu.cuda_chunk_elems()
        self._tables = OrderedDict()

    def _device_args(self, t):
        assert t.device.type == "cpu"
        return 0, 0

    def _in_use(self, table):
        return table.address


class EmuAccum(accum_native._AccumBackend):
    def __init__(self, emu: EmuC):
        self._C = emu
        self.cuda = True
        self._chunk = emu.cuda_accum_chunk_elems()
        self._tables = OrderedDict()

    def _device(self, x):
        assert x.device.type == "cpu"
        return 0, 0


@pytest.fixture(scope="module")
def emu():
    return EmuC(_emulation_library())


# ------------------------------------------------------------------------------------------------
# guarded tensors and comparisons

GUARD = 64  # elements of margin on each side (keeps 16-byte alignment for every dtype)


class Arena:
    """Tensors placed inside larger random buffers; ``check()`` asserts that no launch wrote
    into the margins. ``shift`` elements move a tensor off its 16-byte alignment."""

    def __init__(self, gen: torch.Generator):
        self.gen = gen
        self.items = []

    def put(self, values: torch.Tensor, shift: int = 0) -> torch.Tensor:
        n = values.numel()
        buf = _random_words(GUARD + shift + n + GUARD, values.dtype, self.gen)
        view = buf[GUARD + shift : GUARD + shift + n]
        view.copy_(values.reshape(-1))
        self.items.append((buf, GUARD + shift, n, _bits(buf).clone()))
        return view.view(values.shape)

    def check(self):
        for buf, start, n, snapshot in self.items:
            bits = _bits(buf)
            assert torch.equal(bits[:start], snapshot[:start]), "written before a tensor"
            assert torch.equal(bits[start + n :], snapshot[start + n :]), "written after a tensor"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


def _random_words(n: int, dtype, gen) -> torch.Tensor:
    if dtype == torch.int64:
        return torch.randint(-(2**62), 2**62, (n,), generator=gen, dtype=torch.int64)
    if dtype == torch.int32:
        return torch.randint(-(2**31), 2**31, (n,), generator=gen, dtype=torch.int64).to(dtype)
    return torch.randn(n, generator=gen).to(dtype)


def _values(n: int, dtype, gen, specials=True) -> torch.Tensor:
    """Random values with zeros, -0, tiny and huge ones mixed in (c = 0, signs of subnormals)."""
    v = torch.randn(n, generator=gen)
    if specials and n > 8:
        v[1], v[3], v[5], v[7] = 0.0, -0.0, 1e-30, -3e4
    return v.to(dtype)


def assert_same(actual: torch.Tensor, expected: torch.Tensor, what: str):
    """Bit for bit (-0 too), except that any NaN equals any NaN (payloads differ by library)."""
    assert actual.dtype == expected.dtype, what
    nan = actual.float().isnan()
    assert torch.equal(nan, expected.float().isnan()), f"{what}: NaN at other places"
    bad = (_bits(actual) != _bits(expected)) & ~nan
    if bad.any():
        i = int(bad.reshape(-1).nonzero()[0])
        a, e = actual.reshape(-1)[i].item(), expected.reshape(-1)[i].item()
        raise AssertionError(f"{what}: {int(bad.sum())} elements differ, first at {i}: {a!r} != "
                             f"{e!r}")


# ------------------------------------------------------------------------------------------------
# the emulation itself


def test_emulated_warp_calls_and_block_barrier(emu):
    out = torch.full((2 * 64 * 7,), -1, dtype=torch.int32)
    emu.selftest(0, None, out)
    got = out.view(2, 64, 7)
    for b in range(2):
        v = [1000 * b + t for t in range(64)]
        for t in range(64):
            lane, w = t % 32, t - t % 32
            ballot = sum(1 << ln for ln in range(32) if ln % 3 == 0 or w + ln == 40)
            expected = [v[w + (lane ^ 1)], v[w + (lane ^ 18)], v[w + 7],
                        v[t + 3] if lane + 3 < 32 else v[t], v[t - 5] if lane >= 5 else v[t],
                        ballot - (1 << 32 if ballot >= 1 << 31 else 0), 1 + 2]
            assert got[b, t].tolist() == expected, (b, t)
    inp = torch.randint(-1000, 1000, (3 * 256,), dtype=torch.int32)
    out = torch.zeros(3 * 256, dtype=torch.int32)
    emu.selftest(1, inp, out)
    assert torch.equal(out.view(3, 256), inp.view(3, 256).flip(1))


@pytest.mark.parametrize("which, reason", [
    (2, "exited while the others wait at __syncthreads"),
    (3, "exited while the others wait at a warp call"),
    (4, "full mask"),
    (5, "misaligned float4 access"),
    (6, "deadlock"),
    (7, "different warp calls"),
])
def test_emulation_faults_what_the_hardware_leaves_undefined(emu, which, reason):
    inp = torch.zeros(1040)
    out = torch.zeros(256, dtype=torch.int32)
    with pytest.raises(EmulatedError, match=reason):
        emu.selftest(which, inp, out)
    emu.selftest(1, torch.arange(768, dtype=torch.int32), torch.zeros(768, dtype=torch.int32))


def test_emulated_bf16_fp16_conversions_match_torch(emu):
    lib = emu.lib
    halves = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    for dtype, fn in ((torch.float16, lib.emu_f16_to_f32), (torch.bfloat16, lib.emu_bf16_to_f32)):
        out = torch.empty(halves.numel())
        fn(halves.data_ptr(), out.data_ptr(), halves.numel())
        assert_same(out, halves.view(dtype).float(), f"{dtype} -> fp32")
    gen = torch.Generator().manual_seed(3)
    bits = torch.randint(-(2**31), 2**31, (1 << 18,), generator=gen, dtype=torch.int64)
    edges = torch.tensor([65504.0, 65519.99, 65520.0, 2.0**-24, 2.0**-25, 2.0**-25 * 1.0001,
                          2.0**-14, 2.0**-14 * (1 - 2.0**-12), 3 * 2.0**-26, 1.0 + 2.0**-11,
                          1.0 + 3 * 2.0**-11, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 3.4e38, 1e-40,
                          float("inf")])
    floats = torch.cat([bits.to(torch.int32).view(torch.float32), torch.randn(1 << 16) * 1e4,
                        torch.randn(1 << 16) * 1e-6, edges, -edges])
    for dtype, fn in ((torch.float16, lib.emu_f32_to_f16), (torch.bfloat16, lib.emu_f32_to_bf16)):
        out = torch.empty(floats.numel(), dtype=torch.int16)
        fn(floats.data_ptr(), out.data_ptr(), floats.numel())
        assert_same(out.view(dtype), floats.to(dtype), f"fp32 -> {dtype}")


# ------------------------------------------------------------------------------------------------
# the D-Lion stages


def _stage_lists(arena, gen, x_dtype, g_dtype, with_none=True):
    """Parameters, gradients and momenta of SIZES plus misaligned ones (x, g and m each off by
    1, 2 and 3 elements, across several warps and passes, and in tensors shorter than a group),
    and a tensor without gradient."""
    misaligned = [(4097, "x", 1), (5000, "x", 2), (130, "x", 3), (2, "x", 3),
                  (33, "g", 1), (4099, "g", 3), (3, "g", 2),
                  (100, "m", 1), (4096, "m", 2), (7, "m", 3)]
    sizes = SIZES + [n for n, _, _ in misaligned] + ([31] if with_none else [])
    shifts = {len(SIZES) + k: (which, shift) for k, (_, which, shift) in enumerate(misaligned)}
    xs, gs, ms = [], [], []
    for i, n in enumerate(sizes):
        which, shift = shifts.get(i, (None, 0))
        xs.append(arena.put(_values(n, x_dtype, gen), shift if which == "x" else 0))
        gs.append(arena.put(_values(n, g_dtype, gen), shift if which == "g" else 0))
        ms.append(arena.put(_values(n, torch.float32, gen), shift if which == "m" else 0))
    if with_none:
        gs[-1] = None
    return sizes, xs, gs, ms


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ternary", [False, True], ids=["binary", "ternary"])
def test_local_step(emu, dtype, ternary):
    gen = torch.Generator().manual_seed(11)
    arena = Arena(gen)
    kernels = EmuBackend(emu)
    sizes, _, gs, ms = _stage_lists(arena, gen, dtype, dtype)
    gs[2][9] = float("nan")  # a NaN gradient votes -1 (binary) or abstains (ternary)
    ms[2][9] = 0.0
    offsets, total = block_offsets(sizes)
    planes = 2 if ternary else 1
    m_before = [m.clone() for m in ms]
    for beta1 in (0.9, 0.0):
        expected = torch.zeros(total * planes, dtype=torch.int32)
        reference.local_step(gs, ms, expected, offsets, beta1, ternary)
        votes = arena.put(torch.full((total * planes,), -1, dtype=torch.int32))
        kernels.local_step(gs, ms, votes, offsets, beta1, ternary)
        assert torch.equal(votes, expected), f"beta1={beta1}"
        arena.check()
    for m, m0 in zip(ms, m_before):
        assert torch.equal(_bits(m), _bits(m0)), "local_step wrote the momentum"


@pytest.mark.parametrize("ternary", [False, True], ids=["binary", "ternary"])
@pytest.mark.parametrize("mode", ["vote", "average"])
def test_tally(emu, mode, ternary):
    """n = 1..17 (every bit-sliced counter width up to 6 planes, the 8-row adder from n = 8) and
    n = 300 (the 16-plane counters), both tie patterns; 600 blocks over 3 CTAs, and over one
    CTA that walks 3 tiles (a clamped grid: the loop and its shared-memory reuse)."""
    _check_tally(emu, mode, ternary, [*range(1, 18), 300])


def _check_tally(emu, mode, ternary, ns):
    gen = torch.Generator().manual_seed(5)
    kernels = EmuBackend(emu)
    p_in = 2 if ternary else 1
    for n in ns:
        for blocks, max_grid in ((600, 0), (600, 1), (37, 0)) if n in (5, 17) else ((600, 0),):
            arena = Arena(gen)
            stacked = arena.put(_random_words(n * blocks * p_in, torch.int32, gen))
            if n == 300:  # mostly agreeing votes, so that counts reach the top planes
                stacked[: n * blocks * p_in // 2] = -1
            p_out = aggregate_planes(mode, "ternary" if ternary else "binary", n)
            steps = (0, 1, 6, 7) if mode == "vote" and not ternary else (0,)
            for step in steps:
                expected = torch.zeros(p_out * blocks, dtype=torch.int32)
                reference.tally(stacked, expected, n, mode, ternary, step % 2)
                out = arena.put(torch.full((p_out * blocks,), 7, dtype=torch.int32))
                # steps 6 and 7: the step counter read by the kernel (a captured step)
                counter = arena.put(torch.tensor([step], dtype=torch.int64)) if step > 1 else None
                emu.lib.emu_set_max_grid(max_grid)
                try:
                    kernels.tally(stacked, out, n, mode, ternary,
                                  step if counter is None else counter)
                finally:
                    emu.lib.emu_set_max_grid(0)
                assert torch.equal(out, expected), f"n={n} blocks={blocks} grid<={max_grid} " \
                    f"step {step}"
                arena.check()


PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
         (torch.bfloat16, torch.float32), (torch.float16, torch.float16),
         (torch.float16, torch.float32)]


@pytest.mark.parametrize("x_dtype, g_dtype", PAIRS, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("ternary", [False, True], ids=["binary", "ternary"])
@pytest.mark.parametrize("mode", ["vote", "average"])
def test_apply(emu, x_dtype, g_dtype, mode, ternary):
    """x and m after apply equal the reference's bit for bit, for n = 1, 2, 3, 16, 17 (average:
    1 to 6 planes), two steps each; a set skip flag leaves everything untouched."""
    gen = torch.Generator().manual_seed(7)
    kernels = EmuBackend(emu)
    votes = "ternary" if ternary else "binary"
    for n in (1, 2, 3, 16, 17) if mode == "average" else (1, 2):
        arena = Arena(gen)
        sizes, xs, gs, ms = _stage_lists(arena, gen, x_dtype, g_dtype)
        offsets, total = block_offsets(sizes)
        ex, em = [x.clone() for x in xs], [m.clone() for m in ms]
        planes = aggregate_planes(mode, votes, n)
        for step, (lr, wd, beta2) in enumerate(((1e-2, 0.1, 0.99), (3e-3, 0.0, 0.9))):
            agg = arena.put(_random_words(total * planes, torch.int32, gen))
            skip = arena.put(torch.tensor([0], dtype=torch.int32))
            reference.apply(ex, gs, em, agg, offsets, lr, wd, beta2, n, mode, ternary)
            kernels.apply(xs, gs, ms, agg, offsets, lr, wd, beta2, n, mode, ternary, skip=skip)
            for i, (a, e) in enumerate(zip(xs, ex)):
                assert_same(a, e, f"n={n} step {step} params[{i}] ({sizes[i]})")
            for i, (a, e) in enumerate(zip(ms, em)):
                assert_same(a, e, f"n={n} step {step} exp_avgs[{i}] ({sizes[i]})")
            arena.check()
        skip = torch.tensor([1], dtype=torch.int32)
        before = [_bits(t).clone() for t in xs + ms]
        kernels.apply(xs, gs, ms, agg, offsets, 1e-2, 0.1, 0.99, n, mode, ternary, skip=skip)
        assert all(torch.equal(_bits(t), b) for t, b in zip(xs + ms, before)), "skip=1 wrote"


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("ternary", [False, True], ids=["binary", "ternary"])
def test_apply_average_plane_counts(emu, x_dtype, ternary):
    """The average apply's two decodes: up to 8 planes from words the warp loads once and a
    table of D in shared memory, above 8 per thread; n on both sides of 8 planes (binary 255 /
    256, ternary 127 / 128). Whole chunks take the plain vector loads (a 4096-element tensor, and
    one without gradient, which takes the checked loads), the rest the checked ones."""
    gen = torch.Generator().manual_seed(17)
    kernels = EmuBackend(emu)
    votes = "ternary" if ternary else "binary"
    sizes = [4096, 4096, 4097, 33, 5]
    for n in (127, 128) if ternary else (255, 256):
        arena = Arena(gen)
        xs = [arena.put(_values(k, x_dtype, gen), 1 if k == 33 else 0) for k in sizes]
        gs = [arena.put(_values(k, x_dtype, gen)) for k in sizes]
        gs[1] = None
        ms = [arena.put(_values(k, torch.float32, gen)) for k in sizes]
        offsets, total = block_offsets(sizes)
        planes = aggregate_planes("average", votes, n)
        agg = arena.put(_random_words(total * planes, torch.int32, gen))
        ex, em = [x.clone() for x in xs], [m.clone() for m in ms]
        reference.apply(ex, gs, em, agg, offsets, 1e-2, 0.1, 0.99, n, "average", ternary)
        kernels.apply(xs, gs, ms, agg, offsets, 1e-2, 0.1, 0.99, n, "average", ternary)
        for i, (a, e) in enumerate(zip(xs + ms, ex + em)):
            assert_same(a, e, f"n={n} ({planes} planes) tensor {i}")
        arena.check()


@pytest.mark.parametrize("x_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode, ternary", [("vote", False), ("vote", True), ("average", False),
                                           ("average", True)])
def test_apply_without_momentum(emu, x_dtype, mode, ternary):
    """exp_avgs=None (null table entries b and c): x equals the reference's bit for bit and no
    momentum is read or written (the arena checks every byte outside the tensors); with None
    entries, the given momenta equal the reference's. n = 3."""
    gen = torch.Generator().manual_seed(13)
    kernels = EmuBackend(emu)
    votes, n = ("ternary" if ternary else "binary"), 3
    arena = Arena(gen)
    sizes, xs, gs, ms = _stage_lists(arena, gen, x_dtype, x_dtype)
    offsets, total = block_offsets(sizes)
    planes = aggregate_planes(mode, votes, n)
    agg = arena.put(_random_words(total * planes, torch.int32, gen))
    ex, em = [x.clone() for x in xs], [m.clone() for m in ms]
    reference.apply(ex, gs, em, agg, offsets, 1e-2, 0.1, 0.99, n, mode, ternary)
    del em
    m_before = [_bits(m).clone() for m in ms]
    kernels.apply(xs, None, None, agg, offsets, 1e-2, 0.1, 0.99, n, mode, ternary)
    for i, (a, e) in enumerate(zip(xs, ex)):
        assert_same(a, e, f"params[{i}] ({sizes[i]})")
    assert all(torch.equal(_bits(m), b) for m, b in zip(ms, m_before)), "a momentum was written"
    arena.check()
    ex2, em2 = [x.clone() for x in xs], [m.clone() for m in ms]
    keep = [i % 2 == 1 for i in range(len(sizes))]
    part = [m if k else None for m, k in zip(ms, keep)]
    reference.apply(ex2, gs, em2, agg, offsets, 1e-2, 0.1, 0.99, n, mode, ternary)
    kernels.apply(xs, gs, part, agg, offsets, 1e-2, 0.1, 0.99, n, mode, ternary)
    for i, (a, e) in enumerate(zip(xs, ex2)):
        assert_same(a, e, f"params[{i}] ({sizes[i]}), second apply")
    for i, k in enumerate(keep):
        if k:
            assert_same(ms[i], em2[i], f"exp_avgs[{i}]")
        else:  # never given to a kernel: still as it was
            assert torch.equal(_bits(ms[i]), m_before[i]), f"exp_avgs[{i}] was written"
    arena.check()


@pytest.mark.parametrize("mode, ternary, n", [("vote", False, 4), ("average", True, 3),
                                              ("vote", True, 17), ("average", False, 17)])
def test_whole_steps(emu, mode, ternary, n):
    """Six steps of local_step -> tally of n voters -> apply, bf16 parameters with fp32 and bf16
    gradients, chained on the emulated kernels and on the reference: the states never drift."""
    gen = torch.Generator().manual_seed(n)
    kernels = EmuBackend(emu)
    arena = Arena(gen)
    sizes, xs, gs, ms = _stage_lists(arena, gen, torch.bfloat16, torch.bfloat16)
    offsets, total = block_offsets(sizes)
    ex, em = [x.clone() for x in xs], [m.clone() for m in ms]
    p_in = 2 if ternary else 1
    p_out = aggregate_planes(mode, "ternary" if ternary else "binary", n)
    for step in range(6):
        grads = [None if g is None else arena.put(_values(g.numel(), g.dtype, gen, False))
                 for g in gs]
        if step % 2:  # fp32 gradients (node means) with bf16 parameters
            grads = [None if g is None else arena.put(g.float()) for g in grads]
        votes = arena.put(torch.zeros(total * p_in, dtype=torch.int32))
        ref_votes = torch.zeros_like(votes)
        kernels.local_step(grads, ms, votes, offsets, 0.9, ternary)
        reference.local_step(grads, em, ref_votes, offsets, 0.9, ternary)
        assert torch.equal(votes, ref_votes), f"step {step}"
        others = _random_words((n - 1) * total * p_in, torch.int32, gen)
        stacked = arena.put(torch.cat([votes, others]))
        agg = arena.put(torch.zeros(total * p_out, dtype=torch.int32))
        ref_agg = torch.zeros_like(agg)
        kernels.tally(stacked, agg, n, mode, ternary, step)
        reference.tally(stacked, ref_agg, n, mode, ternary, step)
        assert torch.equal(agg, ref_agg), f"step {step}"
        kernels.apply(xs, grads, ms, agg, offsets, 1e-2, 0.1, 0.99, n, mode, ternary)
        reference.apply(ex, grads, em, ref_agg, offsets, 1e-2, 0.1, 0.99, n, mode, ternary)
        for i, (a, e) in enumerate(zip(xs + ms, ex + em)):
            assert_same(a, e, f"step {step} tensor {i}")
        arena.check()


def test_with_os_threads(emu):
    """Every CUDA thread an OS thread (truly concurrent, so that a missing barrier around shared
    memory can show): the warp calls and block barrier, their faults, and the average tally
    (shared-memory staging, 3 tiles on one CTA)."""
    emu.lib.emu_set_os_threads(1)
    try:
        test_emulated_warp_calls_and_block_barrier(emu)
        for which, reason in ((2, "__syncthreads"), (3, "warp call"), (6, "deadlock")):
            with pytest.raises(EmulatedError, match=reason):
                emu.selftest(which, torch.zeros(1040), torch.zeros(256, dtype=torch.int32))
        _check_tally(emu, "average", True, [5])
    finally:
        emu.lib.emu_set_os_threads(0)


def test_n_limit_raises_before_launch(emu):
    kernels = EmuBackend(emu)
    stacked = torch.zeros(32768, dtype=torch.int32)
    with pytest.raises(ValueError, match="32767"):
        kernels.tally(stacked, torch.zeros(1, dtype=torch.int32), 32768, "vote", False, 0)


# ------------------------------------------------------------------------------------------------
# AccumAdamW / AccumLion


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("K", [1, 3])
@pytest.mark.parametrize("kind", ["adamw", "lion"])
@pytest.mark.parametrize("mixed", [False, True], ids=["in-place", "sources"])
def test_accum_kernels(emu, kind, K, dtype, mixed):
    """Seven steps (flush and accumulate steps), sizes 1, 31, 33, 4097 and a misaligned 4097:
    parameters and every state equal the fp32 reference bit for bit after every step. With
    ``sources`` (the table's y row: the decentralized wrapper's fused mixing) x is read from a
    fresh buffer each step, which must stay untouched."""
    gen = torch.Generator().manual_seed(K)
    arena = Arena(gen)
    backend = EmuAccum(emu)
    sizes = SIZES + [4097]
    shift = [0] * len(SIZES) + [1]
    xs = [arena.put(_values(n, dtype, gen), s) for n, s in zip(sizes, shift)]
    states = [[arena.put(torch.zeros(n), s) for n, s in zip(sizes, shift)] for _ in range(3)]
    ex, es = [x.clone() for x in xs], [[t.clone() for t in st] for st in states]
    for t in range(1, 8):
        gs = [arena.put((torch.randn(n, generator=gen) * 10.0 ** (t % 3 - 1)).to(dtype), s)
              for n, s in zip(sizes, shift)]
        gs[2][0] = 0.0
        ys = [arena.put(_values(n, dtype, gen), s) for n, s in zip(sizes, shift)] if mixed \
            else None
        kept = [y.clone() for y in ys] if mixed else []
        if kind == "adamw":
            kw = {"lr": 3e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.1,
                  "accum_steps": K, "step": t, "sources": ys}
            backend.adamw(xs, gs, *states, **kw)
            accum_reference.adamw_reference(ex, gs, *es, **kw)
        else:
            kw = {"lr": 3e-2, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.1,
                  "accum_steps": K, "step": t, "sources": ys}
            backend.lion(xs, gs, *states[:2], **kw)
            accum_reference.lion_reference(ex, gs, *es[:2], **kw)
        for i, (y, k) in enumerate(zip(ys or [], kept)):
            assert_same(y, k, f"step {t} sources[{i}] (read only)")
        for i, (a, e) in enumerate(zip(xs, ex)):
            assert_same(a, e, f"step {t} params[{i}]")
        for name, A, E in zip(("accum", "exp_avg", "exp_avg_sq"), states, es):
            for i, (a, e) in enumerate(zip(A, E)):
                assert_same(a, e, f"step {t} {name}[{i}]")
        arena.check()
