"""The ``cpu`` and ``cuda`` backends of AccumAdamW / AccumLion: the kernels of ``_C``
(``csrc/cpu/accum_kernels.cpp``, ``csrc/cuda/accum_kernels.cu``).

Each call is one kernel call for the whole list of tensors, through an *accum table*
(``csrc/accum_common.h``): int64 ``[8, T]`` rows x, g, a, m, v, numel, first CUDA chunk, y (the
source x is read from: x itself, or ``sources[i]``), on the tensors' device. Tables are cached on
their content, so a steady-state step (same tensors) builds and uploads nothing. The callers
(``accum.py``) have checked dtypes, devices, sizes and contiguity. The dtype codes, the cache size
and the device check are ``native.py``'s.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from . import native
from .accum_reference import ADAMW_SCALARS, LION_SCALARS, adamw_scalars, lion_scalars
from .errors import BackendUnavailable
from .tables import to_device

_backends: dict = {}


def backend(name: str):
    reason = native.problem(name)
    if reason is None and not hasattr(native.load_module(), "cpu_accum_adamw"):
        reason = "the native module was built without the accum kernels: rebuild it"
    if reason is not None:
        raise BackendUnavailable(f"backend {name!r} cannot run here: {reason}")
    if name not in _backends:
        _backends[name] = _AccumBackend(name == "cuda")
    return _backends[name]


class _AccumBackend:
    def __init__(self, cuda: bool):
        self._C = native.load_module()
        self.cuda = cuda
        self._chunk = self._C.cuda_accum_chunk_elems() if cuda else 0
        self._tables: OrderedDict = OrderedDict()

    def _table(self, lists, k1: bool):
        """(table tensor, tensors, chunks) of x, g, a, m, v, y (v may be None: AccumLion)."""
        numels = [x.numel() for x in lists[0]]
        ptrs = [[0 if ts is None or (k1 and r == 2) else t.data_ptr() for t in ts]
                if ts is not None else [0] * len(numels) for r, ts in enumerate(lists)]
        key = (lists[0][0].device, *(p for row in ptrs for p in row), *numels)
        hit = self._tables.get(key)
        if hit is not None:
            self._tables.move_to_end(key)
            return hit
        keep = [i for i, n in enumerate(numels) if n > 0]
        rows = [[row[i] for i in keep] for row in ptrs]
        numels = [numels[i] for i in keep]
        chunks, first = 0, []
        for n in numels:
            first.append(chunks)
            chunks += -(-n // self._chunk) if self._chunk else 0
        table = torch.tensor([*rows[:5], numels, first, rows[5]], dtype=torch.int64).view(8, -1)
        if self.cuda:
            table = to_device(table, lists[0][0].device)
        entry = (table, len(numels), chunks)
        self._tables[key] = entry
        if len(self._tables) > native.TABLE_CACHE_SIZE:
            self._tables.popitem(last=False)
        return entry

    def _device(self, x):
        return native.device_args(self.cuda, x)

    def adamw(self, params, grads, accs, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps,
              weight_decay, accum_steps, step, sources=None):
        device = self._device(params[0])
        k1 = accum_steps == 1
        table, count, chunks = self._table(
            (params, grads, accs, exp_avgs, exp_avg_sqs, sources or params), k1)
        if count == 0:
            return
        s = adamw_scalars(lr, beta1, beta2, eps, weight_decay, accum_steps, step)
        args = (*(s[k] for k in ADAMW_SCALARS), k1, step % accum_steps == 0)
        code = native.DTYPE_CODES[params[0].dtype]
        if self.cuda:
            self._C.cuda_accum_adamw(table.data_ptr(), count, chunks, code, *args, *device)
        else:
            self._C.cpu_accum_adamw(table.data_ptr(), count, code, *args, torch.get_num_threads())

    def lion(self, params, grads, accs, exp_avgs, *, lr, beta1, beta2, weight_decay,
             accum_steps, step, sources=None):
        device = self._device(params[0])
        k1 = accum_steps == 1
        table, count, chunks = self._table(
            (params, grads, accs, exp_avgs, None, sources or params), k1)
        if count == 0:
            return
        s = lion_scalars(lr, beta1, beta2, weight_decay, accum_steps)
        args = (*(s[k] for k in LION_SCALARS), k1, step % accum_steps == 0)
        code = native.DTYPE_CODES[params[0].dtype]
        if self.cuda:
            self._C.cuda_accum_lion(table.data_ptr(), count, chunks, code, *args, *device)
        else:
            self._C.cpu_accum_lion(table.data_ptr(), count, code, *args, torch.get_num_threads())
