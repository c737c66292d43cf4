"""``DistributedLion``: a ``torch.optim.Optimizer`` around ``fused_dlion_step``."""

from __future__ import annotations

import torch

from ..exchange.checks import (
    check_hyperparameters,
    check_options,
    check_params,
    check_tensors,
)
from ..exchange.copying import Copyable, attached_group
from ..exchange.step import Segment, StepStats, run_step
from . import amp

# torch.optim's implementation flags and the values accepted
_FLAGS = {
    "foreach": (None, True, False),  # accepted: every backend is multi-tensor fused anyway
    "fused": (None, True, False),
    "capturable": (None, False),  # the step reads the ranks' header on the host
    "differentiable": (None, False),  # sign votes have no useful derivative
}


def _check_flags(flags: dict) -> None:
    for name, value in flags.items():
        allowed = _FLAGS[name]
        if value not in allowed or (value is not None and not isinstance(value, bool)):
            why = {
                "capturable": "the step reads every rank's header on the host (a collective "
                "decision), so it cannot be captured in a CUDA graph",
                "differentiable": "the update is a sign vote, which has no useful derivative",
            }.get(name, "")
            raise ValueError(
                f"{name} must be one of {allowed}, got {value!r}" + (f": {why}" if why else "")
            )


class DistributedLion(Copyable, torch.optim.Optimizer):
    """Distributed Lion (Liu et al., 2024): every rank votes with the sign of its Lion update and
    all ranks apply the same aggregated update, so parameters stay bit-identical.

    It replaces the gradient all-reduce: call ``backward()`` without DDP's gradient sync, then
    ``step()``. Param groups may set their own ``lr``, ``betas`` and ``weight_decay``; all groups
    share one exchange per step. ``mode``, ``votes``, ``group``, ``backend`` and ``nonfinite`` are
    fixed for the optimizer (see ``fused_dlion_step``).

    Every parameter with ``requires_grad`` takes part in every step on every rank; a ``None``
    gradient counts as zero (the parameter still moves by its momentum's vote and weight decay).
    ``last_stats`` holds the ``StepStats`` of the latest step.

    Ranks on different steps (e.g. one rank resumed from another checkpoint) raise
    ``StepMismatchError`` on every rank, naming both step numbers; nothing is modified.

    AMP: ``torch.amp.GradScaler`` works as with any optimizer (``scaler.step(opt)``,
    ``scaler.update()``). ``scaler.step`` calls ``step`` on every rank; the gradients are unscaled
    here, the overflow decision is taken for all ranks at once in the exchange (an overflow on
    any rank skips the step on every rank, whatever ``nonfinite`` says), and every rank's scaler
    sees that global decision, so the scales stay identical (see ``optim/amp.py``).

    Copies: ``copy.deepcopy``, ``pickle`` and ``torch.save``/``torch.load`` keep every option and
    ``last_stats``; the copy steps like the original. A deepcopy keeps the same process group.
    A pickled copy keeps ``group=None`` or the default group (looked up again on use); an
    explicit other group cannot be pickled: the copy raises a clear error on its first step until
    you assign the group again (``opt.group = my_group``). Hooks are not copied (as in torch).

    ``foreach`` and ``fused`` are accepted and change nothing (every backend runs fused
    multi-tensor kernels); ``capturable=True`` and ``differentiable=True`` raise ``ValueError``.
    """

    _step_supports_amp_scaling = True  # scaler.step calls step() on every rank (see optim/amp.py)

    def __init__(
        self,
        params,
        lr: float = 1e-4,
        betas=(0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        mode: str = "vote",
        votes: str = "binary",
        group=None,
        backend: str | None = None,
        nonfinite: str = "raise",
        foreach: bool | None = None,
        fused: bool | None = None,
        capturable: bool | None = None,
        differentiable: bool | None = None,
    ):
        check_hyperparameters(lr, betas, weight_decay)
        check_options(mode, votes, backend, nonfinite)
        _check_flags(dict(foreach=foreach, fused=fused, capturable=capturable,
                          differentiable=differentiable))
        # differentiable=False as torch's __setstate__ would add it: a copy's defaults are equal
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay,
                                      differentiable=False))
        self.mode, self.votes, self.group = mode, votes, group
        self.backend, self.nonfinite = backend, nonfinite
        self.last_stats: StepStats | None = None

    def add_param_group(self, param_group: dict) -> None:
        """Also after construction: the new parameters get their state on their first step."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            check_params(group["params"])
            check_hyperparameters(group["lr"], group["betas"], group["weight_decay"])
            _check_flags({k: group[k] for k in _FLAGS if k in group})
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise

    @torch.no_grad()
    def step(self, closure=None, *, grad_scaler=None):
        """One step on every rank. ``grad_scaler`` is passed by ``torch.amp.GradScaler.step``
        (never pass it yourself)."""
        group = attached_group(self.group, self)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        segments, states = [], []
        for g in self.param_groups:
            beta1, beta2 = check_hyperparameters(g["lr"], g["betas"], g["weight_decay"])
            params = [p for p in g["params"] if p.requires_grad]
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                states.append(state)
            grads = [p.grad for p in params]
            exp_avgs = [self.state[p]["exp_avg"] for p in params]
            segments.append(Segment(params, grads, exp_avgs, float(g["lr"]), beta1, beta2,
                                    float(g["weight_decay"])))
        check_tensors(*(sum((getattr(s, k) for s in segments), []) for k in
                        ("params", "grads", "exp_avgs")))
        step = max((state["step"] for state in states), default=0)
        device = next((p.device for s in segments for p in s.params), torch.device("cpu"))
        found_inf = amp.before_exchange(self, grad_scaler, device)
        self.last_stats = run_step(segments, mode=self.mode, votes=self.votes, group=group,
                                   backend=self.backend, step=step, nonfinite=self.nonfinite,
                                   found_inf=found_inf)
        amp.after_exchange(self, grad_scaler, self.last_stats.skipped)
        if not self.last_stats.skipped:
            for state in states:
                state["step"] = step + 1
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        # torch casts floating state to the param's dtype; momentum stays fp32 here for exact
        # resume of bf16/fp16 models, so put the saved fp32 values back afterwards.
        saved = state_dict["state"]
        super().load_state_dict(state_dict)
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params):
            if i in saved and "exp_avg" in saved[i]:
                self.state[p]["exp_avg"] = saved[i]["exp_avg"].to(
                    device=p.device, dtype=torch.float32, copy=True
                )
