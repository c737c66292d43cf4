"""Launch tables (tensor addresses, sizes, block offsets) built on the host and read by kernels."""

from __future__ import annotations

import torch


def to_device(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``table`` on ``device``. A CUDA copy goes through pinned memory, without blocking: a copy
    from pageable memory waits for the device (a host sync inside the step). The caching host
    allocator keeps the pinned block until the copy has run."""
    if device.type != "cuda":
        return table.to(device)
    return table.pin_memory().to(device, non_blocking=True)
