"""dlion_kernels: fused kernels for Distributed Lion, 1 bit per parameter on the wire.

Floors (each imports only from the floors below it):

- ``kernels``   the fused stages on every backend (torch reference, C++ cpu, CUDA, Triton)
- ``exchange``  the D-Lion protocol on a process group (``fused_dlion_step``)
- ``optim``     ``torch.optim`` front ends (``DistributedLion``, ``AccumAdamW``, ``AccumLion``)
- ``decentralized``  seed 2's gossip training (``DecentralizedDataParallel``, topologies)
- ``local``     local steps with an outer step every H steps (``DiLoCo``)
- ``checkpoint`` per-rank optimizer checkpoints (``save_state``, ``load_state``)
- ``plan``      the runtime model that predicts each strategy's step time
- ``demo``      the multi-worker training demos (``python -m dlion_kernels.demo``)
"""

from .checkpoint import CheckpointError, load_state, save_state
from .decentralized.wrapper import DecentralizedDataParallel
from .exchange.collectives import DistributedStepError
from .exchange.copying import DetachedGroup
from .exchange.header import StepMismatchError
from .exchange.step import NonFiniteGradientError, StepStats, fused_dlion_step
from .kernels.backends import BackendUnavailable, available_backends
from .local.diloco import DiLoCo, SyncStats
from .optim.accum import AccumAdamW, AccumLion
from .optim.ddp_hook import register_ddp_comm_hook
from .optim.dlion import DistributedLion

__all__ = [
    "AccumAdamW",
    "AccumLion",
    "BackendUnavailable",
    "CheckpointError",
    "DecentralizedDataParallel",
    "DetachedGroup",
    "DiLoCo",
    "DistributedLion",
    "DistributedStepError",
    "NonFiniteGradientError",
    "StepMismatchError",
    "StepStats",
    "SyncStats",
    "available_backends",
    "fused_dlion_step",
    "load_state",
    "register_ddp_comm_hook",
    "save_state",
]
__version__ = "0.1.0"


def __getattr__(name):
    # dk.plan (the runtime model) is loaded on first use, so `import dlion_kernels` stays light.
    if name == "plan":
        import importlib

        return importlib.import_module(".plan", __name__)
    raise AttributeError(f"module 'dlion_kernels' has no attribute {name!r}")
