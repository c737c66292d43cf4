"""The bucket engine: parameters grouped in the order their gradients become ready, so that work
on a bucket (the D-Lion exchange, a gossip round, an optimizer step) can start during
``backward()`` as soon as the bucket's last gradient is accumulated.

One engine serves every user: ``DistributedLion(overlap=True)``, the decentralized wrapper, and
anything else that wants "call me when these gradients are final, in the same order on every
rank".

Life of an iteration (``flush()`` ends one):

1. First backward: the post-accumulate-grad hooks record the order in which gradients become
   ready on this rank. Nothing is made ready during it (there are no buckets yet).
2. The first ``flush()`` forms the buckets from *rank 0's* order (one broadcast of a permutation,
   once), so buckets are identical on every rank, and then makes every bucket ready in index
   order: the first iteration has no overlap but runs the same code path.
3. Later backwards: when every parameter of bucket k has its gradient and buckets 0..k-1 were
   made ready, ``on_ready(bucket k)`` runs inside the hook, i.e. during backward. Buckets are
   made ready strictly in index order (k+1 waits for k) and once per iteration, so every rank
   issues its collectives in the same order.
4. ``flush()`` (the user of the engine calls it at ``step()``) makes ready every bucket not yet
   made ready this iteration -- parameters that got no gradient (``None``) or that this rank's
   backward did not reach -- in order, then starts a new iteration.

Bucket layout. A bucket holds whole tensors; tensor t of a bucket owns the 32-element blocks
``offsets[t] .. offsets[t] + ceil(numel_t / 32)`` of the bucket's own block space (the layout of
``kernels/layout.py``, restarted at 0 in every bucket). Because every tensor starts on a block
boundary, an element's bit position inside its word is its index inside its tensor mod 32 in
every bucketing, which is what keeps the binary tie rule, and hence the results, identical to a
single bucket. A bucket is closed once it holds at least ``bucket_mb`` MiB of parameter bytes
(like DDP's ``bucket_cap_mb``), so a tensor larger than that is a bucket of its own.

Gradient accumulation: inside ``no_sync()`` nothing is recorded or made ready; gradients just
accumulate. A gradient that arrives for a parameter that was already made ready this iteration
(a second ``backward()`` before ``flush()``, inside ``no_sync()`` or not) raises ``RuntimeError``
from a tensor hook that runs *before* autograd accumulates it, so the gradient that was already
used is not modified. Frozen parameters (``requires_grad=False``) are in no bucket.

Streams. The engine itself launches nothing: ``on_ready`` runs on the autograd thread, with
the stream that produced the gradients as the current stream. What users do with a bucket on the
GPU (``exchange/pipeline.py``): record an event on that stream, make a side stream wait on the
event (not the host), and issue the bucket's kernels and NCCL collectives from the side stream,
so backward keeps computing while the bucket is exchanged. On CPU/gloo the same code runs and the
stream calls are no-ops.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..kernels.layout import block_offsets
from .collectives import collective

_MIB = 1 << 20

# The engine whose hooks a parameter carries: id(param) -> (weakref(param), weakref(engine)).
# Kept here, not on the parameter: a weakref attribute would make the model unpicklable.
_HOOKED: dict[int, tuple] = {}


class WeakHook:
    """A tensor hook that calls ``owner.<method>(*bound, *args)`` while ``owner`` lives, and
    does nothing after.

    A hook stored on a parameter lives in autograd's C++ metadata, where Python's garbage
    collector cannot see it: a hook holding its owner strongly keeps the owner, and through it
    the model and its optimizer state, alive as long as the parameter (an optimizer built per
    run of a sweep leaked a model's worth of memory each time)."""

    __slots__ = ("ref", "method", "bound")

    def __init__(self, owner, method: str, *bound):
        self.ref, self.method, self.bound = weakref.ref(owner), method, bound

    def __call__(self, *args):
        owner = self.ref()
        if owner is not None:
            getattr(owner, self.method)(*self.bound, *args)


def remove_when_collected(obj, handles: list) -> None:
    """Remove ``handles`` (tensor hook handles) once ``obj`` is garbage collected."""
    weakref.finalize(obj, _remove_all, handles)


def _remove_all(handles: list) -> None:
    for h in handles:
        h.remove()
    handles.clear()


@dataclass(eq=False)
class Bucket:
    """A group of parameters made ready together. ``params`` are in ready order (all with
    ``requires_grad``); ``offsets`` are their 32-element block offsets inside the bucket and
    ``blocks`` the bucket's total number of blocks."""

    index: int
    params: list = field(repr=False)
    offsets: list
    blocks: int

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


def check_bucket_mb(bucket_mb) -> float:
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)):
        raise TypeError(f"bucket_mb must be a number of MiB > 0, got {bucket_mb!r}")
    if not bucket_mb > 0 or bucket_mb == float("inf"):
        raise ValueError(f"bucket_mb must be a finite number of MiB > 0, got {bucket_mb!r}")
    return float(bucket_mb)


def form_buckets(params, bucket_mb: float) -> list[Bucket]:
    """Consecutive runs of ``params`` (already in ready order) of at least ``bucket_mb`` MiB
    each (the last may be smaller), with block offsets restarting at 0 in every bucket."""
    cap = check_bucket_mb(bucket_mb) * _MIB
    runs, run, size = [], [], 0
    for p in params:
        run.append(p)
        size += p.numel() * p.element_size()
        if size >= cap:
            runs.append(run)
            run, size = [], 0
    if run:
        runs.append(run)
    buckets = []
    for index, run in enumerate(runs):
        offsets, blocks = block_offsets(p.numel() for p in run)
        buckets.append(Bucket(index, run, offsets, blocks))
    return buckets


class BucketEngine:
    """Calls ``on_ready(bucket)`` during backward as buckets of gradients become final; see the
    module docstring for the iteration protocol.

    params: the parameters (an iterable of tensors; those without ``requires_grad`` are ignored,
        duplicates are kept once). Every rank of ``group`` must pass the same shapes in the same
        order.
    bucket_mb: bucket size in MiB of parameter bytes (> 0).
    group: the process group whose rank 0 decides the ready order (None: the default group if
        initialized, else a single process).
    on_ready: called with each ``Bucket``, once per iteration, in bucket index order.
    on_misuse: None, or called (with no argument) just before a second ``backward()`` is
        refused, so that the user of the engine can complete the collectives it started for
        this iteration (none may be left pending when the error leaves ``backward()``).
    """

    def __init__(self, params, *, bucket_mb: float, group=None,
                 on_ready: Callable[[Bucket], None], on_misuse: Callable[[], None] | None = None):
        self.bucket_mb = check_bucket_mb(bucket_mb)
        if not callable(on_ready):
            raise TypeError(f"on_ready must be callable, got {type(on_ready).__name__}")
        params = list(params)
        for i, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"params[{i}] must be a torch.Tensor, got {type(p).__name__}")
        seen, self.params = set(), []
        for p in params:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self.params.append(p)
        self.group, self.on_ready, self.on_misuse = group, on_ready, on_misuse
        self.buckets: list[Bucket] | None = None
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._order: list[int] = []          # ready order of the recording iteration
        self._done = [False] * len(self.params)  # gradient arrived (and counted) this iteration
        self._bucket_of: list[int] = []
        self._pending: list[int] = []        # gradients still missing, per bucket
        self._next = 0                        # the next bucket to make ready
        self._sync = True
        self._handles = []  # the hooks hold the engine weakly (WeakHook); removed with it
        for i, p in enumerate(self.params):
            self._handles.append(p.register_hook(WeakHook(self, "_before_grad", i)))
            self._handles.append(
                p.register_post_accumulate_grad_hook(WeakHook(self, "_grad_ready", i)))
        remove_when_collected(self, self._handles)
        self.replaced = False  # a newer engine took over these parameters' hooks
        self._take_over()

    def _take_over(self) -> None:
        """One engine per parameter: an older live engine hooking any of these parameters (an
        optimizer built again on the same model, the old one not yet collected) stops. Two
        engines would each exchange a gradient and then see the other's hook as a second
        backward."""
        for key in [k for k, (p, e) in _HOOKED.items() if p() is None or e() is None]:
            del _HOOKED[key]
        for p in self.params:
            previous = _HOOKED.get(id(p))
            engine = previous[1]() if previous is not None and previous[0]() is p else None
            if engine is not None and engine is not self and not engine.replaced:
                engine.stop()
            _HOOKED[id(p)] = (weakref.ref(p), weakref.ref(self))

    def stop(self) -> None:
        """Replaced by a newer engine: the collectives of this iteration's buckets are completed
        (``on_misuse``: none may stay pending on the group), the hooks removed."""
        if self.on_misuse is not None and (self._next > 0 or any(self._done)):
            self.on_misuse()
        self.remove()
        self.replaced = True

    # ------------------------------------------------------------------------- hooks

    def _before_grad(self, i: int, grad) -> None:
        # Runs before autograd accumulates ``grad`` into .grad: raising here leaves the
        # gradient that was already used untouched.
        if self._done[i]:
            if self.on_misuse is not None:
                self.on_misuse()
            raise RuntimeError(
                "a second backward() reached parameters whose gradients were already "
                "exchanged this step; call step() between backward() calls, or run every "
                "micro-batch but the last inside no_sync() to accumulate gradients (nothing "
                "was modified)"
            )

    def _grad_ready(self, i: int, param) -> None:
        if not self._sync:
            return
        self._done[i] = True
        if self.buckets is None:
            self._order.append(i)
            return
        b = self._bucket_of[i]
        self._pending[b] -= 1
        self._advance()

    def _advance(self) -> None:
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            bucket = self.buckets[self._next]
            self._next += 1
            self.on_ready(bucket)

    # ------------------------------------------------------------------------- public

    @property
    def formed(self) -> bool:
        """Whether the buckets exist (after the first ``flush()``)."""
        return self.buckets is not None

    @contextlib.contextmanager
    def no_sync(self):
        """Inside it gradients only accumulate: nothing is recorded or made ready."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def flush(self) -> None:
        """Make ready, in order, every bucket not yet made ready this iteration (the first call
        forms the buckets first), then start a new iteration."""
        if self.buckets is None:
            self._form()
        try:
            for b in range(self._next, len(self.buckets)):
                self._pending[b] = 0
            self._advance()
        finally:
            self._reset()

    def reset(self) -> None:
        """Start a new iteration without making anything ready (the work of this one was given
        up)."""
        if self.buckets is not None:
            self._reset()
        else:
            self._done = [False] * len(self.params)

    def remove(self) -> None:
        """Remove the hooks; the engine makes nothing ready afterwards."""
        _remove_all(self._handles)

    # ------------------------------------------------------------------------- internals

    def _reset(self) -> None:
        self._done = [False] * len(self.params)
        self._pending = [len(b.params) for b in self.buckets]
        self._next = 0

    def _form(self) -> None:
        order = list(dict.fromkeys(self._order))
        # Parameters that got no gradient in the recording iteration: in reverse declaration
        # order, which is roughly the order backward would reach them.
        recorded = set(order)
        order += [i for i in reversed(range(len(self.params))) if i not in recorded]
        order = self._rank0_order(order)
        self.buckets = form_buckets([self.params[i] for i in order], self.bucket_mb)
        self._bucket_of = [0] * len(self.params)
        for bucket in self.buckets:
            for p in bucket.params:
                self._bucket_of[self._index[id(p)]] = bucket.index
        self._reset()

    def _rank0_order(self, order: list[int]) -> list[int]:
        group = self.group
        if group is None:
            if not (dist.is_available() and dist.is_initialized()):
                return order
            group = dist.group.WORLD
        if dist.get_world_size(group) == 1 or not order:
            return order
        device = self.params[0].device
        if "nccl" not in str(dist.get_backend(group)).lower():
            device = torch.device("cpu")
        perm = torch.tensor(order, dtype=torch.int64, device=device)
        # The order is agreed once, at the end of the first backward (the first step).
        collective("broadcast(bucket order)", 1, dist.broadcast, perm,
                   src=dist.get_global_rank(group, 0), group=group,
                   label="first step of the bucket engine, step")
        return perm.tolist()
