"""``Built``: one named strategy on one rank, as ``build`` returns it: what to call, what to
step, and the bytes each step sent, the memory it holds and the context to evaluate in."""

from __future__ import annotations

import contextlib

from ..exchange.sharded import memory_per_rank
from ..strategies import Strategy


class Built:
    """One strategy on one rank. ``module`` is what to call (the model, or DDP / the gossip
    wrapper around it), ``optimizer`` the optimizer to step (None when the wrapper steps during
    backward), ``stats`` the last ``StepStats`` of a D-Lion step (else None)."""

    def __init__(self, strategy: Strategy, model, module, optimizer, sent, source: str, *,
                 after_step=None, finish=None, evaluation=None, extra_state=None):
        self.strategy, self.model, self.module, self.optimizer = strategy, model, module, optimizer
        self._sent = sent  # () -> (bytes this step, bytes to other nodes or None)
        self.bytes_source = source  # where the byte counts come from
        self._after_step = after_step  # () -> None: after the optimizer (DiLoCo's outer step)
        self._finish = finish  # () -> None: end outstanding communication
        self._evaluation = evaluation  # () -> the context to evaluate in
        self._extra_state = extra_state  # () -> state bytes held outside the optimizer (DiLoCo)
        self.bytes_total = self.steps = 0
        self.inter_node_bytes = None  # of the last step (None: the strategy has no nodes)
        self._inter_node_total = 0

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def zero_grad(self) -> None:
        (self.optimizer or self.module).zero_grad(set_to_none=True)

    def step(self) -> int:
        """After ``loss.backward()``: the update (the exchange it still owes first); returns
        the bytes this rank sent in this step."""
        if self.optimizer is not None:
            self.optimizer.step()
        if self._after_step is not None:
            self._after_step()
        sent, self.inter_node_bytes = self._sent()
        self.bytes_total += sent
        self._inter_node_total += self.inter_node_bytes or 0
        self.steps += 1
        return sent

    @property
    def stats(self):
        """The last D-Lion ``StepStats`` when the byte counts come from them, else None (the
        Lion of an all-reduce strategy steps on a group of one: its stats count no bytes)."""
        return self.optimizer.last_stats if self.bytes_source.startswith("StepStats") else None

    def memory(self) -> dict:
        """Bytes this rank holds now for parameters, gradients and optimizer state, counted
        from the tensors (``exchange.sharded.memory_per_rank``: a DTensor counts its local
        shard) over the optimizer, or the gossip wrapper's optimizers; DiLoCo's theta_bar and
        outer momenta count as optimizer state."""
        opts = [self.optimizer] if self.optimizer is not None else self.module.optimizers
        counts = [memory_per_rank(o) for o in opts]
        out = {k: sum(c[k] for c in counts) for k in ("params", "grads", "optimizer_state")}
        if self._extra_state is not None:
            out["optimizer_state"] += self._extra_state()
        return out

    @property
    def bytes_per_step(self) -> int:
        """Mean bytes sent per step (alternating-exp-ring's groups change size step to step)."""
        return round(self.bytes_total / self.steps) if self.steps else 0

    @property
    def inter_node_bytes_per_step(self) -> int | None:
        """Mean bytes sent to other nodes per step (DiLoCo's only at its syncs), or None."""
        if self.inter_node_bytes is None or not self.steps:
            return None
        return round(self._inter_node_total / self.steps)

    def finish(self) -> None:
        """End outstanding communication (the last iteration's gossip)."""
        if self._finish is not None:
            self._finish()

    def evaluation(self):
        """The context to evaluate in: for ranks that hold different parameters (gossip), their
        average over all ranks; otherwise nothing to do."""
        return self._evaluation() if self._evaluation is not None else contextlib.nullcontext()
