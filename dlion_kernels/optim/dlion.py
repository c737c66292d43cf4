"""``DistributedLion``: a ``torch.optim.Optimizer`` around ``fused_dlion_step``."""

from __future__ import annotations

import torch

from ..exchange.checks import (
    check_hyperparameters,
    check_options,
    check_params,
    check_tensors,
)
from ..exchange.step import Segment, StepStats, run_step


class DistributedLion(torch.optim.Optimizer):
    """Distributed Lion (Liu et al., 2024): every rank votes with the sign of its Lion update and
    all ranks apply the same aggregated update, so parameters stay bit-identical.

    It replaces the gradient all-reduce: call ``backward()`` without DDP's gradient sync, then
    ``step()``. Param groups may set their own ``lr``, ``betas`` and ``weight_decay``; all groups
    share one exchange per step. ``mode``, ``votes``, ``group``, ``backend`` and ``nonfinite`` are
    fixed for the optimizer (see ``fused_dlion_step``).

    Every parameter with ``requires_grad`` takes part in every step on every rank; a ``None``
    gradient counts as zero (the parameter still moves by its momentum's vote and weight decay).
    ``last_stats`` holds the ``StepStats`` of the latest step.
    """

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
    ):
        check_hyperparameters(lr, betas, weight_decay)
        check_options(mode, votes, backend, nonfinite)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))
        self.mode, self.votes, self.group = mode, votes, group
        self.backend, self.nonfinite = backend, nonfinite
        self.last_stats: StepStats | None = None

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        params = self.param_groups[-1]["params"]
        try:
            check_params(params)
            # Found by fuzzing: a group's own bad lr/betas was accepted here and only failed at
            # step(); refuse it where it is given, as for the defaults.
            g = self.param_groups[-1]
            check_hyperparameters(g["lr"], g["betas"], g["weight_decay"])
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise

    @torch.no_grad()
    def step(self, closure=None):
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
        self.last_stats = run_step(segments, mode=self.mode, votes=self.votes, group=self.group,
                                   backend=self.backend, step=step, nonfinite=self.nonfinite)
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
