"""``DistributedLion``: a ``torch.optim.Optimizer`` around ``fused_dlion_step``."""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist

from ..exchange import agree, sharded
from ..exchange import hierarchy as hier
from ..exchange.buckets import BucketEngine, WeakHook, check_bucket_mb, remove_when_collected
from ..exchange.checks import (
    check_hyperparameters,
    check_options,
    check_params,
    check_tensors,
)
from ..exchange.collectives import DistributedStepError, as_timedelta
from ..exchange.copying import Copyable, attached_group
from ..exchange.header import StepMismatchError
from ..exchange.pipeline import Exchange, Segment, StepStats, Streams, resolve_group
from ..kernels.layout import block_offsets
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


# What every rank of a DistributedLion must share at construction (the last: the weights)
_START_FACTS = ("mode", "votes", "nonfinite", "(overlap, bucket_mb)", "hierarchy",
                "param groups (lr, betas, weight_decay, number of params)",
                "parameters (shape, dtype, requires_grad)", "local shard shapes",
                "group sizes", "the parameters")


def _tensors(params) -> list:
    """The tensors of ``params`` (tensors or param group dicts), or [] when unreadable."""
    try:
        out = []
        for x in params:
            x = x.get("params") if isinstance(x, dict) else x
            out += [x] if isinstance(x, torch.Tensor) else list(x)
        return out
    except Exception:  # the start check reports it (torch.optim's own message)
        return []


def _listed_group(x):
    """A param group dict whose "params" is a generator, with them as a list (else ``x``)."""
    if isinstance(x, dict) and not isinstance(x.get("params"), (torch.Tensor, list, tuple)):
        try:
            return {**x, "params": list(x["params"])}
        except TypeError:  # not iterable: torch.optim's own check reports it
            return x
    return x


def _any_dtensor(params) -> bool:
    return any(sharded.is_dtensor(p) for p in _tensors(params))


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

    ``overlap=True`` groups the parameters into buckets of about ``bucket_mb`` MiB in the order
    their gradients become ready (``exchange/buckets.py``) and starts each bucket's local step
    and exchange during ``backward()``; ``step()`` finishes them and applies. Results are
    bit-identical to ``overlap=False``. Use ``no_sync()`` for every micro-batch but the last
    when accumulating gradients, and do not change gradients between ``backward()`` and
    ``step()`` (the votes were taken during backward).
    Overlap with AMP: the votes are taken during backward, so fp16 ``GradScaler`` (scaled
    gradients) cannot be combined with ``overlap=True`` or the DDP comm hook and raises
    ``ValueError`` at ``step()``; bf16 autocast needs no scaler and works.

    Ranks on different steps (e.g. one rank resumed from another checkpoint) raise
    ``StepMismatchError`` on every rank, naming both step numbers; nothing is modified.

    One decision at construction and at ``load_state_dict`` (``exchange/agree.py``): each rank
    checks its arguments and state without raising, then one small all_gather (two with FSDP2:
    the replicate group, then the shard group) shows every rank every rank's problem and a
    digest of its arguments and starting parameters (FSDP2: of its local shards, compared
    between the replicas of each shard); every rank then raises the same error, naming the
    ranks and the values, or proceeds. A loaded state of another step count on any rank raises
    ``StepMismatchError`` everywhere; nothing is built or loaded on any rank.

    Host syncs on CUDA: with ``nonfinite="raise"`` a step reads the ranks' headers once (to
    raise). With ``nonfinite="skip"`` or a GradScaler it reads nothing: the decision is settled
    later, at the next ``step()``, ``state_dict()``, or when ``last_stats`` is read. Until then a
    step's counters (``state[p]["step"]``) count it as taken, and a step mismatch raises there
    (at the next step, naming the mismatched one; the mismatched step changed nothing).

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

    ``hierarchy`` ("node" or an int L; None = flat): hierarchical D-Lion over nodes of L ranks
    (``exchange/hierarchy.py``): exact gradient mean inside a node, the nodes vote. Each rank then
    keeps momentum only for its shard, ~1/L of the elements: ``state[p]["exp_avg"]`` is 1-D and
    covers elements ``state[p]["exp_avg_range"]`` of ``p``; resume needs the same n and L. fp16
    ``GradScaler`` works as in the flat case (one overflow decision for all n ranks).
    With ``overlap=True`` each bucket's hierarchical phases run during backward
    (``hierarchy.OverlapStep``), bit-identical to ``overlap=False``; the momentum shards then
    follow the buckets, so resume also needs the same ``overlap`` and ``bucket_mb`` (else
    ``ValueError`` at the first step); fp16 ``GradScaler`` raises as with flat overlap.
    ``hierarchy="auto"`` with ``overlap=True`` raises ``ValueError``.

    ``device_mesh`` (``docs/fsdp.md``): the parameters are FSDP2's DTensors, sharded
    by ``fully_shard(module, mesh=mesh["shard"])``; the mesh's "replicate" dimension (else its
    first) holds the N replicas of each shard, the voters. Each rank runs the step on its local
    shards (``exchange/sharded.py``): local step, the exchange in its replicate group, apply to
    the local tensors in place (the parameters stay the DTensors FSDP2 manages; nothing is
    gathered). ``state[p]["exp_avg"]`` is an fp32 DTensor of global shape (N, *p.shape), replica
    i's momentum in row i, created at construction (so ``torch.distributed.checkpoint`` keeps
    every replica's momentum and never has to run a step to create the state). A 1-D mesh is
    N = 1; without ``device_mesh`` the replicate group is ``group`` (None: N = 1, the parameters
    sharded over every rank). One skip/raise decision for all n ranks (``ShardAgreement``);
    ``last_stats`` is a ``ShardedStepStats`` (intra- and inter-node bytes). ``overlap=True``
    starts a bucket's vote when FSDP2 has reduced its gradients (buckets are sized by the
    parameters' full size, the same on every rank); accumulate with FSDP2's
    ``model.set_requires_gradient_sync(False)``. A second reduce of a gradient already exchanged
    in the step makes ``step()`` raise ``RuntimeError`` with nothing modified. ``hierarchy`` does
    not apply (the shard dimension is the node) and raises ``ValueError``.

    Failures: a peer rank that dies or stalls makes ``step()`` (with ``overlap=True`` or the DDP
    comm hook, possibly ``backward()``) raise ``DistributedStepError`` on every other rank,
    naming the step and the collective; parameters and momenta are then as before the step.
    How long a collective may take is the process group's timeout (hierarchy's node groups get
    the default group's); ``timeout`` (seconds or a ``timedelta``) bounds every wait of the step
    further. With it, CUDA waits are host waits.

    ``manager`` (a ``torchft.Manager``, ``docs/elastic.md``): elastic training on torchft's
    quorum. ``zero_grad()`` opens each step's quorum, the vote runs among the step's replicas over
    the manager's process group, and the step applies only if ``manager.should_commit()``; a dead
    replica leaves the others training, a restarted one heals from a live one (``heal_momentum``:
    "own", "peer" or "zero"). ``last_stats`` is then an ``ElasticStepStats``. Flat parameters,
    one process per replica; copies are not elastic.
    """

    _step_supports_amp_scaling = True  # scaler.step calls step() on every rank (see optim/amp.py)
    _defer_on_cpu = False  # tests: settle the verdict later on CPU too (always so on CUDA)

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
        foreach: bool | None = None,
        fused: bool | None = None,
        capturable: bool | None = None,
        differentiable: bool | None = None,
        hierarchy=None,
        timeout=None,
        device_mesh=None,
        manager=None,
        heal_momentum: str = "own",
    ):
        if not isinstance(params, torch.Tensor):  # torch refuses a bare tensor itself
            # read twice, by torch.optim and by the start check: a param group's generator too
            params = [_listed_group(x) for x in params]
        auto = isinstance(hierarchy, str) and hierarchy == "auto"
        # A sharded optimizer given group= finds its mesh by a collective: after the verdict
        late = device_mesh is None and group is not None and _any_dtensor(params)
        problem = None
        try:  # every check that can fail on one rank only, and nothing collective
            self._configure(params, lr, betas, weight_decay, mode=mode, votes=votes,
                            group=group, backend=backend, nonfinite=nonfinite, overlap=overlap,
                            bucket_mb=bucket_mb, timeout=timeout, device_mesh=device_mesh,
                            hierarchy=hierarchy, late=late,
                            flags=dict(foreach=foreach, fused=fused, capturable=capturable,
                                       differentiable=differentiable))
            if manager is None and heal_momentum != "own":
                raise ValueError(f"heal_momentum={heal_momentum!r} applies only with manager=")
        except (TypeError, ValueError) as e:
            problem = e
        self._agree_at_start(problem, params, group, device_mesh, hierarchy, timeout)
        if late:
            problem = None
            try:
                self._configure_sharded(hierarchy)
            except (TypeError, ValueError) as e:
                problem = e
            self._agree_at_start(problem, params, group, device_mesh, hierarchy, timeout,
                                 facts=False)
        if auto:
            self._choose_hierarchy()
        if overlap:
            self._build_engine()
        self._elastic = None  # manager=: torchft's quorum around every step (elastic.py)
        if manager is not None:
            from .. import elastic
            self._elastic = elastic.ElasticLion(self, manager, heal_momentum)

    def _configure(self, params, lr, betas, weight_decay, *, mode, votes, group, backend,
                   nonfinite, overlap, bucket_mb, timeout, device_mesh, hierarchy, late,
                   flags) -> None:
        """The constructor's local part: arguments checked, state laid out; raises
        ValueError/TypeError on this rank alone (``__init__`` turns that into one verdict)."""
        check_hyperparameters(lr, betas, weight_decay)
        as_timedelta(timeout)
        check_options(mode, votes, backend, nonfinite)
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be True or False, got {overlap!r}")
        auto = isinstance(hierarchy, str) and hierarchy == "auto"
        self.ranks_per_node = 1 if auto else hier.resolve_hierarchy(hierarchy)
        if overlap and auto:
            raise ValueError("hierarchy=\"auto\" and overlap=True are not combined yet (the "
                             "runtime model chooses L for overlap=False): pass hierarchy=L")
        check_bucket_mb(bucket_mb)
        _check_flags(flags)
        # differentiable=False as torch's __setstate__ would add it: a copy's defaults are equal
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay,
                                      differentiable=False))
        self.mode, self.votes, self.group = mode, votes, group
        self.backend, self.nonfinite = backend, nonfinite
        self.overlap, self.bucket_mb = overlap, float(bucket_mb)
        self.timeout, self.device_mesh = timeout, device_mesh
        self._last_stats: StepStats | None = None
        if not late:
            self._configure_sharded(hierarchy)
        hier.check_world(group, self.ranks_per_node)

    def _configure_sharded(self, hierarchy) -> None:
        self._runtime()  # checks the parameters against device_mesh / group
        if self._sharding is not None:
            if self.ranks_per_node > 1 or hierarchy == "auto":
                raise ValueError(
                    f"hierarchy={hierarchy!r} does not apply to FSDP2 parameters: the mesh's "
                    "shard dimension is the node (FSDP reduces the gradients inside it) and its "
                    "replicas vote; pass hierarchy=None")
            for p in self._trainable():
                self._exp_avg(p)  # the state exists before any step (module docstring)

    def _agree_at_start(self, problem, params, group, device_mesh, hierarchy, timeout,
                        facts=True) -> None:
        """One verdict on every rank of the job (``exchange/agree.py``): a problem found on any
        rank, other arguments, or other starting weights where the ranks hold replicas of the
        same tensors, raise the same error everywhere. One small all_gather (two with FSDP2)."""
        groups, block = agree.start_groups(_tensors(params), device_mesh, group)
        values = [None] * len(_START_FACTS)
        if facts and problem is None:
            listed = [p for g in self.param_groups for p in g["params"]]
            local = [sharded.own_shard(p) for p in self._trainable()]
            values = [
                self.mode, self.votes, self.nonfinite,
                (self.overlap, self.bucket_mb if self.overlap else None),
                "auto" if hierarchy == "auto" else self.ranks_per_node,
                [(g["lr"], tuple(g["betas"]), g["weight_decay"], len(g["params"]))
                 for g in self.param_groups],
                [(tuple(p.shape), str(p.dtype), p.requires_grad) for p in listed],
                [tuple(t.shape) for t in local],
                [dist.get_world_size(g) for g in groups],
                agree.digest(local) if block > 1 else b"",
            ]
        checked = [agree.Fact(name, value) for name, value in zip(_START_FACTS, values)]
        checked[-3] = agree.Fact(_START_FACTS[-3], values[-3], within=True)  # shards differ
        checked[-1] = agree.Fact(
            _START_FACTS[-1], values[-1], within=True, show=False,
            hint="Every replica must start from the same weights: seed the initialization "
                 "alike, or load the same checkpoint into the model on every rank.")
        agree.agree(problem, checked if facts else [], groups, what="DistributedLion(...)",
                    changed="nothing was built on any rank", block=block,
                    timeout=agree.bound(timeout))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """With ``manager=``, also opens this step's quorum (a healing replica heals here)."""
        if getattr(self, "_elastic", None) is not None:
            self._elastic.start_quorum()
        super().zero_grad(set_to_none)

    def _choose_hierarchy(self) -> None:
        """hierarchy="auto": the runtime model picks L (ranks per node) or flat (1) for this
        model size on this job; collective, identical on every rank (``plan/auto.py``)."""
        from ..plan import auto as plan_auto  # the model is apart from the step: load it late

        numel = sum(p.numel() for g in self.param_groups for p in g["params"])
        self.ranks_per_node = plan_auto.hierarchy(numel, mode=self.mode, overlap=False,
                                                  group=self.group)
        hier.check_world(self.group, self.ranks_per_node)

    def _runtime(self) -> None:
        """The private runtime state (exchanges in flight, hooks, streams). Copies (deepcopy,
        pickle) carry none of it (``Copyable``): it starts empty, and a copy with
        ``overlap=True`` gets its hooks at its first ``step()``."""
        if "_exchanged" in vars(self):
            return
        params = [p for g in self.param_groups for p in g["params"]]
        group = attached_group(self.group, self) if sharded.sharded_params(params) else None
        # FSDP2 parameters: their mesh, replicate and shard groups (None: plain tensors)
        self._sharding = sharded.resolve(params, getattr(self, "device_mesh", None), group)
        self._exchange: Exchange | None = None  # this step's exchange, once a bucket started
        self._exchanged: set[int] = set()        # ids of the params exchanged this step
        self._segments: list[Segment] | None = None
        self._streams: Streams | None = None
        self._engine: BucketEngine | None = None
        self._ddp_hooked = False
        self._found_inf = None
        self._pending = None  # a deferred step's (verdict, stats, params, step): _settle()
        self._agreement = None  # FSDP2: this step's sharded.ShardAgreement
        self._reduced_again = False  # FSDP2: a gradient exchanged this step was reduced again
        self._guards: list = []  # FSDP2 with overlap: the hooks of _reduced

    @property
    def sharded(self) -> bool:
        """Whether the parameters are FSDP2 DTensors (``device_mesh``)."""
        self._runtime()
        return self._sharding is not None

    # ------------------------------------------------------------------------- the verdict

    @property
    def last_stats(self) -> StepStats | None:
        """The ``StepStats`` of the latest step (reading it settles a deferred decision)."""
        self._settle()
        return self.__dict__.get("_last_stats")

    @last_stats.setter
    def last_stats(self, value) -> None:
        self._last_stats = value

    def _settle(self) -> None:
        """Read a deferred step's decision: a skipped step's counters go back, a step mismatch
        raises now (on every rank)."""
        pending = self.__dict__.get("_pending")
        if pending is None:
            return
        self._pending = None
        verdict, stats, params, step = pending
        skipped = True  # also when resolve() raises (a step mismatch): the step is rolled back
        try:
            skipped = verdict.resolve()
        finally:
            if skipped:
                for p in params:
                    self.state[p]["step"] = step
        self._last_stats = dataclasses.replace(stats, skipped=skipped)

    def __getstate__(self):
        self._settle()
        state = super().__getstate__()
        state["_last_stats"] = self.__dict__.get("_last_stats")  # copies keep last_stats
        return state

    def state_dict(self):
        self._settle()
        return super().state_dict()

    def add_param_group(self, param_group: dict) -> None:
        """Also after construction: the new parameters get their state on their first step
        (FSDP2 parameters: at once, and they must be sharded over the same mesh)."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            check_params(group["params"])
            check_hyperparameters(group["lr"], group["betas"], group["weight_decay"])
            _check_flags({k: group[k] for k in _FLAGS if k in group})
            if "_exchanged" in vars(self):  # after construction
                everything = [p for g in self.param_groups for p in g["params"]]
                if sharded.sharded_params(everything):
                    for i, p in enumerate(everything):
                        sharded.check_param(i, p, everything[0])
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise
        if getattr(self, "_sharding", None) is not None:
            for p in group["params"]:
                if p.requires_grad:
                    self._exp_avg(p)
        if getattr(self, "_engine", None) is not None:
            self._build_engine()  # the new parameters need hooks; the order is re-recorded

    # ------------------------------------------------------------------------- buckets

    def _build_engine(self) -> None:
        if self._engine is not None:
            self._engine.remove()
        for h in self._guards:
            h.remove()
        params, self._guards = self._trainable(), []
        if self._sharding is not None:
            # FSDP2 accumulates a second backward's reduced gradient into .grad before it calls
            # the sharded parameter's hooks, and never calls its tensor pre-hooks (the sharded
            # parameter is not in the autograd graph): the engine's guard cannot refuse it
            # first. Note it here (before the engine's hook, which may exchange the bucket);
            # step() then refuses the step.
            self._guards = [p.register_post_accumulate_grad_hook(WeakHook(self, "_reduced"))
                            for p in params]
            remove_when_collected(self, self._guards)
        self._engine = BucketEngine(params, bucket_mb=self.bucket_mb, group=self._group(),
                                    on_ready=self._bucket_ready, on_misuse=self._drain)

    def _reduced(self, param) -> None:
        if id(param) in self._exchanged:
            self._reduced_again = True

    def _check_reduced_once(self) -> None:
        if not self._reduced_again:
            return
        problem = RuntimeError(
            "a second backward() reduced gradients (FSDP2 added them into .grad) whose votes "
            "were already exchanged this step; nothing was updated. Accumulate with FSDP2's "
            "model.set_requires_gradient_sync(False) for every micro-batch but the last, then "
            "zero_grad() and redo this step")
        self._give_up(problem)  # every rank's collectives stay matched; nothing applied
        raise problem

    def _group(self):
        """The process group of the exchange: the replicate group for FSDP2 parameters."""
        if self._sharding is not None:
            return self._sharding.replicate
        return attached_group(self.group, self)

    def _bucket_ready(self, bucket) -> None:
        try:
            if self.ranks_per_node > 1:
                self._hierarchical_bucket(bucket)
            elif self._sharding is not None:  # the engine's layout is of the full tensors
                self._exchange_bucket(bucket.params)
            else:
                self._exchange_bucket(bucket.params, layout=(bucket.offsets, bucket.blocks))
        except DistributedStepError:
            self._drop_step()  # a peer failed: the exchange retired the groups it made
            raise
        except BaseException as e:
            if not self._giving_up and not getattr(e, "dlion_decided", False):
                self._give_up(e)  # bad input found in backward: give the step up here
            raise

    _giving_up = False
    _flushed = False  # step() flushed the engine: every bucket of the step has started

    def _drain(self) -> None:
        """A second ``backward()`` is being refused: the step stays open (its gradients are
        untouched and ``step()`` can still finish it), but every collective it started is
        completed now, on every group, so that none is left pending if the optimizer is
        dropped after the error (a new one on the same group would pair its collectives with
        the stale ones: gloo aborts the process)."""
        try:
            if self._exchange is not None:
                self._exchange.abandon()
            if getattr(self, "_hier_step", None) is not None:
                self._hier_step.abandon()
        except DistributedStepError:
            self._drop_step()  # a peer failed: the exchange retired the groups it made
            raise

    def _give_up(self, problem=None) -> None:
        """This rank gives up the step in flight after an error of its own (``problem``: a
        second backward, bad input or a wrong setting found on this rank, a failing closure, a
        refused GradScaler): every collective that the other ranks issue for this step is
        issued here too -- the buckets not started yet are started, with the ``ABORTED`` flag,
        and so is the step's one bucket when nothing was started yet -- and waited for, and
        nothing is applied. So no collective is left pending on any group, the same or a new
        optimizer can step next, and every rank skips the step and raises the same error
        (``Exchange.explain``, here too; marked ``dlion_decided``), or, when the decision is
        deferred, the others raise ``StepAbortedError`` at their next step."""
        if self._giving_up:
            return
        self._giving_up = True
        try:
            if self.ranks_per_node > 1:
                hs = getattr(self, "_hier_step", None)
                if hs is not None:
                    hs.ex.aborted = True
                if self._engine is not None and not self._flushed:
                    self._engine.flush()  # the buckets the others start (given up, no gradient)
                hs = getattr(self, "_hier_step", None)
                if hs is not None:
                    hs.give_up(problem)
                return
            ex = self._exchange
            if ex is None and self._ddp_hooked:
                return  # DDP's hook starts the buckets: nothing of the step was started
            ex = self._start_step()
            ex.aborted, ex.problem = True, problem
            if self._engine is not None and not self._flushed:
                self._engine.flush()  # the buckets the others start at their step()
            rest = [p for p in self._trainable() if id(p) not in self._exchanged]
            if (rest or not ex.works) and not self._ddp_hooked:
                self._exchange_bucket(rest)  # what step() exchanges after the buckets
            device = ex.device
            ex.finish(agree=self._agreement, abort=True, defer=self._defer(device))
        except DistributedStepError:
            raise  # the exchange retired its groups; this step is dropped below
        except Exception as e:  # the step's one verdict, the same on every rank
            e.dlion_decided = True
            raise
        finally:
            self._giving_up = False
            self._drop_step()

    def _drop_step(self) -> None:
        """Forget the step in flight (given up, finished, or failed)."""
        self._exchange = self._agreement = None
        self._hier_step = None
        self._exchanged, self._reduced_again = set(), False
        self._flushed = False
        if self._engine is not None:
            self._engine.reset()

    def _refuse_scaler(self, grad_scaler) -> None:
        scaled = (grad_scaler is not None and grad_scaler.is_enabled()) or any(
            getattr(self, name, None) is not None for name in ("grad_scale", "found_inf"))
        if not scaled:
            return
        problem = ValueError(
            "fp16 GradScaler cannot be combined with overlap=True or the DDP comm hook: the votes "
            "are taken during backward, from still-scaled gradients. Use overlap=False without "
            "the hook, or bf16 autocast (no scaler); nothing was updated")
        # Finish this step's collectives (the same on every rank) and drop them: nothing moves.
        if self._exchange is not None or getattr(self, "_hier_step", None) is not None:
            self._give_up(problem)
        raise problem

    def no_sync(self):
        """Inside it, ``backward()`` only accumulates gradients; nothing is exchanged. For
        gradient accumulation with ``overlap=True``: every micro-batch but the last. With
        ``overlap=False`` (nothing is exchanged during backward anyway) it does nothing."""
        self._runtime()
        if self._engine is None:
            return contextlib.nullcontext()
        return self._engine.no_sync()

    # ------------------------------------------------------------------------- one step

    def _trainable(self) -> list:
        """The parameters that take part in a step, in param group order."""
        return [p for g in self.param_groups for p in g["params"] if p.requires_grad]

    def _begin(self) -> tuple[int, torch.device]:
        """What every path needs once at the start of a step (the first bucket, or step()):
        the last step's decision settled, ``self._segments`` (one ``Segment`` per param group:
        the one way they are built; each path fills in its tensors), ``self._group_of``
        (parameter id -> its group's index), and the streams. Returns (step counter, device)."""
        self._settle()  # the step counters of the last step, for this step's header
        self._segments, self._group_of = [], {}
        self._problem = None  # a setting found wrong here: the step is given up (one decision)
        for k, g in enumerate(self.param_groups):
            try:
                beta1, beta2 = check_hyperparameters(g["lr"], g["betas"], g["weight_decay"])
                settings = float(g["lr"]), beta1, beta2, float(g["weight_decay"])
            except (TypeError, ValueError) as e:
                self._problem = self._problem or e
                settings = 0.0, 0.0, 0.0, 0.0
            self._segments.append(Segment([], [], [], *settings))
            self._group_of.update((id(p), k) for p in g["params"])
        params = self._trainable()
        step = max((self.state[p].get("step", 0) for p in params), default=0)
        device = params[0].device if params else torch.device("cpu")
        if self._streams is None or self._streams.device != device:
            self._streams = Streams(device)
        return step, device

    def _refresh(self) -> None:
        """lr, beta2 and weight_decay apply when the step applies (a scheduler may have changed
        them since backward started the step); beta1 was read by the local step."""
        for seg, g in zip(self._segments, self.param_groups):
            _, seg.beta2 = check_hyperparameters(g["lr"], g["betas"], g["weight_decay"])
            seg.lr, seg.weight_decay = float(g["lr"]), float(g["weight_decay"])

    def _start_step(self) -> Exchange:
        """The exchange of this step, created when its first bucket starts."""
        self._runtime()
        if self._exchange is None:
            step, device = self._begin()
            timeout = getattr(self, "timeout", None)
            group = self._group()
            overlapped = self._engine is not None or self._ddp_hooked  # buckets in backward
            self._exchange = Exchange(device=device, mode=self.mode, votes=self.votes,
                                      group=group, backend=self.backend, step=step,
                                      nonfinite=self.nonfinite, found_inf=self._found_inf,
                                      streams=self._streams, timeout=timeout,
                                      segments=self._segments, late=overlapped)
            self._exchange.explainer = agree.explain_step  # one error on every rank
            self._exchanged = set()
            if self._sharding is not None:
                self._agreement = sharded.ShardAgreement(self._sharding, step, timeout)
                # every rank of the mesh raises the same error
                self._exchange.explain_groups = [self._sharding.replicate, self._sharding.shard]
        return self._exchange

    def _exp_avg(self, p):
        """The momentum of ``p``, created (zero, step 0) if it has no state yet."""
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = (
                self._sharding.zero_momentum(p) if self._sharding is not None
                else torch.zeros(p.shape, dtype=torch.float32, device=p.device))
        return state["exp_avg"]

    def _exchange_bucket(self, params, grads=None, layout=None) -> None:
        """Start the exchange of one bucket: ``params`` (requires_grad) with ``grads`` (default:
        their ``.grad``), laid out from block 0 in this order; ``layout``: their (block offsets,
        blocks) when the caller has them (the bucket engine's), else computed here."""
        with torch.no_grad():
            ex = self._start_step()
            grads = [p.grad for p in params] if grads is None else list(grads)
            exp_avgs = [self._exp_avg(p) for p in params]
            segments = [self._segments[self._group_of[id(p)]] for p in params]
            ids = [id(p) for p in params]
            if self._sharding is not None:  # FSDP2: the exchange runs on the local shards
                params = [sharded.own_shard(p) for p in params]
                grads = [sharded.own_shard(g) for g in grads]
                exp_avgs = [sharded.momentum_local(m) for m in exp_avgs]
            offsets, blocks = layout if layout is not None else block_offsets(
                p.numel() for p in params)
            if ex.aborted:  # giving the step up: the bucket keeps its size, carries no votes
                ex.add_aborted(blocks)
                self._exchanged.update(ids)
                return
            try:
                if self._problem is not None:  # a setting of this step is wrong on this rank
                    raise self._problem
                check_tensors(list(params), grads, exp_avgs)
            except (TypeError, ValueError):
                # bad input on this rank only, found after other buckets may have been sent:
                # the others still get this bucket, flagged, and skip the step as well
                ex.add_aborted(blocks)
                self._exchanged.update(ids)
                raise
            ex.add([ex.row(p, g, m, off, seg) for p, g, m, off, seg
                    in zip(params, grads, exp_avgs, offsets, segments)], blocks)
            self._exchanged.update(ids)

    @staticmethod
    def _closure(closure):
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def _defer(self, device) -> bool:
        """Whether nothing can raise from this step's decision, so it stays on the device (no
        host sync) until ``_settle``: CUDA with ``nonfinite="skip"`` or a GradScaler."""
        return (device.type == "cuda" or self._defer_on_cpu) and (
            self.nonfinite == "skip" or self._found_inf is not None)

    @contextlib.contextmanager
    def _one_decision(self):
        """Around the part of a step where this rank may find something wrong on its own (a
        closure, bad input, a setting): on such an error it gives the step up (``_give_up``),
        so no collective is left in flight and every rank raises the same error. A peer's
        failure (``DistributedStepError``) is raised as it is: the exchange retired its groups.
        """
        try:
            yield
        except DistributedStepError:
            raise
        except BaseException as e:
            if not getattr(e, "dlion_decided", False):  # not already the step's one verdict
                self._give_up(e)
            raise

    @torch.no_grad()
    def step(self, closure=None, *, grad_scaler=None):
        """One step on every rank. ``grad_scaler`` is passed by ``torch.amp.GradScaler.step``
        (never pass it yourself)."""
        if getattr(self, "_elastic", None) is not None:  # torchft's quorum (elastic.py)
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            self._elastic.step()
            return loss
        attached_group(self.group, self)
        self._runtime()
        if self._exchange is None:
            self._settle()
        loss = None
        device = next((p.device for g in self.param_groups for p in g["params"]),
                      torch.device("cpu"))
        if self.ranks_per_node > 1 and self.overlap:
            with self._one_decision():
                loss = self._closure(closure)
            self.last_stats = self._hierarchical_overlap_step(grad_scaler)
            return loss
        if self.ranks_per_node > 1:
            problem = None
            try:  # a closure that fails here: the step runs given up (the others learn it)
                loss = self._closure(closure)
            except Exception as e:
                problem = e
            # fp16 GradScaler: unscaled here, the local overflow flag joins the step's flags
            found_inf = amp.before_exchange(self, grad_scaler, device)
            self.last_stats = self._hierarchical_step(found_inf, problem)
            amp.after_exchange(self, grad_scaler, self.last_stats.skipped)
            return loss
        if self._engine is not None or self._ddp_hooked:
            self._refuse_scaler(grad_scaler)
        try:
            with self._one_decision():
                loss = self._closure(closure)
                self._found_inf = amp.before_exchange(self, grad_scaler, device)
                if self._engine is not None:
                    self._engine.flush()  # buckets never made ready this step (unused params)
                    self._flushed = True
                self._check_reduced_once()
                params = self._trainable()
                rest = [p for p in params if id(p) not in self._exchanged] if self._exchange \
                    else params
                if rest or self._exchange is None:
                    self._exchange_bucket(rest)  # without overlap: the whole step is one bucket
                self._refresh()
                if self._exchange.late:  # the gradients the apply reads, changed since backward?
                    self._exchange.check_rows()
            ex, self._exchange = self._exchange, None
            agreement, self._agreement = self._agreement, None
            defer = self._defer(device)
            stats = ex.finish(defer=defer, agree=agreement)
            if agreement is not None:
                stats = sharded.step_stats(stats, agreement)
        finally:
            self._found_inf = None
            self._exchange = self._agreement = None
            self._exchanged, self._reduced_again = set(), False
            self._flushed = False
            if self.overlap and self._engine is None and not self._ddp_hooked:
                self._build_engine()  # a copy's hooks (the next backward records the order)
        self._last_stats = stats
        amp.after_exchange(self, grad_scaler, ex.verdict.skip if defer else stats.skipped)
        if not stats.skipped:  # deferred: counted as taken until _settle() reads the verdict
            for p in params:
                self.state[p]["step"] = ex.step + 1
        if defer:
            self._pending = (ex.verdict, stats, params, ex.step)
        return loss

    # ------------------------------------------------------------------------- hierarchy

    def _hierarchical_step(self, found_inf=None, problem=None) -> StepStats:
        """The whole step of ``hierarchy=L`` (exchange/hierarchy.py), from ``step()``;
        ``found_inf``: the GradScaler's local overflow flag (``amp.before_exchange``) or None;
        ``problem``: an error of this rank's own found before (a closure's). A problem (or a
        setting or gradient found wrong here) gives the step up: this rank still takes part in
        its collectives, with no gradient, and every rank raises the same error."""
        step, _ = self._begin()
        problem = problem or self._problem
        states = []
        for seg, g in zip(self._segments, self.param_groups):
            seg.params = [p for p in g["params"] if p.requires_grad]
            seg.grads = [p.grad for p in seg.params]
            for p in seg.params:
                states.append(self.state[p])
                states[-1].setdefault("step", 0)  # the momentum shard comes at the step
        try:
            hier.check_tensors(*[sum((getattr(s, k) for s in self._segments), [])
                                 for k in ("params", "grads")])
        except (TypeError, ValueError) as e:
            problem = problem or e
        if problem is not None:
            for seg in self._segments:
                seg.grads = [None] * len(seg.params)
        if getattr(self, "_shard", None) is None:
            self._shard = hier.ShardedMomentum()
        self._shard.states = states  # new dicts after load_state_dict: the shard is rebuilt
        stats = hier.run_hierarchical_step(
            self._segments, self._shard, ranks_per_node=self.ranks_per_node, mode=self.mode,
            votes=self.votes, group=self.group, backend=self.backend, step=step,
            nonfinite=self.nonfinite, timeout=getattr(self, "timeout", None),
            found_inf=found_inf, problem=problem)
        if not stats.skipped:
            for state in states:
                state["step"] = step + 1
        return stats

    def _hierarchical_bucket(self, bucket) -> None:
        """A bucket's hierarchical phases 1-4 and its node gather (exchange/hierarchy.py
        ``OverlapStep``), during backward. The first bucket of a step lays out the momentum
        shards of every bucket (checking loaded ones) before anything is sent."""
        with torch.no_grad():
            hs = getattr(self, "_hier_step", None)
            if hs is None:
                step, device = self._begin()
                for p in self._trainable():
                    self.state[p].setdefault("step", 0)
                timeout = getattr(self, "timeout", None)
                topo = hier.topology(self.group, self.ranks_per_node, timeout)
                buckets = self._engine.buckets
                self._hier_layouts = [hier.ShardLayout.build((p.numel() for p in b.params), topo)
                                      for b in buckets]
                if getattr(self, "_shard", None) is None:
                    self._shard = hier.ShardedMomentum()
                self._hier_momentum = self._shard.shard_buckets(
                    self._hier_layouts, [[self.state[p] for p in b.params] for b in buckets],
                    device)
                hs = self._hier_step = hier.OverlapStep(
                    topo, device=device, mode=self.mode, votes=self.votes, backend=self.backend,
                    step=step, nonfinite=self.nonfinite, streams=self._streams, timeout=timeout,
                    segments=self._segments)
            segments = [self._segments[self._group_of[id(p)]] for p in bucket.params]
            if not hs.ex.aborted and not self._giving_up:
                try:  # each bucket as it starts (the unused ones at step())
                    hier.check_tensors(bucket.params, [p.grad for p in bucket.params])
                except (TypeError, ValueError) as e:
                    self._problem = self._problem or e
            bad = self._problem is not None and not hs.ex.aborted and not self._giving_up
            if bad or hs.ex.aborted or self._giving_up:  # given up: its collectives, no gradient
                hs.ex.aborted = True
                grads = [None] * len(bucket.params)
            else:
                grads = [p.grad for p in bucket.params]
            hs.add(bucket.params, grads, segments, self._hier_layouts[bucket.index],
                   self._hier_momentum[bucket.index])
            if bad:
                raise self._problem

    def _hierarchical_overlap_step(self, grad_scaler) -> StepStats:
        """step() of hierarchy=L with overlap=True: the buckets not started during backward,
        then wait, decide and apply (``OverlapStep.finish``)."""
        if self._engine is None:
            self._build_engine()  # a copy: the buckets are formed from declaration order
        self._refuse_scaler(grad_scaler)
        try:
            with self._one_decision():
                self._engine.flush()  # buckets never made ready this step (unused parameters)
                self._flushed = True
                if getattr(self, "_hier_step", None) is not None:
                    self._refresh()
            hs, self._hier_step = getattr(self, "_hier_step", None), None
            if hs is None:  # no parameter takes part: nothing to exchange or apply
                return StepStats(0, 0, 0, 1, self.mode, self.votes, "none", buckets=0)
            stats = hs.finish()
        finally:
            self._hier_step = None
            self._flushed = False
        if not stats.skipped:
            for p in self._trainable():
                self.state[p]["step"] = hs.step + 1
        return stats

    def load_state_dict(self, state_dict: dict) -> None:
        """torch.optim's, checked first on every rank, then one verdict for the job (a problem
        on any rank, or ranks loading states of other step counts or hyper-parameters, raise
        the same error everywhere, nothing loaded); momentum stays fp32 (FSDP2: DTensors)."""
        self._settle()
        self._runtime()
        problem, loaded, facts = None, [], [None, None]
        try:
            loaded = self._check_loaded(state_dict)
            saved = state_dict["state"]
            facts = [max((int(saved[i].get("step", 0)) for g in state_dict["param_groups"]
                          for i in g["params"] if i in saved), default=0),
                     [(g["lr"], tuple(g["betas"]), g["weight_decay"])
                      for g in state_dict["param_groups"]]]
        except Exception as e:  # anything this rank finds must not leave the others waiting
            problem = e
        if self._sharding is not None:
            groups, block = [self._sharding.replicate, self._sharding.shard], \
                self._sharding.replicas
        else:
            groups, block = [resolve_group(attached_group(self.group, self))[0]], None
        hint = "Every rank must load the same checkpoint step (dk.load_state loads each its own)."
        agree.agree(problem, [agree.Fact("step", facts[0], error=StepMismatchError, hint=hint),
                              agree.Fact("param groups (lr, betas, weight_decay)", facts[1])],
                    groups, what="DistributedLion.load_state_dict", block=block,
                    changed="nothing was loaded on any rank",
                    timeout=getattr(self, "timeout", None))
        super().load_state_dict(state_dict)
        # torch casts floating state to the param's dtype; momentum stays fp32 here for exact
        # resume of bf16/fp16 models, so put the saved fp32 values back afterwards.
        for _, p, m in loaded:
            self.state[p]["exp_avg"] = (
                self._sharding.loaded_momentum(m, p) if self._sharding is not None
                else m.to(device=p.device, dtype=torch.float32, copy=True))
        if self._sharding is not None:
            for p in self._trainable():
                self._exp_avg(p)  # parameters the state_dict had no state for

    # The interface of DDP's comm hook (optim/ddp_hook.py): DDP's buckets run the exchange.

    @property
    def ddp_hooked(self) -> bool:
        """Whether a DDP model's comm hook runs this optimizer's bucket exchanges."""
        return self._ddp_hooked

    def attach_ddp_hook(self) -> None:
        """Hand the bucket exchanges to a DDP comm hook: this optimizer's own backward hooks
        (``overlap=True``) are removed, and ``step()`` finishes the buckets the hook started."""
        if self._ddp_hooked:
            raise RuntimeError("opt already runs the D-Lion exchange of a DDP model")
        if self._engine is not None:
            self._engine.remove()
            self._engine = None
        self._ddp_hooked = True

    def exchange_bucket(self, params, grads) -> None:
        """Start the exchange of one DDP bucket: ``params`` and their ``grads`` (DDP's views of
        its flat buffer), laid out from block 0 in this order."""
        self._exchange_bucket(list(params), list(grads))

    def _check_loaded(self, state_dict) -> list:
        """What load_state_dict checks before anything changes (torch.optim's own group checks
        included); returns the (id, param, momentum) to put back as fp32."""
        groups, saved_groups = self.param_groups, state_dict["param_groups"]
        saved = state_dict["state"]
        ids = [i for g in saved_groups for i in g["params"]]
        params = [p for g in groups for p in g["params"]]
        loaded = [(i, p, saved[i]["exp_avg"]) for i, p in zip(ids, params)
                  if i in saved and "exp_avg" in saved[i]]
        for i, p, m in loaded:
            where = f"state_dict['state'][{i!r}]['exp_avg']"
            if self._sharding is not None:
                self._sharding.check_momentum(m, p, where)
            elif sharded.is_dtensor(m):
                raise ValueError(f"{where} is a DTensor, saved by a DistributedLion over FSDP2 "
                                 "parameters; this one's parameters are plain tensors")
        if len(groups) != len(saved_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)):
            raise ValueError("loaded state dict contains a parameter group that doesn't match "
                             "the size of optimizer's group")
        return loaded
