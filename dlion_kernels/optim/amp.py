"""fp16 AMP with the standard ``torch.amp.GradScaler``, with one decision for all ranks.

A plain optimizer under ``scaler.step(opt)`` is skipped on a rank whose own gradients overflowed,
and only there; D-Lion's collectives would then pair different steps. An optimizer that sets
``_step_supports_amp_scaling = True`` and whose ``step`` takes a ``grad_scaler`` keyword is
called by ``scaler.step`` on every rank instead, with the scaler itself. Then:

1. ``before_exchange``: unscale this rank's gradients with the scaler's own ``unscale_`` (one
   fused check-and-unscale, no host sync; skipped when the user already called ``unscale_``)
   and return the local overflow flag as a tensor, which goes into the step header;
2. the exchange decides for all ranks at once (skip when any rank overflowed);
3. ``after_exchange``: write that global decision into the scaler's per-device ``found_inf``
   tensors, which ``scaler.update()`` reads, so every rank backs off or grows alike and the scales
   stay identical.

Without a ``grad_scaler`` keyword (the attribute protocol torch announces: ``opt.grad_scale`` and
``opt.found_inf`` set around ``step``) the optimizer still unscales, decides and skips for all
ranks, but cannot reach what ``update()`` reads; ``before_exchange`` handles that form too.
"""

from __future__ import annotations

import warnings

import torch

# torch warns (FutureWarning, at the user's scaler.step line) that it will stop passing
# ``grad_scaler``; that keyword is the only way to make every rank's scale update agree, and the
# attribute protocol is handled too once torch switches. The warning speaks to optimizer authors.
warnings.filterwarnings(
    "ignore", message="GradScaler is going to stop passing itself", category=FutureWarning
)


def _found_inf_tensors(scaler, opt) -> dict:
    # GradScaler keeps each optimizer's per-device found_inf tensors here; update() sums them.
    return scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]


def before_exchange(opt, grad_scaler, device) -> torch.Tensor | None:
    """Unscale the gradients of ``opt`` for this step; return the local overflow flag (a
    one-element tensor on ``device``, never read back here) or None when no scaler is in play."""
    if grad_scaler is not None:
        if not grad_scaler.is_enabled():
            return None
        found = _found_inf_tensors(grad_scaler, opt)
        if not found:  # READY: nobody unscaled yet this iteration
            grad_scaler.unscale_(opt)
            found = _found_inf_tensors(grad_scaler, opt)
        return _sum_on(found.values(), device)

    scale = getattr(opt, "grad_scale", None)
    found_inf = getattr(opt, "found_inf", None)
    if scale is None and found_inf is None:
        return None
    flag = torch.zeros(1, dtype=torch.float32, device=device)
    if scale is not None:  # the attribute protocol with still-scaled gradients
        inv = scale.double().reciprocal().float().to(device).reshape(1)
        by_dtype: dict = {}
        for g in (p.grad for group in opt.param_groups for p in group["params"]):
            if g is not None:
                by_dtype.setdefault(g.dtype, []).append(g)
        for grads in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv)
    if found_inf is not None:
        flag += found_inf.to(device).reshape(1)
    return flag


def after_exchange(opt, grad_scaler, skipped) -> None:
    """Make ``grad_scaler.update()`` see the decision all ranks took: a bool, or the device skip
    flag itself (a deferred decision: copied on the device, never read back; None = no skip)."""
    if grad_scaler is None or not grad_scaler.is_enabled():
        return
    for t in _found_inf_tensors(grad_scaler, opt).values():
        if isinstance(skipped, torch.Tensor):
            t.copy_((skipped.reshape(-1)[:1] != 0).to(device=t.device, dtype=t.dtype).view(t.shape))
        else:
            t.fill_(1.0 if skipped else 0.0)


def _sum_on(tensors, device) -> torch.Tensor:
    flag = torch.zeros(1, dtype=torch.float32, device=device)
    for t in tensors:
        flag += t.to(device).reshape(1)
    return flag
