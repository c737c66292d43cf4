"""dlion_kernels: fused kernels for Distributed Lion, 1 bit per parameter on the wire.

Floors (each imports only from the floors below it):

- ``kernels``   the fused stages on every backend (torch reference, C++ cpu, CUDA, Triton)
- ``exchange``  the D-Lion protocol on a process group (``fused_dlion_step``)
- ``optim``     ``torch.optim`` front ends (``DistributedLion``, ``AccumAdamW``, ``AccumLion``)
- ``decentralized``  gossip training, Wang et al. (``DecentralizedDataParallel``, topologies)
- ``local_steps`` local steps with an outer step every H steps (``DiLoCo``)
- ``checkpoint`` per-rank optimizer checkpoints (``save_state``, ``load_state``)
- ``plan``      the runtime model that predicts each strategy's step time
- ``demo``      the multi-worker training demos (``python -m dlion_kernels.demo``)

The public names are loaded on first use (PEP 562), so ``import dlion_kernels`` imports no torch,
and ``dlion_kernels.plan`` (numbers only) runs where torch is not installed.
"""

import importlib

from ._version import __version__  # noqa: F401  (dk.__version__)

# public name -> the module that defines it (imported on first access)
_PUBLIC = {
    "AccumAdamW": ".optim.accum",
    "AccumLion": ".optim.accum",
    "BackendUnavailable": ".kernels.backends",
    "CheckpointError": ".checkpoint",
    "DLionOuterOptions": ".local_steps.outer_options",
    "DecentralizedDataParallel": ".decentralized.wrapper",
    "DetachedGroup": ".exchange.copying",
    "DiLoCo": ".local_steps.diloco",
    "DistributedLion": ".optim.dlion",
    "DistributedStepError": ".exchange.collectives",
    "NonFiniteGradientError": ".exchange.step",
    "SparseLoCoOptions": ".local_steps.outer_options",
    "StepMismatchError": ".exchange.header",
    "StepStats": ".exchange.step",
    "SyncStats": ".local_steps.diloco",
    "available_backends": ".kernels.backends",
    "fused_dlion_step": ".exchange.step",
    "load_state": ".checkpoint",
    "register_ddp_comm_hook": ".optim.ddp_hook",
    "save_state": ".checkpoint",
}
_SUBMODULES = ("checkpoint", "decentralized", "demo", "exchange", "kernels", "local_steps", "optim",
               "plan")

__all__ = sorted(_PUBLIC)


def __getattr__(name):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name], __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    if name in _SUBMODULES:  # dk.plan, dk.checkpoint, ... as an eager package would have them
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC) | set(_SUBMODULES))
