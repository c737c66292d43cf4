"""dlion_kernels: fused kernels for Distributed Lion, 1 bit per parameter on the wire."""

from .backends import BackendUnavailable, available_backends
from .optim import DistributedLion
from .step import NonFiniteGradientError, StepStats, fused_dlion_step

__all__ = [
    "BackendUnavailable",
    "DistributedLion",
    "NonFiniteGradientError",
    "StepStats",
    "available_backends",
    "fused_dlion_step",
]
__version__ = "0.1.0"
