"""``DistributedLion``: a ``torch.optim.Optimizer`` around ``fused_dlion_step``."""

from __future__ import annotations

import contextlib
import dataclasses
import weakref

import torch
import torch.distributed as dist

from .. import elastic
from ..accounting import BUCKET_MB
from ..elastic import DEFAULT_HEAL_MOMENTUM
from ..exchange import agree, sharded
from ..exchange import hierarchy as hier
from ..exchange.buckets import check_bucket_mb
from ..exchange.checks import check_hyperparameters, check_options, check_params
from ..exchange.collectives import as_timedelta
from ..exchange.copying import Copyable, attached_group
from ..exchange.header import StepMismatchError
from ..exchange.pipeline import StepStats
from .paths import FlatPath, HierarchyPath, ShardedPath, trainable

# the name a DistributedLion's state is registered under on a torchft Manager (elastic.py)
GATE_KEY = "dlion_kernels.DistributedLion"

# torch.optim's implementation flags and the values accepted
_FLAGS = {
    "foreach": (None, True, False),  # accepted: every backend is multi-tensor fused anyway
    "fused": (None, True, False),
    "capturable": (None, True, False),  # one rank, nonfinite="skip": the step is capturable
    "differentiable": (None, False),  # sign votes have no useful derivative
}


def _check_flags(flags: dict) -> None:
    for name, value in flags.items():
        allowed = _FLAGS[name]
        if value not in allowed or (value is not None and not isinstance(value, bool)):
            why = {
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
    fixed for the optimizer (see ``fused_dlion_step``). Every parameter with ``requires_grad``
    takes part in every step on every rank; a ``None`` gradient counts as zero. ``last_stats``
    holds the ``StepStats`` of the latest step.

    How the step runs follows from the parameters and options, one path each
    (``optim/paths.py``):

    - flat (docs/usage.md): one process group, every rank votes. ``overlap=True``
      (docs/overlap.md) starts each bucket of about ``bucket_mb`` MiB during ``backward()``,
      bit-identical to ``overlap=False``: use ``no_sync()`` for every micro-batch but the last,
      and do not change gradients between ``backward()`` and ``step()``; fp16 ``GradScaler``
      then raises ``ValueError`` (bf16 autocast works). DDP's comm hook: ``ddp_hook.py``;
    - ``hierarchy`` ("node", an int L, or "auto"; docs/hierarchy.md): nodes of L ranks average
      their gradients exactly and the nodes vote; each rank keeps ~1/L of the momentum
      (``state[p]["exp_avg"]`` covers ``state[p]["exp_avg_range"]`` of ``p``); resume needs the
      same n and L (with ``overlap=True`` also the same ``overlap`` and ``bucket_mb``);
      ``hierarchy="auto"`` (the runtime model picks L) does not combine with ``overlap=True``;
    - FSDP2 (``device_mesh``, or DTensor parameters with ``group``; docs/fsdp.md): each rank
      steps its local shards and the replicas of each shard vote; ``state[p]["exp_avg"]`` is an
      fp32 DTensor of shape (N, *p.shape), made at construction. With ``overlap=True``
      accumulate with FSDP2's ``model.set_requires_gradient_sync(False)``. ``hierarchy`` does
      not apply;
    - ``manager`` (a ``torchft.Manager``, docs/elastic.md): elastic training on torchft's
      quorum, ``zero_grad()`` opens each step's quorum; ``heal_momentum``: "own", "peer" or
      "zero" (``elastic.py``).

    One decision for the job: at construction and at ``load_state_dict`` every rank checks its
    arguments, state and starting parameters, and a problem on any rank raises the same error on
    every rank, nothing built or loaded. At every step an error found on one rank (bad input, a
    failing closure) or ranks on different steps (``StepMismatchError``) stop the step on every
    rank with nothing applied. A peer that dies or stalls raises ``DistributedStepError``;
    ``timeout`` (seconds or a ``timedelta``) bounds every wait of the step further.

    With ``nonfinite="skip"`` or a GradScaler on CUDA the step reads nothing back on the host:
    its decision is settled at the next ``step()``, ``state_dict()`` or ``last_stats`` read.
    AMP: ``torch.amp.GradScaler`` works as with any optimizer, with one overflow decision for
    all ranks (``optim/amp.py``).

    Copies (``copy.deepcopy``, ``pickle``, ``torch.save``) keep every option and ``last_stats``
    and step like the original; an explicit process group cannot be pickled (assign
    ``opt.group`` again on the copy). Copies are not elastic. ``foreach``, ``fused`` and
    ``capturable`` change nothing (a step on one rank with ``nonfinite="skip"`` can always be
    captured in a CUDA graph: ``exchange/pipeline.py``); ``differentiable=True`` raises
    ``ValueError``.
    """

    _step_supports_amp_scaling = True  # scaler.step calls step() on every rank (see optim/amp.py)
    _defer_on_cpu = False  # tests: settle the verdict later on CPU too (always so on CUDA)
    _gate = None  # manager=: torchft's quorum around every step (a copy is not elastic)

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
        bucket_mb: float = BUCKET_MB,
        foreach: bool | None = None,
        fused: bool | None = None,
        capturable: bool | None = None,
        differentiable: bool | None = None,
        hierarchy=None,
        timeout=None,
        device_mesh=None,
        manager=None,
        heal_momentum: str = DEFAULT_HEAL_MOMENTUM,
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
            self._check_manager(manager, heal_momentum, group=group, overlap=overlap,
                                auto=auto, late=late)
        except (TypeError, ValueError, ImportError) as e:
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
        if manager is not None:  # every check passed on every rank: nothing to undo
            self._gate = elastic.Gate(self, manager, key=GATE_KEY, heal_momentum=heal_momentum,
                                      replica_group=self._replica_group(),
                                      heal_state=weakref.WeakMethod(self._heal_state))
        if overlap:
            self._path.build_engine()

    def _check_manager(self, manager, heal_momentum, *, group, overlap, auto, late) -> None:
        """What ``manager=`` combines with (docs/composition.md), checked before anything is
        built: ValueError/TypeError (ImportError without torchft) on this rank."""
        elastic.check_heal_momentum(heal_momentum, manager)
        if manager is None:
            return
        elastic.check_manager(manager)
        elastic.check_key(manager, GATE_KEY)
        if group is not None or late:
            raise ValueError(
                "manager= votes over the process group torchft makes for each quorum: pass "
                "group=None (a replica of several ranks is its own torch.distributed job; its "
                "default group holds its ranks)")
        if auto:
            raise ValueError('hierarchy="auto" does not combine with manager=: the replicas are '
                             "torchft's; pass hierarchy=L, the ranks of one replica")
        L, sharding = self.ranks_per_node, self._path.sharding
        if L > 1 and overlap:
            raise ValueError("manager= with hierarchy does not combine with overlap=True yet: "
                             "pass overlap=False (the node's exchange runs at step())")
        if sharding is not None:
            if sharding.replicas != 1:
                raise ValueError(
                    f"manager= with FSDP2 parameters: a replica is one shard group and the "
                    f"replicas are torchft's, but device_mesh holds {sharding.replicas} replicas;"
                    " pass device_mesh=None (or the 1-D mesh the parameters are sharded over) "
                    "and start each replica as its own torch.distributed job")
            position = dist.get_rank(sharding.shard) if sharding.shards > 1 else 0
            elastic.check_replica(manager, position, sharding.shards)
            return
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if L > 1:
            if world != L:
                raise ValueError(
                    f"manager= with hierarchy={L}: a replica is one node of L ranks, its own "
                    f"torch.distributed job, but this job has {world} ranks; start each replica "
                    "with L ranks (the replicas are torchft's)")
            elastic.check_replica(manager, dist.get_rank(), L)
        elif world > 1:
            raise ValueError(
                f"manager=: this job has {world} ranks, and a replica of several ranks needs "
                "a way to act as one voter: FSDP2 parameters (fully_shard over the replica's "
                "ranks) or hierarchy=L (its ranks average their gradients); else start one "
                "process per replica")

    def _replica_group(self):
        """The process group of this replica's own ranks (None: one process per replica)."""
        if self._path.sharding is not None:
            return self._path.sharding.shard if self._path.sharding.shards > 1 else None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return dist.group.WORLD
        return None

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
        if isinstance(self._path, ShardedPath):
            if self.ranks_per_node > 1 or hierarchy == "auto":
                raise ValueError(
                    f"hierarchy={hierarchy!r} does not apply to FSDP2 parameters: the mesh's "
                    "shard dimension is the node (FSDP reduces the gradients inside it) and its "
                    "replicas vote; pass hierarchy=None")
            for p in trainable(self.param_groups):
                self._path.exp_avg(p)  # the state exists before any step (module docstring)

    def _agree_at_start(self, problem, params, group, device_mesh, hierarchy, timeout,
                        facts=True) -> None:
        """One verdict on every rank of the job (``exchange/agree.py``): a problem found on any
        rank, other arguments, or other starting weights where the ranks hold replicas of the
        same tensors, raise the same error everywhere. One small all_gather (two with FSDP2)."""
        groups, block = agree.start_groups(_tensors(params), device_mesh, group)
        values = [None] * len(_START_FACTS)
        if facts and problem is None:
            listed = [p for g in self.param_groups for p in g["params"]]
            local = [sharded.own_shard(p) for p in trainable(self.param_groups)]
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
        """With ``manager=``, also opens this step's quorum: in the background while forward and
        backward run, or here and now for a replica that may heal (``elastic.py``)."""
        if self._gate is not None:
            self._gate.open(ahead=True)
        super().zero_grad(set_to_none)

    @property
    def elastic(self):
        """torchft's quorum around every step (``elastic.Gate``: its ``key`` on the manager,
        ``close()``), or None without ``manager=``."""
        return self._gate

    # What a healing replica copies from a live one (elastic.Gate): the parameters (this rank's
    # local shards), the step count, and the momenta by the gate's heal_momentum.

    def _heal_state(self):
        self._runtime()
        params = trainable(self.param_groups)
        step = max((self.state[p].get("step", 0) for p in params), default=0)
        return elastic.HealState(shared=[sharded.own_shard(p) for p in params],
                         private=self._path.momenta(), counters={"step": step},
                         set_counters=self._set_counters)

    def _set_counters(self, counters: dict) -> None:
        for p in trainable(self.param_groups):
            self.state[p]["step"] = int(counters["step"])

    def _choose_hierarchy(self) -> None:
        """hierarchy="auto": the runtime model picks L (ranks per node) or flat (1) for this
        model size on this job; collective, identical on every rank (``plan/auto.py``)."""
        from ..plan import auto as plan_auto  # the model is apart from the step: load it late

        numel = sum(p.numel() for g in self.param_groups for p in g["params"])
        self.ranks_per_node = plan_auto.hierarchy(numel, mode=self.mode, overlap=False,
                                                  group=self.group)
        hier.check_world(self.group, self.ranks_per_node)
        if self.ranks_per_node > 1:
            self._path = HierarchyPath(self)

    def _runtime(self) -> None:
        """The path of this optimizer (``optim/paths.py``), with its runtime state (exchanges in
        flight, hooks, streams). Copies (deepcopy, pickle) carry none of it (``Copyable``): a
        copy makes its path on first use, and a copy with ``overlap=True`` gets its hooks at its
        first ``step()``."""
        if "_path" in vars(self):
            return
        params = [p for g in self.param_groups for p in g["params"]]
        group = attached_group(self.group, self) if sharded.sharded_params(params) else None
        # FSDP2 parameters: their mesh, replicate and shard groups (None: plain tensors)
        sharding = sharded.resolve(params, getattr(self, "device_mesh", None), group)
        if sharding is not None:
            self._path = ShardedPath(self, sharding, defer_on_cpu=self._defer_on_cpu)
        elif self.ranks_per_node > 1:
            self._path = HierarchyPath(self)
        else:
            self._path = FlatPath(self, defer_on_cpu=self._defer_on_cpu)

    @property
    def sharded(self) -> bool:
        """Whether the parameters are FSDP2 DTensors (``device_mesh``)."""
        self._runtime()
        return self._path.sharding is not None

    @property
    def sharding(self):
        """The FSDP2 layout of the parameters (``exchange.sharded.Sharding``: the mesh, the
        replicate and shard groups), or None for plain tensors."""
        self._runtime()
        return self._path.sharding

    # ------------------------------------------------------------------------- the verdict

    @property
    def last_stats(self) -> StepStats | None:
        """The ``StepStats`` of the latest step (reading it settles a deferred decision)."""
        self._settle()
        return self.__dict__.get("_last_stats")

    @last_stats.setter
    def last_stats(self, value) -> None:
        self._last_stats = value

    @property
    def decision_pending(self) -> bool:
        """Whether the last step's skip decision is still on the device (a CUDA step with
        ``nonfinite="skip"`` or a GradScaler): it is read at the next ``step()``,
        ``state_dict()`` or ``last_stats``."""
        path = self.__dict__.get("_path")
        return path is not None and path.pending is not None

    @property
    def buckets_started(self) -> int:
        """The buckets of the step in flight whose exchange has started (``overlap=True``:
        during backward); 0 between steps."""
        path = self.__dict__.get("_path")
        return 0 if path is None else path.buckets_started()

    def _settle(self) -> None:
        """Read a deferred step's decision (``Path.settle``), if a step left one."""
        path = self.__dict__.get("_path")  # none yet: a copy before its first use
        if path is not None:
            path.settle()

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
        path = self.__dict__.get("_path")  # none yet: torch.optim's constructor adds the groups
        try:
            check_params(group["params"])
            check_hyperparameters(group["lr"], group["betas"], group["weight_decay"])
            _check_flags({k: group[k] for k in _FLAGS if k in group})
            if path is not None:  # after construction
                everything = [p for g in self.param_groups for p in g["params"]]
                if sharded.sharded_params(everything):
                    for i, p in enumerate(everything):
                        sharded.check_param(i, p, everything[0])
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise
        if path is not None:
            path.added(group)

    # ------------------------------------------------------------------------- one step

    @torch.no_grad()
    def step(self, closure=None, *, grad_scaler=None):
        """One step on every rank. ``grad_scaler`` is passed by ``torch.amp.GradScaler.step``
        (never pass it yourself)."""
        attached_group(self.group, self)
        self._runtime()
        if self._path.engine is not None and self._path.engine.replaced:
            raise RuntimeError(
                "this DistributedLion no longer steps: a DistributedLion(overlap=True) built "
                "later on the same parameters took over their backward hooks; step that one "
                "(nothing was modified)")
        gate = self._gate
        if gate is None:
            return self._path.step(closure, grad_scaler)
        # the same step through torchft's quorum (elastic.py): a failed collective commits
        # nothing and is not raised; the step applies only if should_commit says so
        params = trainable(self.param_groups)
        step = max((self.state[p].get("step", 0) for p in params), default=0)
        self._last_stats, loss = None, None
        with gate.turn(step):
            loss = self._path.step(closure, grad_scaler)
        sharding = self._path.sharding
        stats = self.__dict__.get("_last_stats") or StepStats(
            0, 0, sum(sharded.own_shard(p).numel() for p in params), gate.participants,
            self.mode, self.votes, "none", skipped=True,
            shards=sharding.shards if sharding is not None else 1)
        self._last_stats = dataclasses.replace(
            stats, skipped=stats.skipped or not gate.committed, participants=gate.participants,
            committed=gate.committed, manager_step=gate.manager.current_step())
        return loss

    def no_sync(self):
        """Inside it, ``backward()`` only accumulates gradients; nothing is exchanged. For
        gradient accumulation with ``overlap=True``: every micro-batch but the last. With
        ``overlap=False`` (nothing is exchanged during backward anyway) it does nothing."""
        self._runtime()
        if self._path.engine is None:
            return contextlib.nullcontext()
        return self._path.engine.no_sync()

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
        groups, block = self._path.load_groups()
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
            self.state[p]["exp_avg"] = self._path.loaded_momentum(m, p)
        self._path.after_load()

    # The interface of DDP's comm hook (optim/ddp_hook.py): DDP's buckets run the exchange.

    @property
    def ddp_hooked(self) -> bool:
        """Whether a DDP model's comm hook runs this optimizer's bucket exchanges."""
        self._runtime()
        return self._path.ddp_hooked

    def attach_ddp_hook(self) -> None:
        """Hand the bucket exchanges to a DDP comm hook: this optimizer's own backward hooks
        (``overlap=True``) are removed, and ``step()`` finishes the buckets the hook started."""
        self._runtime()
        self._path.attach_ddp_hook()

    def exchange_bucket(self, params, grads) -> None:
        """Start the exchange of one DDP bucket: ``params`` and their ``grads`` (DDP's views of
        its flat buffer), laid out from block 0 in this order."""
        self._runtime()
        if not isinstance(self._path, FlatPath):
            raise ValueError("exchange_bucket runs DDP's buckets on one process group: a "
                             "DistributedLion with hierarchy (L > 1) cannot run them")
        try:
            self._path.exchange_bucket(list(params), list(grads))
        except (TypeError, ValueError) as e:
            ex = self._path.exchange
            if ex is not None and ex.aborted and ex.problem is None:
                ex.problem = e  # what step() names when it raises the step's one verdict
            raise

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
            self._path.check_momentum(m, p, f"state_dict['state'][{i!r}]['exp_avg']")
        if len(groups) != len(saved_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)):
            raise ValueError("loaded state dict contains a parameter group that doesn't match "
                             "the size of optimizer's group")
        return loaded
