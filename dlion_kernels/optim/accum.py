"""``AccumAdamW`` and ``AccumLion`` (Wang et al. 2024, the decentralized-training paper): AdamW
and Lion whose moments take the mean gradient of K steps, so that small local batches of
decentralized training do not feed the moments high-variance gradients. Each step is one fused
multi-tensor kernel per (param group, dtype, device, step count) on the chosen backend
(``kernels/accum.py``).

State per parameter (all fp32, as on every backend): ``step`` (int, counted per parameter; a
parameter whose gradient is ``None`` is skipped and its count does not advance), ``accum`` (a),
``exp_avg`` (m) and, for AccumAdamW, ``exp_avg_sq`` (v). ``state_dict`` / ``load_state_dict``
resume exactly, also for bf16 / fp16 parameters (the fp32 state is not cast to their dtype).

``step(closure=None, *, sources=None)``: ``sources`` (keyword only; a mapping parameter ->
tensor of its shape, dtype and device) makes the step read each listed parameter's x from its
source and write the result to the parameter, in the same fused kernel (the source is not
modified; a source that is its parameter is the plain step). This is how
``DecentralizedDataParallel`` fuses the mixing x = sum_j W_ij x_j into the step: it hands the
received gossip buffer as sources instead of copying it into the parameters first, which saves a
read and a write of the parameters, 2 * itemsize bytes per element (8 for fp32). Parameters
without a gradient are skipped as always: their sources are ignored (not copied). ``step``
keeps torch's signature otherwise, so hooks and LR schedulers see an ordinary step. The class
attribute ``accepts_sources = True`` is what the wrapper looks for.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..exchange.copying import Copyable
from ..kernels import accum as _kernels
from ..kernels.backends import BACKENDS

_STATE_KEYS = ("accum", "exp_avg", "exp_avg_sq")


def _check_common(lr, betas, weight_decay, accum_steps, backend):
    if not isinstance(lr, (int, float)) or not lr >= 0:
        raise ValueError(f"lr must be a number >= 0, got {lr!r}")
    if len(tuple(betas)) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
    if isinstance(accum_steps, bool) or int(accum_steps) != accum_steps or accum_steps < 1:
        raise ValueError(f"accum_steps must be an integer >= 1, got {accum_steps!r}")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")


class _AccumBase(Copyable, torch.optim.Optimizer):
    _has_v = True
    accepts_sources = True  # step(sources=...): DecentralizedDataParallel fuses its mixing

    def __init__(self, params, defaults: dict, backend):
        self.backend = backend
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            _check_common(group["lr"], group["betas"], group["weight_decay"],
                          group["accum_steps"], self.backend)
            for i, p in enumerate(group["params"]):
                if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                    raise TypeError(
                        f"params[{i}] must be float32, bfloat16 or float16, got {p.dtype}"
                    )
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise

    def _buckets(self, group):
        """Parameters with a gradient, by (dtype, device, step count after this step)."""
        out: dict = {}
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise TypeError(f"{type(self).__name__} does not support sparse gradients")
            state = self.state[p]
            if len(state) == 0:
                state["step"] = 0
                for key in _STATE_KEYS[: 3 if self._has_v else 2]:
                    state[key] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            out.setdefault((p.dtype, p.device, state["step"] + 1), []).append(p)
        return out

    def _check_sources(self, sources) -> None:
        """Every source checked before anything runs (so a bad one modifies nothing): keys are
        this optimizer's parameters, values match them and lie apart from everything a step
        writes (every parameter and state tensor) unless they are their own parameter."""
        if not isinstance(sources, Mapping):
            raise TypeError(f"sources must be a mapping parameter -> tensor, got "
                            f"{type(sources).__name__}")
        params = [p for group in self.param_groups for p in group["params"]]
        known = {id(p) for p in params}
        if any(id(k) not in known for k in sources):
            raise ValueError("sources has a key that is not a parameter of this optimizer")
        states = [t for st in self.state.values() for t in st.values()
                  if isinstance(t, torch.Tensor)]
        _kernels.check_sources([sources.get(p) for p in params], params, (states,))

    @torch.no_grad()
    def step(self, closure=None, *, sources=None):
        """One step of every parameter with a gradient. ``sources`` (keyword only): a mapping
        parameter -> tensor whose values the step reads x from (module docstring)."""
        if sources is not None:
            self._check_sources(sources)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for (_, _, t), params in self._buckets(group).items():
                grads = [p.grad if p.grad.is_contiguous() else p.grad.contiguous()
                         for p in params]
                if any(not p.is_contiguous() for p in params):
                    raise ValueError(f"{type(self).__name__} needs contiguous parameters")
                ys = None if sources is None else [sources.get(p) for p in params]
                self._run(group, params, grads, t, ys)
                for p in params:
                    self.state[p]["step"] = t
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        # torch casts floating state to the param's dtype; the state stays fp32 here so that
        # bf16 / fp16 models resume exactly: put the saved fp32 values back afterwards.
        saved = state_dict["state"]
        super().load_state_dict(state_dict)
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params):
            for key in _STATE_KEYS:
                if i in saved and key in saved[i]:
                    self.state[p][key] = saved[i][key].to(
                        device=p.device, dtype=torch.float32, copy=True
                    ).contiguous()
            if i in saved and "step" in saved[i]:
                self.state[p]["step"] = int(saved[i]["step"])


class AccumAdamW(_AccumBase):
    """AdamW with K-step gradient accumulation into the moments:

        x  = x (1 - lr wd) ;  a = a + g / K
        m~ = m + (1 - b1) g ;  v~ = v + (1 - b2) g^2 ;  k = ceil(t / K)
        x  = x - lr / (1 - b1^k) m~ / (sqrt(v~) / sqrt(1 - b2^k) + eps)
        if t mod K == 0:  m = b1 (m + (1 - b1) a) ;  v = b2 (v + (1 - b2) a^2) ;  a = 0

    ``accum_steps=1`` follows ``torch.optim.AdamW`` to within rounding. ``backend``: None (auto:
    ``$DLION_BACKEND`` or the best for the parameters' device), "cuda", "triton", "cpu", "torch".
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, accum_steps: int = 1, *, backend=None):
        _check_common(lr, betas, weight_decay, accum_steps, backend)
        if not eps >= 0:
            raise ValueError(f"eps must be >= 0, got {eps!r}")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                        "accum_steps": int(accum_steps)}
        super().__init__(params, defaults, backend)

    def _run(self, group, params, grads, t, sources):
        st = [self.state[p] for p in params]
        b1, b2 = group["betas"]
        _kernels.adamw(
            params, grads, [s["accum"] for s in st], [s["exp_avg"] for s in st],
            [s["exp_avg_sq"] for s in st], lr=float(group["lr"]), beta1=b1, beta2=b2,
            eps=group["eps"], weight_decay=group["weight_decay"],
            accum_steps=group["accum_steps"], step=t, sources=sources, backend=self.backend,
        )


class AccumLion(_AccumBase):
    """Lion with K-step gradient accumulation into the momentum:

        c = b1 m + (1 - b1) g ;  x = x - lr (sign(c) + wd x) ;  a = a + g / K
        if t mod K == 0:  m = b2 m + (1 - b2) a ;  a = 0

    ``accum_steps=1`` is Lion (``lion_pytorch.Lion`` to within rounding).
    """

    _has_v = False

    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0,
                 accum_steps: int = 1, *, backend=None):
        _check_common(lr, betas, weight_decay, accum_steps, backend)
        defaults = {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay,
                        "accum_steps": int(accum_steps)}
        super().__init__(params, defaults, backend)

    def _run(self, group, params, grads, t, sources):
        st = [self.state[p] for p in params]
        b1, b2 = group["betas"]
        _kernels.lion(
            params, grads, [s["accum"] for s in st], [s["exp_avg"] for s in st],
            lr=float(group["lr"]), beta1=b1, beta2=b2, weight_decay=group["weight_decay"],
            accum_steps=group["accum_steps"], step=t, sources=sources, backend=self.backend,
        )
