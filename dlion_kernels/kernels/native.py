"""The ``cpu`` and ``cuda`` backends: the C++ and CUDA kernels of the native module ``_C``.

Each backend object has the stage functions of ``reference.py`` with the same arguments and
results (votes and aggregates bit-exact, fp32 floats bit-exact, bf16/fp16 rounded once):

- ``local_step(grads, exp_avgs, votes, offsets, beta1, ternary)``
- ``tally(stacked, out, n, mode, ternary, step)`` (``step``: an int or the device counter,
  ``reference.py``)
- ``apply(params, grads, exp_avgs, aggregate, offsets, lr, weight_decay, beta2, n, mode, ternary,
  skip=None)`` (``exp_avgs`` None, or None entries: x only for those tensors, no momentum)

Each stage is one kernel call for the whole list of tensors. The tensors reach the kernels through
a *tensor table* (``csrc/common.h``): an int64 tensor of 6 rows (pointer a, pointer b, numel,
block offset, first CUDA chunk, pointer c) and one column per tensor, on the tensors' device.
Tables are cached on their content, so a steady-state optimizer step (same tensors, same offsets)
builds and uploads nothing. The callers (``step.py``) guarantee contiguous tensors of one dtype
per list on one device; this module checks what memory safety needs when it builds a table.

The module imports without ``_C``: ``problem(name)`` says why a backend cannot run, and
``backend(name)`` raises that as ``backends.BackendUnavailable``.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from . import reference
from .errors import BackendUnavailable
from .layout import aggregate_planes, num_blocks, tie_pattern, vote_planes
from .tables import keep_if_captured, to_device

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_REBUILD = "reinstall with `pip install -e .` (or `pip install .`) from the source tree"
TABLE_CACHE_SIZE = 64

_C = None
_C_error: str | None = None
_cuda_runtime_problem: str | None = None


def load_module():
    """The native module, or None (the reason is kept in ``_C_error``)."""
    global _C, _C_error
    if _C is None and _C_error is None:
        try:
            from . import _C as module
        except ImportError as exc:  # not built, or built for another Python / platform
            _C_error = str(exc) or type(exc).__name__
        else:
            _C = module
    return _C


def build_info() -> str:
    """How the native module was built, or why it cannot be loaded."""
    C = load_module()
    if C is None:
        return f"not available: {_C_error}"
    return f"{C.build_info()}; cpu kernels in use: {C.cpu_isa()}"


def problem(name: str) -> str | None:
    """None if the native backend ``name`` ('cpu' or 'cuda') can run here, else why not and how
    to fix it."""
    global _cuda_runtime_problem
    if name not in ("cpu", "cuda"):
        raise ValueError(f"native backends are 'cpu' and 'cuda', got {name!r}")
    C = load_module()
    if C is None:
        return f"dlion_kernels.kernels._C is not built or cannot be loaded ({_C_error}): {_REBUILD}"
    if name == "cpu":
        return None
    if not C.has_cuda():
        return (
            f"the native module was built without CUDA ({C.cuda_not_built_reason()}); "
            f"set DLION_BUILD_CUDA=1 and {_REBUILD}"
        )
    if not torch.cuda.is_available():
        return "no CUDA device is visible to torch"
    arch = arch_problem(torch.cuda.get_device_capability(), compiled_archs(C.build_info()))
    if arch:
        return arch
    if _cuda_runtime_problem is None:
        _cuda_runtime_problem = C.cuda_runtime_problem()
    if _cuda_runtime_problem:
        return (
            f"the native module's CUDA runtime cannot use the device ({_cuda_runtime_problem}); "
            "update the NVIDIA driver, or rebuild with an nvcc that this driver supports"
        )
    return None


def compiled_archs(info: str) -> list[int]:
    """The CUDA architectures the module was built for (e.g. [80, 90]), from its build info."""
    import re

    found = re.search(r"archs ([0-9;a-z-]+)", info)
    if not found:
        return []
    return [int(re.match(r"\d+", a).group()) for a in found.group(1).split(";") if a[:1].isdigit()]


def arch_problem(capability: tuple[int, int], archs: list[int]) -> str | None:
    """None if a device of compute ``capability`` (major, minor) can run a module built for
    ``archs`` (SASS + PTX for each, CMakeLists.txt), else why not. SASS of sm_XY runs on X.Y and
    later minors of X; the PTX of the oldest arch is compiled by the driver for anything newer;
    nothing runs on an older device (e.g. a V100, 7.0, or a T4, 7.5, with sm_80;90)."""
    major, minor = capability
    device = 10 * major + minor
    if not archs:
        return None  # unknown build: let the launch tell
    if device >= min(archs):
        return None
    built = ", ".join(f"sm_{a}" for a in archs)
    return (
        f"the native module has CUDA kernels for {built} only and this device is sm_{device} "
        f"(compute capability {major}.{minor}); the 'triton' backend runs there, or rebuild with "
        f"DLION_CUDA_ARCHS={device} and DLION_BUILD_CUDA=1"
    )


_backends: dict = {}


def backend(name: str):
    """The stage functions of the native backend ``name`` ('cpu' or 'cuda')."""
    reason = problem(name)
    if reason is not None:
        raise BackendUnavailable(f"backend {name!r} cannot run here: {reason}")
    if name not in _backends:
        _backends[name] = _NativeBackend(name == "cuda")
    return _backends[name]


def device_args(cuda: bool, t: torch.Tensor):
    """The (device index, stream) arguments of a CUDA launch on ``t`` (current stream), None
    on the CPU; ValueError if ``t`` is not on the backend's kind of device. Also accum_native's."""
    if cuda:
        if t.device.type != "cuda":
            raise ValueError(f"the 'cuda' backend needs CUDA tensors, got {t.device}")
        index = t.device.index if t.device.index is not None else torch.cuda.current_device()
        return index, torch.cuda.current_stream(index).cuda_stream
    if t.device.type != "cpu":
        raise ValueError(f"the 'cpu' backend needs CPU tensors, got {t.device}")
    return None


def _dtype_code(dtype: torch.dtype, what: str) -> int:
    code = DTYPE_CODES.get(dtype)
    if code is None:
        raise TypeError(f"{what} must be float32, bfloat16 or float16, got {dtype}")
    return code


def _check_words(t: torch.Tensor, what: str, words: int) -> None:
    if t.dtype != torch.int32 or not t.is_contiguous():
        raise TypeError(f"{what} must be a contiguous int32 tensor, got {t.dtype}")
    if t.numel() < words:
        raise ValueError(f"{what} holds {t.numel()} int32 words, the tensors need {words}")


class _Table:
    """A tensor table on the tensors' device, with what the checks need."""

    __slots__ = ("tensor", "address", "count", "chunks", "end_block")

    def __init__(self, rows, device, chunk_elems: int, end_block: int, c_row=None):
        """rows: a, b, numel, block (lists, one entry per tensor); c_row: pointers c or None."""
        count = len(rows[0])
        chunk_starts, total = [], 0
        for numel in rows[2]:
            chunk_starts.append(total)
            total += -(-numel // chunk_elems) if chunk_elems else 0
        c_row = [0] * count if c_row is None else c_row
        table = torch.tensor([*rows, chunk_starts, c_row], dtype=torch.int64)
        if device.type == "cuda":
            table = to_device(table, device)
        self.tensor = table
        self.address = table.data_ptr()
        self.count = count
        self.chunks = total
        self.end_block = end_block


class _NativeBackend:
    """The stage functions on the C++ (``cuda=False``) or CUDA kernels of ``_C``."""

    def __init__(self, cuda: bool):
        self._C = load_module()
        self.cuda = cuda
        self._chunk = self._C.cuda_chunk_elems() if cuda else 0
        self._tables: OrderedDict = OrderedDict()

    def __repr__(self) -> str:
        return f"<dlion_kernels native backend {'cuda' if self.cuda else 'cpu'}>"

    # ------------------------------------------------------------------------- tables

    def _device_args(self, t: torch.Tensor):
        return device_args(self.cuda, t)

    def _in_use(self, table: "_Table") -> int:
        """The table's address for a launch on the current stream. A cached table is shared by
        launches on any stream (overlap runs stages on side streams), and may be evicted from the
        cache while a launch that reads it is still queued: record_stream makes the caching
        allocator keep its memory until the work queued so far on this stream has completed."""
        if self.cuda:
            table.tensor.record_stream(torch.cuda.current_stream(table.tensor.device))
            keep_if_captured(table.tensor)
        return table.address

    def _cached(self, key):
        table = self._tables.get(key)
        if table is not None:
            self._tables.move_to_end(key)
        return table

    def _store(self, key, table: _Table) -> _Table:
        self._tables[key] = table
        if len(self._tables) > TABLE_CACHE_SIZE:
            self._tables.popitem(last=False)
        return table

    def _check_list(self, tensors, what, device, dtype=None):
        for i, t in enumerate(tensors):
            if t is None:
                continue
            if not t.is_contiguous():
                raise ValueError(f"{what}[{i}] must be contiguous")
            if t.device != device:
                raise ValueError(f"{what}[{i}] is on {t.device}, expected {device}")
            if dtype is not None and t.dtype != dtype:
                raise TypeError(f"{what}[{i}] has dtype {t.dtype}, expected {dtype}")

    def _local_step_table(self, grads, exp_avgs, offsets) -> tuple[_Table, int]:
        g_ptrs = [0 if g is None else g.data_ptr() for g in grads]
        m_ptrs = [m.data_ptr() for m in exp_avgs]
        numels = [m.numel() for m in exp_avgs]
        g_dtype = next((g.dtype for g in grads if g is not None), torch.float32)
        key = ("local_step", g_dtype, *g_ptrs, *m_ptrs, *numels, *offsets)
        table = self._cached(key)
        if table is not None:
            return table, DTYPE_CODES[g_dtype]
        if not len(grads) == len(exp_avgs) == len(offsets):
            raise ValueError("grads, exp_avgs and offsets must have equal lengths")
        device = exp_avgs[0].device
        self._check_list(exp_avgs, "exp_avgs", device, torch.float32)
        self._check_list(grads, "grads", device, g_dtype)
        code = _dtype_code(g_dtype, "grads")
        rows = [[], [], [], []]
        end_block = 0
        for i, (g, gp, mp, numel, off) in enumerate(zip(grads, g_ptrs, m_ptrs, numels, offsets)):
            if g is not None and g.numel() != numel:
                raise ValueError(f"grads[{i}] has {g.numel()} elements, exp_avgs[{i}] {numel}")
            if numel == 0:
                continue
            end_block = max(end_block, off + num_blocks(numel))
            for row, value in zip(rows, (gp, mp, numel, off)):
                row.append(value)
        return self._store(key, _Table(rows, device, self._chunk, end_block)), code

    def _apply_table(self, params, grads, exp_avgs, offsets) -> tuple[_Table, int, int]:
        """The table of apply (a = param, b = momentum, c = gradient or 0), and the dtype codes
        of the parameters and the gradients."""
        x_ptrs = [x.data_ptr() for x in params]
        g_ptrs = [0 if g is None else g.data_ptr() for g in grads]
        m_ptrs = [0 if m is None else m.data_ptr() for m in exp_avgs]
        numels = [x.numel() for x in params]
        p_dtype = params[0].dtype
        g_dtype = next((g.dtype for g in grads if g is not None), p_dtype)
        key = ("apply", p_dtype, g_dtype, *x_ptrs, *g_ptrs, *m_ptrs, *numels, *offsets)
        table = self._cached(key)
        if table is None:
            if not len(params) == len(grads) == len(exp_avgs) == len(offsets):
                raise ValueError("params, grads, exp_avgs and offsets must have equal lengths")
            device = params[0].device
            _dtype_code(p_dtype, "params")
            _dtype_code(g_dtype, "grads")
            if g_dtype not in (p_dtype, torch.float32):
                raise TypeError(
                    f"grads must have the parameters' dtype ({p_dtype}) or float32, got {g_dtype}"
                )
            self._check_list(params, "params", device, p_dtype)
            self._check_list(grads, "grads", device, g_dtype)
            self._check_list(exp_avgs, "exp_avgs", device, torch.float32)
            rows, c_row = [[], [], [], []], []
            end_block = 0
            for i, (g, m, xp, gp, mp, numel, off) in enumerate(
                zip(grads, exp_avgs, x_ptrs, g_ptrs, m_ptrs, numels, offsets)
            ):
                for what, t in (("grads", g), ("exp_avgs", m)):
                    if t is not None and t.numel() != numel:
                        raise ValueError(
                            f"{what}[{i}] has {t.numel()} elements, params[{i}] {numel}"
                        )
                if numel == 0:
                    continue
                end_block = max(end_block, off + num_blocks(numel))
                for row, value in zip(rows, (xp, mp, numel, off)):
                    row.append(value)
                c_row.append(gp)
            table = self._store(key, _Table(rows, device, self._chunk, end_block, c_row))
        return table, DTYPE_CODES[p_dtype], DTYPE_CODES[g_dtype]

    def _single_table(self, what, tensors, offsets) -> _Table:
        """A table of one tensor list (row a), e.g. the params of apply."""
        ptrs = [x.data_ptr() for x in tensors]
        numels = [x.numel() for x in tensors]
        dtype = tensors[0].dtype
        key = (what, dtype, *ptrs, *numels, *offsets)
        table = self._cached(key)
        if table is not None:
            return table
        if len(tensors) != len(offsets):
            raise ValueError(f"{what} and offsets must have equal lengths")
        device = tensors[0].device
        _dtype_code(dtype, what)
        self._check_list(tensors, what, device, dtype)
        rows = [[], [], [], []]
        end_block = 0
        for ptr, numel, off in zip(ptrs, numels, offsets):
            if numel == 0:
                continue
            end_block = max(end_block, off + num_blocks(numel))
            for row, value in zip(rows, (ptr, 0, numel, off)):
                row.append(value)
        return self._store(key, _Table(rows, device, self._chunk, end_block))

    # ------------------------------------------------------------------------- the stages

    def local_step(self, grads, exp_avgs, votes, offsets, beta1, ternary):
        """c = b1*m + (1-b1)*g; votes[...] = packed vote(c). m is read only. ``None`` g = 0."""
        if len(exp_avgs) == 0:
            return
        device = self._device_args(exp_avgs[0])
        table, code = self._local_step_table(grads, exp_avgs, offsets)
        if table.count == 0:
            return
        planes = vote_planes("ternary" if ternary else "binary")
        _check_words(votes, "votes", table.end_block * planes)
        beta1 = float(beta1)
        args = (beta1, 1.0 - beta1, bool(ternary))
        if votes.device != exp_avgs[0].device:
            raise ValueError(f"votes is on {votes.device}, exp_avgs on {exp_avgs[0].device}")
        if self.cuda:
            self._C.cuda_local_step(
                self._in_use(table), table.count, table.chunks, code, votes.data_ptr(), *args,
                *device,
            )
        else:
            self._C.cpu_local_step(
                table.address, table.count, code, votes.data_ptr(), *args, torch.get_num_threads()
            )

    def tally(self, stacked, out, n, mode, ternary, step):
        """Aggregate n stacked packed vote vectors [n, P_in * blocks] into ``out``."""
        device = self._device_args(stacked)
        votes = "ternary" if ternary else "binary"
        p_in, p_out = vote_planes(votes), aggregate_planes(mode, votes, n)
        if stacked.dtype != torch.int32 or not stacked.is_contiguous():
            raise TypeError(f"stacked must be a contiguous int32 tensor, got {stacked.dtype}")
        if stacked.numel() % n != 0:
            raise ValueError(f"stacked has {stacked.numel()} words, not a multiple of n = {n}")
        row_words = stacked.numel() // n
        if row_words % p_in != 0:
            raise ValueError(f"a row of stacked has {row_words} words, not a multiple of {p_in}")
        blocks = row_words // p_in
        if out.dtype != torch.int32 or not out.is_contiguous() or out.numel() != p_out * blocks:
            raise ValueError(
                f"out must be a contiguous int32 tensor of {p_out * blocks} words, got "
                f"{out.dtype} of {out.numel()}"
            )
        if out.device != stacked.device:
            raise ValueError(f"out is on {out.device}, stacked on {stacked.device}")
        if blocks == 0:
            return
        reference.check_step(step, stacked.device)
        args = (row_words, n, blocks, out.data_ptr(), mode == "average", bool(ternary))
        on_device = isinstance(step, torch.Tensor)
        if self.cuda:  # a counter tensor is read by the kernel (no host sync)
            tie = 0 if on_device else tie_pattern(step) & 0xFFFFFFFF
            self._C.cuda_tally(stacked.data_ptr(), *args, tie,
                               step.data_ptr() if on_device else 0, *device)
        else:  # on the CPU the counter is host memory
            tie = tie_pattern(int(step) if on_device else step) & 0xFFFFFFFF
            self._C.cpu_tally(stacked.data_ptr(), *args, tie, torch.get_num_threads())

    def apply(self, params, grads, exp_avgs, aggregate, offsets, lr, weight_decay, beta2, n,
              mode, ternary, skip=None):
        """x = x - lr * (D + weight_decay * x) in fp32, stored back in the parameter's dtype;
        m = b2*m + (1-b2)*g. Nothing when ``skip`` (int32 [1] on the params' device) is non-zero:
        CUDA reads it in the kernel (no host sync), the CPU here. ``exp_avgs=None`` (or a None
        entry): x only, the momentum and the gradient are not touched (null table entries)."""
        if len(params) == 0:
            return
        if exp_avgs is None:
            grads = exp_avgs = [None] * len(params)
        device = self._device_args(params[0])
        table, p_code, g_code = self._apply_table(params, grads, exp_avgs, offsets)
        if table.count == 0:
            return
        planes = aggregate_planes(mode, "ternary" if ternary else "binary", n)
        _check_words(aggregate, "aggregate", table.end_block * planes)
        if aggregate.device != params[0].device:
            raise ValueError(f"aggregate is on {aggregate.device}, params on {params[0].device}")
        if skip is not None:
            if skip.dtype != torch.int32 or skip.numel() < 1 or skip.device != params[0].device:
                raise TypeError(
                    f"skip must be an int32 tensor of 1 element on {params[0].device}, got "
                    f"{skip.dtype} of {skip.numel()} on {skip.device}"
                )
            if not self.cuda and int(skip[0]) != 0:
                return
        beta2 = float(beta2)
        args = (float(lr), float(weight_decay), beta2, 1.0 - beta2, n, mode == "average",
                bool(ternary))
        if self.cuda:
            skip_address = 0 if skip is None else skip.data_ptr()
            self._C.cuda_apply(
                self._in_use(table), table.count, table.chunks, p_code, g_code,
                aggregate.data_ptr(),
                *args, skip_address, *device,
            )
        else:
            self._C.cpu_apply(
                table.address, table.count, p_code, g_code, aggregate.data_ptr(), *args,
                torch.get_num_threads(),
            )

    def nonfinite(self, grads) -> torch.Tensor:
        """int32 [1]: 1 if any of ``grads`` (non-empty, one dtype, contiguous) holds inf or NaN.
        The CPU reads each gradient once on all threads; CUDA uses the reference (one fused
        multi-tensor torch kernel there)."""
        if self.cuda:
            return reference.nonfinite(grads)
        self._device_args(grads[0])
        table = self._single_table("grads", grads, [0] * len(grads))
        found = table.count > 0 and self._C.cpu_nonfinite(
            table.address, table.count, DTYPE_CODES[grads[0].dtype], torch.get_num_threads()
        )
        return torch.tensor([int(found)], dtype=torch.int32)
