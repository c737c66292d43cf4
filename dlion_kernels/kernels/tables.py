"""Launch tables (tensor addresses, sizes, block offsets) built on the host and read by kernels."""

from __future__ import annotations

import torch

# Tables (and the average apply's decode tables) that a launch read during CUDA graph capture:
# the graph reads them at every replay, so they stay allocated for the life of the process, even
# once a cache has dropped them.
_CAPTURED: list = []


def to_device(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``table`` on ``device``. A CUDA copy goes through pinned memory, without blocking: a copy
    from pageable memory waits for the device (a host sync inside the step). The caching host
    allocator keeps the pinned block until the copy has run. Inside CUDA graph capture no table
    can be uploaded (the graph would copy from a host buffer freed after capture): RuntimeError
    saying how to build it first."""
    if device.type != "cuda":
        return table.to(device)
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "a D-Lion launch table is not built yet, and tables are not uploaded inside CUDA graph "
            "capture: run the step once outside capture first, with the same tensors (the same "
            ".grad tensors: zero_grad(set_to_none=False) before the warm-up and the capture)")
    return table.pin_memory().to(device, non_blocking=True)


def keep_if_captured(*tensors: torch.Tensor) -> None:
    """Keep ``tensors`` (a launch's tables) allocated for good when the launch is being captured
    in a CUDA graph."""
    if any(t.is_cuda for t in tensors) and torch.cuda.is_current_stream_capturing():
        _CAPTURED.extend(tensors)
