"""dlion_kernels: fused kernels for Distributed Lion, 1 bit per parameter on the wire.

Floors (each imports only from the floors below it):

- ``kernels``   the fused stages on every backend (torch reference, C++ cpu, CUDA, Triton)
- ``exchange``  the D-Lion protocol on a process group (``fused_dlion_step``)
- ``optim``     ``torch.optim`` front ends (``DistributedLion``)
- ``checkpoint`` per-rank optimizer checkpoints (``save_state``, ``load_state``)
- ``demo``      the multi-worker training demos (``python -m dlion_kernels.demo``)
"""

from .checkpoint import CheckpointError, load_state, save_state
from .exchange.collectives import DistributedStepError
from .exchange.step import NonFiniteGradientError, StepStats, fused_dlion_step
from .kernels.backends import BackendUnavailable, available_backends
from .optim.dlion import DistributedLion

__all__ = [
    "BackendUnavailable",
    "CheckpointError",
    "DistributedLion",
    "DistributedStepError",
    "NonFiniteGradientError",
    "StepStats",
    "available_backends",
    "fused_dlion_step",
    "load_state",
    "save_state",
]
__version__ = "0.1.0"
