"""One training run of the scaling studies: a method, a task, k simulated workers, an lr, a
seed and a budget, on ``dlion_kernels.simulate`` (the library's kernel stages for the k workers)
and ``torch.func`` (every worker's gradient in one vectorized pass).

Methods (``METHODS``):

- per step, on the global batch of every step:
  - ``adamw``: AdamW on the workers' mean gradient (the fp32 all-reduce; here the gradient of
    the global batch's mean loss, which is that mean up to rounding), bytes of the ring
    all-reduce 2 (k-1)/k 4d per step;
  - ``lion``: Lion on the same mean gradient (a Lion job's all-reduce: the same bytes);
  - ``dlion-<mode>-<votes>``: ``SimulatedDLion`` (D-Lion: each worker its own momentum and
    votes), mode vote/average, votes binary/ternary, the exchange's bytes per step;
- DiLoCo (``SimulatedDiLoCo``), every worker AdamW inner steps on its share (the task's inner
  lr and weight decay), a sync every H steps:
  - ``nesterov``: DiLoCo's fp32 all-reduce and Nesterov (momentum 0.9);
  - ``sparseloco``: SparseLoCo at its defaults (C = 4096, k = 64, beta 0.95);
  - ``dlion``: the plain 1-bit vote (vote/binary); ``dlion-ef``: with error feedback;
    ``dlion-ef-decay-<g>``: error feedback decayed by g per sync; ``dlion-avg-ef-decay-<g>``:
    the same with ``mode="average"``.

Gradients of k workers: ``vmap(grad(loss))`` over the k shares of the global batch, on the
shared parameters (per-step methods) or on k stacked copies (DiLoCo, whose workers differ
between syncs); the inner AdamW is one ``torch.optim.AdamW`` over the stacked copies (it is
elementwise: k independent AdamWs). So a run's cost grows with k only through the optimizer
state (k momenta, k copies), not through the forward and backward passes.

``run(cfg)`` returns the run's record: the final validation loss of the synced parameters
(theta_bar for DiLoCo), the curve (step, bytes sent per rank so far, validation loss) every
``eval_every`` steps, the bytes per step or sync, whether it diverged, and its wall time.
"""

from __future__ import annotations

import math
import time

import torch
from torch.func import functional_call, grad, vmap

import sim_tasks
from dlion_kernels.accounting import ring_all_reduce_bytes
from dlion_kernels.exchange.pipeline import NonFiniteGradientError
from dlion_kernels.simulate import SimulatedDiLoCo, SimulatedDLion

PER_STEP = ("adamw", "lion", "dlion-vote-binary", "dlion-vote-ternary", "dlion-average-binary",
            "dlion-average-ternary")
LOCAL_FIXED = ("nesterov", "sparseloco", "dlion", "dlion-ef")
BETAS = (0.9, 0.99)  # Lion's, D-Lion's and the D-Lion outer step's
NESTEROV_MOMENTUM = 0.9


def is_per_step(method: str) -> bool:
    return method in PER_STEP


def is_method(method: str) -> bool:
    if method in PER_STEP or method in LOCAL_FIXED:
        return True
    return _decay(method) is not None


def _decay(method: str):
    for prefix in ("dlion-ef-decay-", "dlion-avg-ef-decay-"):
        if method.startswith(prefix):
            try:
                g = float(method[len(prefix):])
            except ValueError:
                return None
            return g if 0 < g <= 1 else None
    return None


def outer_settings(method: str) -> dict:
    """``SimulatedDiLoCo``'s (and ``dk.DiLoCo``'s) keyword arguments of a DiLoCo method."""
    if method == "nesterov":
        return dict(outer="nesterov", outer_momentum=NESTEROV_MOMENTUM)
    if method == "sparseloco":
        return dict(outer="sparseloco")
    if method == "dlion":
        return dict(outer="dlion", outer_betas=BETAS, outer_options={})  # the plain step
    if method == "dlion-ef":
        return dict(outer="dlion", outer_betas=BETAS, outer_options=dict(error_feedback=True))
    g = _decay(method)
    mode = "average" if method.startswith("dlion-avg") else "vote"
    return dict(outer="dlion", outer_betas=BETAS, mode=mode,
                outer_options=dict(error_feedback=True, ef_decay=g))


def run(cfg: dict, device: str = "cpu") -> dict:
    """One run (``cfg``: task, method, k, H (0 per step), lr, seed, steps, eval_every)."""
    task = sim_tasks.TASKS[cfg["task"]].load()
    method, k, H, lr, seed = cfg["method"], cfg["k"], cfg["H"], cfg["lr"], cfg["seed"]
    steps, eval_every = cfg["steps"], cfg["eval_every"]
    dev = torch.device(device)
    model = task.make_model(seed).to(dev)
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    d = sum(p.numel() for p in model.parameters())
    B = task.batch
    if B % k:
        raise ValueError(f"the global batch ({B}) must split into k = {k} equal shares")
    starts = task.batch_starts(seed, steps)
    vx, vy = (t.to(dev) for t in task.val_batch())

    def loss(params: dict, x, y):
        return sim_tasks.loss_of(functional_call(model, params, (x,)), y)

    def evaluate(params: dict) -> float:
        with torch.no_grad():
            return loss(params, vx, vy).item()

    per_step = is_per_step(method)
    curve, sent, diverged = [], 0, False
    tic = time.perf_counter()
    if per_step:
        shared = {n: p.detach().clone() for n, p in model.named_parameters()}
        params = list(shared.values())
        per_step_bytes = round(ring_all_reduce_bytes(k, 4 * d))
        if method == "adamw":
            opt = torch.optim.AdamW(params, lr=lr, weight_decay=task.weight_decay,
                                    fused=True)
        elif method == "lion":  # Lion = D-Lion with one voter and ternary votes
            opt = SimulatedDLion(params, 1, lr=lr, betas=BETAS, weight_decay=task.weight_decay,
                                 mode="vote", votes="ternary")
        else:
            _, mode, votes = method.split("-")
            opt = SimulatedDLion(params, k, lr=lr, betas=BETAS, weight_decay=task.weight_decay,
                                 mode=mode, votes=votes)
        one = grad(loss)
        shares = vmap(grad(loss), in_dims=(None, 0, 0))
        for t in range(steps):
            x, y = (v.to(dev) for v in task.inputs(task.train, starts[t]))
            if method in ("adamw", "lion"):
                g = one(shared, x, y)
                if method == "adamw":
                    for p, n in zip(params, names):
                        p.grad = g[n]
                    opt.step()
                else:
                    if not all(torch.isfinite(g[n]).all() for n in names):
                        diverged = True
                        break
                    opt.step([[g[n] for n in names]])
                sent += per_step_bytes
            else:
                g = shares(shared, x.view(k, B // k, *x.shape[1:]),
                           y.view(k, B // k, *y.shape[1:]))
                try:
                    stats = opt.step([[g[n][w] for n in names] for w in range(k)])
                except NonFiniteGradientError:
                    diverged = True
                    break
                sent += stats.bytes_sent
                per_step_bytes = stats.bytes_sent
            if (t + 1) % eval_every == 0:
                v = evaluate(shared)
                curve.append((t + 1, sent, v))
                if not math.isfinite(v):
                    diverged = True
                    break
        final_params = shared
        per_sync = per_step_bytes
        syncs = steps
    else:
        stacked = {n: p.detach().unsqueeze(0).repeat(k, *([1] * p.dim())).requires_grad_()
                   for n, p in model.named_parameters()}
        leaves = list(stacked.values())
        inner = torch.optim.AdamW(leaves, lr=task.inner_lr, weight_decay=task.weight_decay,
                                  fused=True)
        sim = SimulatedDiLoCo(stacked=leaves, sync_every=H, outer_lr=lr,
                              outer_weight_decay=0.0, **outer_settings(method))
        shares = vmap(grad(loss), in_dims=(0, 0, 0))
        views = {n: p.detach() for n, p in stacked.items()}
        for t in range(steps):
            x, y = (v.to(dev) for v in task.inputs(task.train, starts[t]))
            g = shares(views, x.view(k, B // k, *x.shape[1:]), y.view(k, B // k, *y.shape[1:]))
            for n, p in stacked.items():
                p.grad = g[n]
            inner.step()
            try:
                stats = sim.step()
            except NonFiniteGradientError:
                diverged = True
                break
            if stats is not None:
                sent += stats.bytes_sent
            if (t + 1) % eval_every == 0:
                v = evaluate(dict(zip(names, sim.theta_bar_views())))
                curve.append((t + 1, sent, v))
                if not math.isfinite(v):
                    diverged = True
                    break
        final_params = dict(zip(names, sim.theta_bar_views()))
        per_sync = None if sim.last_stats is None else sim.last_stats.bytes_sent
        syncs = steps // H
    wall = time.perf_counter() - tic
    final = float("inf") if diverged else evaluate(final_params)
    if not math.isfinite(final):
        diverged, final = True, float("inf")
    return dict(cfg, val_loss=final, diverged=diverged, curve=curve, bytes_total=sent,
                bytes_per_sync=per_sync, syncs=syncs, numel=d, tensors=len(shapes),
                tokens=steps * B * task.tokens_per_window, wall_s=wall,
                step_ms=1e3 * wall / max(1, steps))
