"""Which backend runs the three stages, and why another one cannot.

A backend is an object with the stage functions of ``reference.py``: ``local_step``, ``tally``
and ``apply``, same arguments, same results, and the gradient check ``nonfinite``.
"""

from __future__ import annotations

import os

import torch

from .errors import BackendUnavailable  # noqa: F401  (re-exported)

BACKENDS = ("cuda", "triton", "cpu", "torch")


def _triton_problem(device_type: str) -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed (pip install triton)"
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if device_type == "cuda":
        if interpreted:
            return "TRITON_INTERPRET=1 runs Triton on the CPU only; unset it for CUDA tensors"
        if not torch.cuda.is_available():
            return "no CUDA device is visible to torch"
        return None
    if not interpreted:
        return "Triton needs CUDA tensors, or TRITON_INTERPRET=1 to interpret it on the CPU"
    return None


def _problem(name: str, device_type: str) -> str | None:
    """None if ``name`` can run on tensors of ``device_type``, else the reason it cannot."""
    if name == "torch":
        return None
    if name == "triton":
        return _triton_problem(device_type)
    from . import native

    if name == "cpu":
        if device_type != "cpu":
            return "the 'cpu' backend runs on CPU tensors only"
        return native.problem("cpu")
    if name == "cuda":
        if device_type != "cuda":
            return "the 'cuda' backend runs on CUDA tensors only"
        return native.problem("cuda")
    raise ValueError(f"backend must be one of {BACKENDS} or None, got {name!r}")


def available_backends(device: str | torch.device | None = None) -> list[str]:
    """The backends that can run on ``device`` here (default: CUDA if visible, else CPU), best
    first. On the CPU the Triton interpreter comes last: it is correct but slow."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device_type = torch.device(device).type
    order = ("cuda", "triton", "torch") if device_type == "cuda" else ("cpu", "torch", "triton")
    return [name for name in order if _problem(name, device_type) is None]


def resolve(name: str | None, device: torch.device) -> str:
    """The backend to use: ``name``, else ``$DLION_BACKEND``, else the best available."""
    if name is None:
        name = os.environ.get("DLION_BACKEND") or None
    if name is None:
        return available_backends(device)[0]
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {name!r}")
    problem = _problem(name, device.type)
    if problem is not None:
        raise BackendUnavailable(f"backend {name!r} cannot run on {device.type} tensors: {problem}")
    return name


def get(name: str):
    """The stage functions of a backend name returned by ``resolve``."""
    if name == "torch":
        from . import reference

        return reference
    if name == "triton":
        from . import triton

        return triton
    from . import native

    return native.backend(name)
