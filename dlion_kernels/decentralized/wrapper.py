"""``DecentralizedDataParallel``: the decentralized training of Wang et al. (arXiv 2410.11998)
with a full iteration of overlap, on the one bucket engine (``exchange/buckets.py``).

Iteration t on rank i, per bucket, in the bucket's post-accumulate-grad hook (during backward):

1. wait for the bucket's gossip launched at iteration t-1 (it ran during this iteration's forward
   and backward);
2. mix: x = sum_j W_ij(t-1) x_j (equal weights 1/|group| inside this rank's group);
3. the bucket's optimizer step with the gradient taken at the un-mixed point;
4. launch this iteration's gossip: ``all_reduce`` (async) of the bucket's flat parameters on the
   topology's subgroup for step t.

So y_i(t+1) = sum_j W_ij(t) y_j(t) - step_i(grad f_i(y_i(t))), and the mean over ranks moves by
exactly the mean step (W is doubly stochastic). The parameters of a bucket live in one flat
buffer per dtype (the parameters are views into it), so a gossip is one collective per bucket and
dtype, with no copy-in besides the send buffer.

There is no ``optimizer.step()`` call: ``loss.backward()`` does everything; the end of backward
(an autograd callback) flushes the engine (buckets whose gradients did not all arrive, the first
iteration's buckets) and advances t.

Fused mixing: steps 2 and 3 are one pass when the bucket's optimizer accepts sources
(``dk.AccumAdamW`` / ``dk.AccumLion``: class attribute ``accepts_sources``) and the gossip is in
the parameters' own dtype (``gossip_dtype`` "fp32"/None). The received buffer already holds the
mixed parameters, so instead of copying it into them (a read of 4 and a write of 4 bytes per
fp32 element, 2 * itemsize in general) its views are handed to ``optimizer.step(sources=...)``,
whose kernel reads x from them and writes the stepped x to the parameters. The results are bit
for bit those of copy-then-step. Parameters of the bucket without a gradient (skipped by the
step) still get the copy. Any other optimizer, bf16 gossip, ``synchronize()`` and a bucket
with no gossip in flight take the copy path.

Failures. Every collective goes through ``exchange/collectives.py``: a peer that dies or stalls
makes the wait for a gossip (during ``backward()``, or in ``synchronize()``) or the global
average raise ``DistributedStepError`` naming the iteration and the collective
(``all_reduce(gossip, bucket k)``, ``all_reduce(global average)``). Per bucket nothing is
half-done: a bucket's gossip buffers are all waited for before any parameter of the bucket is
mixed, so at the error buckets 0..k-1 have finished iteration t (mixed and stepped) and buckets
k.. are exactly as before it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..accounting import BUCKET_MB, gossip_bytes_per_step
from ..exchange.buckets import Bucket, BucketEngine, WeakHook, remove_when_collected
from ..exchange.collectives import DistributedStepError, as_timedelta, collective, wait
from ..exchange.groups import retire
from .topology import Topology

_GOSSIP_DTYPES = {None: None, "fp32": None, "bf16": torch.bfloat16}
_LABEL = "decentralized iteration"


class _BucketState:
    """A bucket's flat storage, optimizer, scheduler and in-flight gossip."""

    def __init__(self, bucket: Bucket, names: list[str]):
        self.bucket = bucket
        self.names = names
        self.flats: dict = {}  # dtype -> flat parameter storage (the params are views into it)
        self.sends: dict = {}  # dtype -> send/receive buffer of the gossip
        self.works: list = []
        self.launched = -1     # the iteration whose gossip is in flight
        self.weight = 1.0      # 1 / |group| of the gossip in flight
        self.optimizer = None
        self.scheduler = None
        # fused mixing (module docstring): param -> its view of the received buffer, and the
        # ids of the params the optimizer owns; empty when the bucket cannot fuse
        self.recv_views: dict = {}
        self.owned: set = set()


class DecentralizedDataParallel(torch.nn.Module):
    """Decentralized data-parallel training.

    module: the model (its parameters must start identical on every rank only if you want a
        consensus start; each rank keeps its own copy and they drift apart between mixings).
    optimizer_fn: ``params -> torch.optim.Optimizer``, called once per bucket with the bucket's
        parameters (any torch optimizer; ``dk.AccumAdamW`` / ``dk.AccumLion`` are fused).
    topology: "complete" | "ring" | "one-peer-exp" | "alternating-exp-ring" (see topology.py;
        the last reads ``LOCAL_WORLD_SIZE``, or pass ``local_world_size``).
    bucket_mb: bucket size in MiB (as DDP's ``bucket_cap_mb``).
    group: the process group (None: the default group).
    lr_scheduler_fn: ``optimizer -> LRScheduler`` per bucket, stepped after each bucket step.
    max_grad_norm: if set, every rank clips its own gradient to this global 2-norm over all its
        parameters before stepping. The norm needs every gradient, so the buckets' optimizer
        steps then run at the end of backward (gossip still overlaps the next iteration).
    gossip_dtype: "fp32" (default) or "bf16": the gossip sends bf16, halving the bytes; the
        mixing and the update stay fp32: x = w x + (S - bf16(w x)), where S is the bf16 sum over
        the group, so only the neighbours' contributions are rounded (relative 2^-9 per mixing)
        and the mean over ranks is kept only to within that rounding.
    timeout: None (the process groups' own timeouts; the topology's subgroups get the default
        group's) or seconds / a ``timedelta``: the longest any one wait for a collective may take
        (gossip, ``synchronize()``, ``global_average()``), also given to the subgroups the
        topology creates. A dead or stalled peer raises ``DistributedStepError`` naming the
        iteration and the collective (see the module docstring for what was applied).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer_fn: Callable,
        topology: str = "complete",
        bucket_mb: float = BUCKET_MB,
        group=None,
        lr_scheduler_fn: Callable | None = None,
        *,
        max_grad_norm: float | None = None,
        gossip_dtype: str | None = None,
        local_world_size: int | None = None,
        timeout=None,
    ):
        super().__init__()
        if not callable(optimizer_fn):
            raise TypeError("optimizer_fn must be callable: params -> torch.optim.Optimizer")
        if lr_scheduler_fn is not None and not callable(lr_scheduler_fn):
            raise TypeError("lr_scheduler_fn must be None or callable: optimizer -> scheduler")
        if gossip_dtype not in _GOSSIP_DTYPES:
            raise ValueError(f"gossip_dtype must be 'fp32', 'bf16' or None, got {gossip_dtype!r}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be None or > 0, got {max_grad_norm!r}")
        self.timeout = as_timedelta(timeout)
        self.module = module
        self.topology = Topology(topology, group, local_world_size, self.timeout)
        self.group = group
        self.optimizer_fn, self.lr_scheduler_fn = optimizer_fn, lr_scheduler_fn
        self.max_grad_norm = max_grad_norm
        self.gossip_dtype = _GOSSIP_DTYPES[gossip_dtype]
        self.iteration = 0
        self._names = {id(p): n for n, p in module.named_parameters()}
        self._states: dict[int, _BucketState] = {}
        self._deferred: list[Bucket] = []
        self._callback_queued = False
        self._syncing = True
        self._pending_load: dict | None = None
        self._fuse_mixing = True  # False: always copy, then step (tests compare the two paths)
        self.bytes_sent = 0  # gossip bytes this rank sent (ring all-reduce accounting)
        self._engine = BucketEngine(
            [p for p in module.parameters() if p.requires_grad], bucket_mb=bucket_mb,
            group=group, on_ready=self._on_ready,
        )
        self._handles = [p.register_post_accumulate_grad_hook(
            WeakHook(self, "_queue_end_of_backward")) for p in self._engine.params]
        remove_when_collected(self, self._handles)

    # ------------------------------------------------------------------------- module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation: backward passes inside only accumulate gradients."""
        previous, self._syncing = self._syncing, False
        with self._engine.no_sync():
            try:
                yield
            finally:
                self._syncing = previous

    # ------------------------------------------------------------------------- per bucket

    def _queue_end_of_backward(self, _param) -> None:
        if self._syncing and not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self._engine.flush()
        if self._deferred:
            buckets, self._deferred = self._deferred, []
            self._clip([p for b in buckets for p in b.params])
            for b in buckets:
                self._process(b)
        self.iteration += 1

    def _on_ready(self, bucket: Bucket) -> None:
        if self.max_grad_norm is not None:
            self._deferred.append(bucket)  # the global norm needs every gradient first
        else:
            self._process(bucket)

    def _state(self, bucket: Bucket) -> _BucketState:
        st = self._states.get(bucket.index)
        if st is None:
            st = _BucketState(bucket, [self._names.get(id(p), "?") for p in bucket.params])
            self._flatten(st)
            st.optimizer = self.optimizer_fn(list(bucket.params))
            if getattr(st.optimizer, "accepts_sources", False):
                st.owned = {id(p) for g in st.optimizer.param_groups for p in g["params"]}
            if st.owned and self.gossip_dtype is None:
                for p in bucket.params:
                    flat = st.flats[p.dtype]
                    offset = p.data_ptr() - flat.data_ptr()
                    start = offset // flat.element_size()
                    st.recv_views[p] = st.sends[p.dtype][start : start + p.numel()].view_as(p)
            if self.lr_scheduler_fn is not None:
                st.scheduler = self.lr_scheduler_fn(st.optimizer)
            self._states[bucket.index] = st
            if self._pending_load is not None:
                self._load_bucket(st)
        return st

    @torch.no_grad()
    def _flatten(self, st: _BucketState) -> None:
        """Move the bucket's parameters into one flat buffer per dtype (params become views)."""
        by_dtype: dict = {}
        for p in st.bucket.params:
            by_dtype.setdefault(p.dtype, []).append(p)
        for dtype, params in by_dtype.items():
            flat = torch.empty(sum(p.numel() for p in params), dtype=dtype,
                               device=params[0].device)
            offset = 0
            for p in params:
                n = p.numel()
                flat[offset : offset + n].copy_(p.detach().reshape(-1))
                p.data = flat[offset : offset + n].view_as(p)
                offset += n
            st.flats[dtype] = flat
            send_dtype = self.gossip_dtype or dtype
            st.sends[dtype] = torch.empty(flat.numel(), dtype=send_dtype, device=flat.device)

    @torch.no_grad()
    def _process(self, bucket: Bucket) -> None:
        st = self._state(bucket)
        if st.works and st.recv_views and self._fuse_mixing:
            self._wait(st)
            # mixing fused into the step: x = step(recv) written to x; no copy of recv first
            sources = {}
            for p, view in st.recv_views.items():
                if p.grad is not None and id(p) in st.owned:
                    sources[p] = view
                else:
                    p.copy_(view)  # not stepped: still mixed
            st.optimizer.step(sources=sources)
        else:
            self._mix(st)
            st.optimizer.step()
        if st.scheduler is not None:
            st.scheduler.step()
        # The gradient is consumed (there is no optimizer.step() / zero_grad() for the user to
        # call): the next backward starts from None, as after zero_grad(set_to_none=True).
        for p in bucket.params:
            p.grad = None
        self._launch(st)

    @torch.no_grad()
    def _launch(self, st: _BucketState) -> None:
        ranks, pg = self.topology.group_at(self.iteration)
        if pg is None:
            return
        st.weight = 1.0 / len(ranks)
        st.launched = self.iteration
        index = st.bucket.index
        for dtype, flat in st.flats.items():
            send = st.sends[dtype]
            if send.dtype == flat.dtype:
                torch.mul(flat, st.weight, out=send)
            else:
                send.copy_(flat.float() * st.weight)
            st.works.append(collective(
                f"all_reduce(gossip, bucket {index})", self.iteration, dist.all_reduce, send,
                group=pg, async_op=True, label=_LABEL,
                applied=f"bucket {index} of this rank finished this iteration, later buckets "
                "did not"))
            k = len(ranks)
            self.bytes_sent += int(gossip_bytes_per_step(send.numel(), send.element_size(), k))

    def _wait(self, st: _BucketState, where: str = "this iteration") -> None:
        k = st.bucket.index
        try:
            for w in st.works:  # every buffer of the bucket before any parameter changes
                wait(w, self.iteration, f"all_reduce(gossip, bucket {k})", self.timeout,
                     label=_LABEL,
                     applied=f"the gossip was launched at iteration {st.launched}; buckets "
                     f"before bucket {k} of this rank finished {where}, bucket {k} and later "
                     "ones are exactly as before it")
        except DistributedStepError:
            # work may be left pending on the topology's groups: they are made again, not reused
            retire(*self.topology.groups())  # (groups the cache never held: no-op)
            raise
        st.works = []

    @torch.no_grad()
    def _mix(self, st: _BucketState, where: str = "this iteration") -> None:
        if not st.works:
            return
        self._wait(st, where)
        for dtype, flat in st.flats.items():
            recv = st.sends[dtype]
            if self.gossip_dtype is None:
                flat.copy_(recv)  # the group's weighted sum: sum_j x_j / |group|
            else:
                # Replace this rank's own rounded contribution by its exact value, in fp32.
                own = flat.float() * st.weight
                flat.copy_(own + (recv.float() - own.to(self.gossip_dtype).float()))

    def _clip(self, params) -> None:
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return
        norm = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
        scale = self.max_grad_norm / (float(norm) + 1e-6)
        if scale < 1.0:
            torch._foreach_mul_(grads, scale)

    # ------------------------------------------------------------------------- public

    @torch.no_grad()
    def synchronize(self) -> None:
        """Wait for every bucket's outstanding gossip and mix it in (one mixing of the topology:
        the parameters change, their sum over ranks does not). Call it before evaluation or a
        checkpoint; the next iteration then has nothing to mix."""
        for i in sorted(self._states):
            self._mix(self._states[i], "synchronize()")

    @contextlib.contextmanager
    def global_average(self):
        """Parameters temporarily replaced by their mean over all ranks (after
        ``synchronize()``); each rank's own parameters come back bit for bit on exit."""
        self.synchronize()
        params = [p for p in self.module.parameters()]
        saved = [p.detach().clone() for p in params]
        n = dist.get_world_size(self.group) if dist.is_initialized() else 1
        try:
            with torch.no_grad():
                if n > 1:
                    flat = torch.cat([p.detach().reshape(-1).double() for p in params])
                    collective("all_reduce(global average)", self.iteration, dist.all_reduce,
                               flat, group=self.group, timeout=self.timeout, label=_LABEL,
                               applied="this rank's own parameters are back as they were")
                    flat /= n
                    offset = 0
                    for p in params:
                        p.copy_(flat[offset : offset + p.numel()].view_as(p))
                        offset += p.numel()
            yield self
        finally:
            with torch.no_grad():
                for p, s in zip(params, saved):
                    p.copy_(s)

    @property
    def optimizers(self) -> list:
        """The buckets' optimizers, in bucket order (empty before the first backward)."""
        return [self._states[i].optimizer for i in sorted(self._states)]

    def optimizer_state_dict(self) -> dict:
        """Every bucket's optimizer and scheduler state, the bucket layout (parameter names) and
        the iteration (the topology's phase). Call ``synchronize()`` first: in-flight gossip is
        not part of the state."""
        if any(st.works for st in self._states.values()):
            raise RuntimeError("gossip is in flight: call synchronize() before saving the state")
        return {
            "iteration": self.iteration,
            "buckets": [
                {
                    "names": st.names,
                    "optimizer": st.optimizer.state_dict(),
                    "scheduler": None if st.scheduler is None else st.scheduler.state_dict(),
                }
                for st in (self._states[i] for i in sorted(self._states))
            ],
        }

    def load_optimizer_state_dict(self, state_dict: dict) -> None:
        """Restore ``optimizer_state_dict()``'s state (exact resume). Before the first backward
        the state is kept and applied to each bucket when it is formed; the bucket layout must
        match the saved one (same model, same bucket_mb) or ValueError is raised then."""
        if not isinstance(state_dict, dict) or "buckets" not in state_dict:
            raise ValueError("state_dict must come from optimizer_state_dict()")
        self.iteration = int(state_dict["iteration"])
        self._pending_load = {i: b for i, b in enumerate(state_dict["buckets"])}
        for st in self._states.values():
            self._load_bucket(st)

    def _load_bucket(self, st: _BucketState) -> None:
        saved = self._pending_load.pop(st.bucket.index, None)
        if saved is None:
            raise ValueError(f"the saved state has no bucket {st.bucket.index}")
        if saved["names"] != st.names:
            raise ValueError(
                f"bucket {st.bucket.index} holds {st.names}, the saved state {saved['names']}: "
                "resume with the same model and bucket_mb"
            )
        st.optimizer.load_state_dict(saved["optimizer"])
        if st.scheduler is not None and saved["scheduler"] is not None:
            st.scheduler.load_state_dict(saved["scheduler"])
        if not self._pending_load:
            self._pending_load = None

    def remove(self) -> None:
        """Finish outstanding gossip and remove the hooks."""
        self.synchronize()
        self._engine.remove()
        for h in self._handles:
            h.remove()
        self._handles = []


__all__ = ["DecentralizedDataParallel"]
