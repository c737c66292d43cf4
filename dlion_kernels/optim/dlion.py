"""``DistributedLion``: a ``torch.optim.Optimizer`` around ``fused_dlion_step``."""

from __future__ import annotations

import contextlib

import torch

from ..exchange.buckets import BucketEngine, check_bucket_mb
from ..exchange.checks import (
    check_hyperparameters,
    check_options,
    check_params,
    check_tensors,
)
from ..exchange.pipeline import Exchange, Segment, StepStats, Streams
from ..kernels.layout import block_offsets


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

    ``overlap=True`` groups the parameters into buckets of about ``bucket_mb`` MiB in the order
    their gradients become ready (``exchange/buckets.py``) and starts each bucket's local step
    and exchange during ``backward()``; ``step()`` finishes them and applies. Results are
    bit-identical to ``overlap=False``. Use ``no_sync()`` for every micro-batch but the last
    when accumulating gradients, and do not change gradients between ``backward()`` and
    ``step()`` (the votes were taken during backward).
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
        overlap: bool = False,
        bucket_mb: float = 25.0,
    ):
        check_hyperparameters(lr, betas, weight_decay)
        check_options(mode, votes, backend, nonfinite)
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be True or False, got {overlap!r}")
        check_bucket_mb(bucket_mb)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))
        self.mode, self.votes, self.group = mode, votes, group
        self.backend, self.nonfinite = backend, nonfinite
        self.overlap, self.bucket_mb = overlap, float(bucket_mb)
        self.last_stats: StepStats | None = None
        self._exchange: Exchange | None = None  # this step's exchange, once a bucket started
        self._exchanged: set[int] = set()        # ids of the params exchanged this step
        self._segments: list[Segment] | None = None
        self._streams: Streams | None = None
        self._engine: BucketEngine | None = None
        self._ddp_hooked = False
        if overlap:
            self._build_engine()

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        params = self.param_groups[-1]["params"]
        try:
            check_params(params)
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise
        if getattr(self, "_engine", None) is not None:
            self._build_engine()  # the new parameters need hooks; the order is re-recorded

    # ------------------------------------------------------------------------- buckets

    def _build_engine(self) -> None:
        if self._engine is not None:
            self._engine.remove()
        params = [p for g in self.param_groups for p in g["params"]]
        self._engine = BucketEngine(params, bucket_mb=self.bucket_mb, group=self.group,
                                    on_ready=lambda bucket: self._exchange_bucket(bucket.params))

    def no_sync(self):
        """Inside it, ``backward()`` only accumulates gradients; nothing is exchanged. For
        gradient accumulation with ``overlap=True``: every micro-batch but the last. With
        ``overlap=False`` (nothing is exchanged during backward anyway) it does nothing."""
        if self._engine is None:
            return contextlib.nullcontext()
        return self._engine.no_sync()

    def _start_step(self) -> Exchange:
        """The exchange of this step, created when its first bucket starts."""
        if self._exchange is None:
            self._segments = []
            for g in self.param_groups:
                beta1, beta2 = check_hyperparameters(g["lr"], g["betas"], g["weight_decay"])
                self._segments.append(Segment([], [], [], float(g["lr"]), beta1, beta2,
                                              float(g["weight_decay"])))
            params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
            step = max((self.state[p].get("step", 0) for p in params), default=0)
            device = params[0].device if params else torch.device("cpu")
            if self._streams is None or self._streams.device != device:
                self._streams = Streams(device)
            self._exchange = Exchange(device=device, mode=self.mode, votes=self.votes,
                                      group=self.group, backend=self.backend, step=step,
                                      nonfinite=self.nonfinite, streams=self._streams)
            self._exchanged = set()
        return self._exchange

    def _exchange_bucket(self, params, grads=None) -> None:
        """Start the exchange of one bucket: ``params`` (requires_grad) with ``grads`` (default:
        their ``.grad``), laid out from block 0 in this order."""
        with torch.no_grad():
            ex = self._start_step()
            group_of = self._group_index()
            grads = [p.grad for p in params] if grads is None else list(grads)
            exp_avgs = []
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32,
                                                   device=p.device)
                exp_avgs.append(state["exp_avg"])
            check_tensors(list(params), grads, exp_avgs)
            offsets, blocks = block_offsets(p.numel() for p in params)
            rows = []
            for p, g, m, off in zip(params, grads, exp_avgs, offsets):
                rows.append(ex.row(p, g, m, off, self._segments[group_of[id(p)]]))
                self._exchanged.add(id(p))
            ex.add(rows, blocks)

    def _group_index(self) -> dict[int, int]:
        return {id(p): k for k, g in enumerate(self.param_groups) for p in g["params"]}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._engine is not None:
            self._engine.flush()  # buckets never made ready this step (unused parameters)
        params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        rest = [p for p in params if id(p) not in self._exchanged] if self._exchange else params
        if rest or self._exchange is None:
            self._exchange_bucket(rest)  # without overlap: the whole step is this one bucket
        ex, self._exchange = self._exchange, None
        for seg, g in zip(self._segments, self.param_groups):
            # lr, beta2 and weight_decay are applied now (a scheduler may have changed them)
            _, seg.beta2 = check_hyperparameters(g["lr"], g["betas"], g["weight_decay"])
            seg.lr, seg.weight_decay = float(g["lr"]), float(g["weight_decay"])
        self.last_stats = ex.finish()
        if not self.last_stats.skipped:
            for p in params:
                self.state[p]["step"] = ex.step + 1
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
