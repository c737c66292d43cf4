"""``DiLoCo``: local steps, and every ``sync_every`` inner steps an outer step (DiLoCo), with
D-Lion's 1-bit vote or DiLoCo's fp32 Nesterov as the outer optimizer.

Rank i keeps theta_bar, the parameters at the last sync (fp32, bit-identical on every rank; at
first the initial parameters, which must be identical on every rank: checked at construction),
and trains alone with its inner optimizer. At a sync (inner step t) it forms its pseudo-gradient
d_i = theta_bar - theta_i in fp32 and:

    outer="dlion"     the D-Lion step with d_i as rank i's gradient and m_i its own outer momentum:
                        c_i = b1 m_i + (1 - b1) d_i ;  D = aggregate(vote(c_1), .., vote(c_n))
                        m_i = b2 m_i + (1 - b2) d_i ;  theta_bar -= lr (D + wd theta_bar)
                      on the exchange's fused stages and two collectives (``exchange/``): 1 bit
                      per parameter each way for vote/binary; the tie rule's step is t.
    outer="nesterov"  DiLoCo (Douillard et al., arXiv 2311.08105): d = (sum_i d_i) / n by one
                      fp32 all-reduce (a sum, then a division by n); per tensor, with torch.optim.
                      SGD(nesterov=True)'s operations: u = mu u + d ;  theta_bar -= lr (d + mu u)

then theta_i = theta_bar on every rank. The inner optimizer's state is left as it is. Between syncs
``step()`` sends nothing and changes nothing. ``outer_options`` (error feedback, a per-tensor scale,
thresholded ternary votes for "dlion") and ``outer="sparseloco"`` (the SparseLoCo baseline) run
their outer step from ``outer_options.py`` at the same points, through the same hooks.

Fragments (``fragments=P``, Streaming DiLoCo, arXiv 2501.18512): the trainable parameters are cut
into P contiguous runs (``fragments.py``: whole tensors, about equal sizes); each has its own
theta_bar and outer momenta and syncs alone, fragment f at the inner steps t with
t mod H == ((f + 1) H / P) mod H.

Overlap (``overlap_steps=tau`` >= 1, tau < H / P): a fragment's exchange starts at its sync step
t0 (d_i is taken then; D-Lion's all_to_all or Nesterov's all-reduce is issued asynchronously) and
is applied at the ``step()`` of inner step t0 + tau, after tau more local steps. Streaming
DiLoCo's merge then mixes the fragment's local parameters with the new theta_bar:

    theta_i = lerp(theta_bar, theta_i, alpha) = theta_bar + alpha (theta_i - theta_bar)

in fp32 (``torch.lerp``'s arithmetic), alpha = ``merge_alpha``: 0 drops the tau local steps, 1
keeps the local parameters as they are; the default 0.5 is an even mix. theta_bar stays
bit-identical on every rank; with alpha > 0 the parameters differ between ranks by alpha times
their tau local steps. The pseudo-gradient of the fragment's next sync is again taken against
theta_bar. D-Lion's second collective (the all_gather of the tallied votes) is issued at the apply
step, through the exchange's public ``finish()``; Nesterov's all-reduce runs entirely in the
background. At most one exchange is in flight (tau < H / P), so the collectives of every rank
are issued in the same order.

FSDP2 (``device_mesh=``, a mesh of N replicas x L shards, the model sharded with
``fully_shard(module, mesh=mesh["shard"])``): every rank takes the steps above on its local
shards. theta_bar, the outer momenta and d_i are of the local shard; the vote (or Nesterov's
all-reduce) runs in the replicate group, between the N ranks holding the same shard, so the bytes
are the wire's for N voters on the local elements, between nodes. The fragments are cut by the
global sizes, so every rank syncs the same tensors at the same step. One skip/raise decision
for the whole model: D-Lion's headers and Nesterov's non-finite flag are also gathered over
the whole mesh (a few bytes per rank), as the sync's last collective, so that a sync applies on
every rank or on none (``exchange/sharded.py``, ``ShardAgreement``). The same-start check
compares the local shards within each replicate group and the arguments within each shard
group. ``group=`` may name the replicate group instead of ``device_mesh`` (as for
``DistributedLion``).

Checkpoints: ``state_dict()`` holds the inner step, every fragment's theta_bar and outer
momentum, and, inside an overlap window, the fragment's pseudo-gradients; loading it re-issues
that exchange at the next ``step()``, which gives the same result (same inputs, same tie-rule
step), so a resume is exact anywhere. Save the model's and the inner optimizer's state dicts
with it, on every rank (outer momenta differ between ranks): ``dk.save_state`` works on a
``DiLoCo`` too.

Failures: a dead or stalled peer makes ``step()`` raise ``DistributedStepError``
naming the sync's inner step and the collective; theta_bar, the outer momenta and the
parameters are as before the call (an exchange that failed is dropped). A pseudo-gradient with
inf or NaN on any rank: ``nonfinite="raise"`` raises ``NonFiniteGradientError`` on every rank
with nothing modified; ``"skip"`` drops the sync on every rank (theta_bar and momenta unchanged)
and returns the fragment's parameters to theta_bar, so a rank that diverged restarts from the
last synced point. Either way the inner step counter does not advance past a failed call.

One decision (``exchange/agree.py``): the constructor and ``load_state_dict`` check on each rank
without raising, then every rank sees every rank's problem and digests (arguments, starting
weights, inner step, theta_bar) and raises the same error or proceeds. At a sync, Nesterov's
all-reduce carries every rank's inner step (2 fp32 words per rank, in ``bytes_sent``; with
FSDP2 the shard group's flag all-reduce carries them across the mesh): ranks at different steps
raise ``StepMismatchError`` on every rank with nothing applied, as D-Lion's header does.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import elastic
from ..elastic import DEFAULT_HEAL_MOMENTUM
from ..exchange import agree, sharded
from ..exchange.checks import check_hyperparameters, check_options, check_params
from ..exchange.collectives import DistributedStepError, as_timedelta
from ..exchange.header import StepMismatchError
from ..exchange.pipeline import (
    NonFiniteGradientError,
    Segment,
    StepAbortedError,
    StepStats,
    Streams,
    check_group_device,
    resolve_group,
)
from ..kernels.layout import block_offsets
from ..optim.dlion import DistributedLion
from . import fragments as frag
from . import outer as outer_steps
from . import outer_options as options_
from .outer import ALL_REDUCE, FLAGS  # noqa: F401  (the sync's collectives, by name)

OUTERS = ("dlion", "nesterov", "sparseloco")
FORMAT = "dlion_kernels.DiLoCo"
# the name a DiLoCo's state is registered under on a torchft Manager (elastic.py)
GATE_KEY = "dlion_kernels.DiLoCo"
_LABEL = "DiLoCo sync at inner step"
# What every rank of a DiLoCo must share at construction (the last two: per replica block)
_START_FACTS = ("sync_every", "outer", "outer_lr", "outer_betas", "outer_weight_decay",
                "outer_momentum", "merge_alpha", "mode", "votes", "nonfinite", "fragments",
                "overlap_steps", "outer_options", "parameters (shape, dtype)", "group sizes",
                "local shard shapes", "the model's parameters")
_APPLIED = ("nothing of this sync was applied: theta_bar, the outer momenta and the parameters "
            "are as before this step() on this rank")


@dataclass(frozen=True)
class SyncStats(StepStats):
    """One sync of one fragment on this rank: a ``StepStats`` (its bytes are what this rank's
    collectives sent and received for the sync: D-Lion's exchange's own count, Nesterov's ring
    all-reduce 2 (n-1)/n * 4 numel; ``mode``, ``votes`` and ``backend`` are D-Lion's, None
    otherwise; with FSDP2 ``numel`` counts this rank's local elements, ``world_size`` is N and
    ``intra_node_bytes_sent`` the small agreement over the mesh; with a manager the quorum's
    fields) and which sync it was."""

    step: int = 0           # inner step of the sync (its pseudo-gradient and exchange start)
    applied_step: int = 0   # inner step at which it was applied: step + overlap_steps
    fragment: int = 0
    outer: str = "dlion"


class _Fragment:
    """A run of parameters that syncs together: flat fp32 theta_bar and outer momentum, with one
    contiguous view per parameter. With FSDP2 they hold this rank's local shards only (the
    parameters stay the DTensors FSDP2 manages; their local tensors are looked up at each use)."""

    def __init__(self, index: int, params: list, segment: Segment | None):
        self.index, self.params, self.segment = index, params, segment
        local = self.locals()
        self.shapes = [t.shape for t in local]
        self.numels = [t.numel() for t in local]
        self.numel = sum(self.numels)
        self.theta = torch.cat([t.detach().reshape(-1).float() for t in local])
        self.momentum = torch.zeros_like(self.theta)
        self.offsets, self.blocks = block_offsets(self.numels)

    def locals(self) -> list:
        """The tensors synced: the parameters, or their local shards (FSDP2)."""
        return [sharded.own_shard(p) for p in self.params]

    def views(self, flat: torch.Tensor) -> list:
        out, start = [], 0
        for shape, k in zip(self.shapes, self.numels):
            out.append(flat[start : start + k].view(shape))
            start += k
        return out

    def pseudo_gradient(self) -> torch.Tensor:
        """d = theta_bar - theta_i, fp32, flat."""
        local = torch.cat([t.detach().reshape(-1).float() for t in self.locals()])
        return torch.sub(self.theta, local, out=local)

    def set_params(self) -> None:
        torch._foreach_copy_(self.locals(), self.views(self.theta))

    def merge_params(self, alpha: float) -> None:
        for p, t in zip(self.locals(), self.views(self.theta)):
            p.copy_(torch.lerp(t, p.detach().float(), alpha))


class _InFlight:
    """A fragment's sync between its start and its apply."""

    def __init__(self, fragment: _Fragment, step: int, grad: torch.Tensor):
        self.fragment, self.step, self.grad = fragment, step, grad
        self.sync = None  # the outer step's sync in flight (``outer.py``), once started
        self.n = 1  # the replicas it runs between


def _dtensors(model) -> bool:
    try:
        return any(sharded.is_dtensor(p) for p in model.parameters())
    except Exception:  # not a model: the start check reports it
        return False


class DiLoCo:
    """Local steps with an outer step every ``sync_every`` inner steps (the module
    docstring gives the math, the fragments' schedule, the overlap merge, checkpoints and
    failures).

    model: the ``torch.nn.Module`` every rank trains; its trainable parameters (``requires_grad``
        at construction; frozen ones are left out, as torch optimizers leave them) are synced.
        They must be bit-identical on every rank at construction (checked: ValueError otherwise).
    inner_optimizer: any ``torch.optim.Optimizer`` over the model's parameters (``dk.AccumAdamW``
        and ``dk.AccumLion`` included) holding every trainable one. Call ``diloco.step()`` after
        each ``inner_optimizer.step()``; nothing else is sent between syncs.
    sync_every: H, inner steps between two syncs of a fragment (a multiple of ``fragments``).
    outer: "dlion" (1-bit vote, per-rank outer momentum), "nesterov" (DiLoCo's fp32 all-reduce)
        or "sparseloco" (the SparseLoCo baseline: top-k, 2-bit values, error feedback;
        ``outer_options.py``).
    outer_options: None for the default: for "dlion" error feedback halved at every sync
        (``DLionOuterOptions(error_feedback=True, ef_decay=0.5)``, the best of the outer steps
        measured; ``DLionOuterOptions()``, every option off, is the plain 1-bit step), for
        "sparseloco" ``SparseLoCoOptions()``; a ``DLionOuterOptions`` (error feedback, a
        per-tensor scale, thresholded ternary votes) or ``SparseLoCoOptions``, or a dict of
        their fields (``outer_options.py``: the rules, bytes and memory of each).
    outer_lr: None for the default (``outer_options.default_outer_lr``, from the inner
        optimizer's lr at construction): 1.1 x inner lr x sqrt(H) for the default D-Lion step
        (a sign step moves every element by about outer_lr per sync), 0.16 x inner lr x H for
        the plain one, 0.7 for Nesterov (DiLoCo's), 1 for SparseLoCo.
    outer_betas, outer_weight_decay, mode, votes, backend: D-Lion's (``DistributedLion``'s meaning).
    outer_momentum: Nesterov's mu (DiLoCo's 0.9).
    fragments: P, Streaming DiLoCo's fragments. overlap_steps: tau < H / P, the inner steps an
        exchange runs in the background before it is applied. merge_alpha: the overlap merge's
        alpha in [0, 1] (used only with overlap_steps >= 1).
    group: the process group (None: the default one, or a single process without one); for FSDP2
        parameters without ``device_mesh``, the replicate group. ``self.group`` is the group the
        exchange runs on (the replicate group with FSDP2).
    device_mesh: for a model sharded by FSDP2 (DTensor parameters): the 2-D mesh (dims
        "replicate", "shard") or the 1-D shard mesh (N = 1); module docstring, "FSDP2".
    nonfinite: "raise" or "skip" (module docstring). timeout: None (the group's own) or seconds /
        a timedelta bounding each wait for a collective of a sync.

    manager: a ``torchft.Manager`` (``docs/elastic.md``): one quorum per sync (from its start
        to its apply), the sync applies only if ``manager.should_commit()``, a dead replica
        leaves the others training and a restarted one heals at the next sync
        (``heal_momentum``: "own", "peer" or "zero": D-Lion's outer momenta, error-feedback
        residuals and SparseLoCo's accumulators; Nesterov's momentum is shared and always
        copied). A replica is one process, or its own job of L ranks over which the model is
        FSDP2-sharded (the manager made with rank = its place in the replica, world_size = L).

    ``last_stats`` is the ``SyncStats`` of the last sync applied (None before the first; with a
    manager its ``participants``, ``committed`` and ``manager_step`` too); ``bytes_sent`` adds
    up every sync's bytes on this rank.
    """

    def __init__(self, model, inner_optimizer, sync_every: int, outer: str = "dlion", *,
                 outer_lr: float | None = None, outer_betas=(0.9, 0.99),
                 outer_weight_decay: float = 0.0, outer_momentum: float = 0.9,
                 mode: str = "vote", votes: str = "binary", fragments: int = 1,
                 overlap_steps: int = 0, merge_alpha: float = 0.5, group=None, backend=None,
                 nonfinite: str = "raise", timeout=None, device_mesh=None, outer_options=None,
                 manager=None, heal_momentum: str = DEFAULT_HEAL_MOMENTUM):
        problem, params = None, []
        # With FSDP2 parameters and group=, finding the mesh is a collective: after the verdict
        late = device_mesh is None and group is not None and _dtensors(model)
        try:  # every check that can fail on one rank only, and nothing collective
            params = self._configure(
                model, inner_optimizer, sync_every, outer, outer_lr=outer_lr,
                outer_betas=outer_betas, outer_weight_decay=outer_weight_decay,
                outer_momentum=outer_momentum, mode=mode, votes=votes, fragments=fragments,
                overlap_steps=overlap_steps, merge_alpha=merge_alpha, backend=backend,
                nonfinite=nonfinite, timeout=timeout, outer_options=outer_options,
                group=group, device_mesh=device_mesh, manager=manager,
                heal_momentum=heal_momentum)
            if not late:
                self._place(params, device_mesh, group)
        except (TypeError, ValueError) as e:
            problem = e
        # one verdict on every rank: arguments, model and starting weights (exchange/agree.py)
        self._agree_at_start(problem, params, device_mesh, group, agree.bound(timeout))
        if late:
            problem = None
            try:
                self._place(params, device_mesh, group)
            except (TypeError, ValueError) as e:
                problem = e
            agree.agree(problem, [], agree.start_groups(params, device_mesh, group)[0],
                        what="DiLoCo(...)", changed="nothing was built on any rank",
                        timeout=self.timeout)
        segment = Segment([], [], [], self.outer_lr, *self.outer_betas,
                          self.outer_weight_decay) if outer == "dlion" else None
        self._fragments = [_Fragment(f, [params[i] for i in cut], segment)
                           for f, cut in enumerate(self._cuts)]
        self._streams = Streams(sharded.own_shard(params[0]).device)
        self._outer = outer_steps.make(outer, self.outer_options, self)
        self.inner_step = 0
        self.last_stats: SyncStats | None = None
        self.bytes_sent = 0
        self._inflight: _InFlight | None = None
        self._reissue = False  # a loaded in-flight sync whose exchange the next step() issues
        self._gate = None  # manager=: torchft's quorum at every sync (elastic.py)
        if manager is not None:  # every check passed on every rank: nothing to undo
            shard = self._sharding.shard if self._shards > 1 else None
            self._gate = elastic.Gate(self, manager, key=GATE_KEY, heal_momentum=heal_momentum,
                                      replica_group=shard,
                                      heal_state=weakref.WeakMethod(self._heal_state))

    # ------------------------------------------------------------------------- construction

    def _configure(self, model, inner_optimizer, sync_every, outer, *, outer_lr, outer_betas,
                   outer_weight_decay, outer_momentum, mode, votes, fragments, overlap_steps,
                   merge_alpha, backend, nonfinite, timeout, outer_options, group, device_mesh,
                   manager, heal_momentum) -> list:
        """The constructor's checks of its arguments (ValueError/TypeError on this rank alone:
        ``__init__`` turns them into one verdict); sets the options, returns the parameters."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise TypeError("inner_optimizer must be a torch.optim.Optimizer, got "
                            f"{type(inner_optimizer).__name__}")
        if isinstance(inner_optimizer, DistributedLion):
            raise ValueError(
                "inner_optimizer is a DistributedLion, which votes with the other ranks at every "
                "step: DiLoCo's inner steps are local (nothing is sent between syncs); use a "
                "local optimizer (dk.AccumLion, torch.optim.AdamW, a Lion)")
        if outer not in OUTERS:
            raise ValueError(f"outer must be one of {OUTERS}, got {outer!r}")
        for name, value, low in (("sync_every", sync_every, 1), ("fragments", fragments, 1),
                                 ("overlap_steps", overlap_steps, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if sync_every % fragments:
            raise ValueError(f"sync_every ({sync_every}) must be a multiple of fragments "
                             f"({fragments}): one fragment syncs every sync_every / fragments "
                             "steps")
        if overlap_steps >= sync_every // fragments:
            raise ValueError(f"overlap_steps must be < sync_every / fragments = "
                             f"{sync_every // fragments} (an exchange must be applied before "
                             f"the next fragment syncs), got {overlap_steps}")
        self.outer_options = options_.check(outer, outer_options, votes)
        if outer_lr is None:  # the inner optimizer's lr as it is now (its first param group)
            outer_lr = options_.default_outer_lr(outer, self.outer_options,
                                                 float(inner_optimizer.param_groups[0]["lr"]),
                                                 sync_every)
        beta1, beta2 = check_hyperparameters(outer_lr, outer_betas, outer_weight_decay)
        if not isinstance(outer_momentum, (int, float)) or isinstance(outer_momentum, bool) \
                or not 0.0 <= outer_momentum < 1.0:
            raise ValueError(f"outer_momentum must be a number in [0, 1), got {outer_momentum!r}")
        if not isinstance(merge_alpha, (int, float)) or isinstance(merge_alpha, bool) \
                or not 0.0 <= merge_alpha <= 1.0:
            raise ValueError(f"merge_alpha must be a number in [0, 1], got {merge_alpha!r}")
        check_options(mode, votes, backend, nonfinite)
        elastic.check_heal_momentum(heal_momentum, manager)
        if manager is not None:  # torchft's quorum at every sync (elastic.py)
            elastic.check_manager(manager)
            elastic.check_key(manager, GATE_KEY)
            if group is not None:
                raise ValueError(
                    "DiLoCo with manager= syncs over the process group torchft makes for each "
                    "quorum: pass group=None (a replica of several ranks is its own "
                    "torch.distributed job; its default group holds its ranks)")
        self.manager = manager
        self.timeout = as_timedelta(timeout)
        params = self._trainable(model, inner_optimizer)
        self.model, self.inner_optimizer = model, inner_optimizer
        self.sync_every, self.outer, self.outer_lr = sync_every, outer, float(outer_lr)
        self.outer_betas, self.outer_weight_decay = (beta1, beta2), float(outer_weight_decay)
        self.outer_momentum, self.merge_alpha = float(outer_momentum), float(merge_alpha)
        self.mode, self.votes, self.backend, self.nonfinite = mode, votes, backend, nonfinite
        self.fragments, self.overlap_steps = fragments, overlap_steps
        self._cuts = frag.split([p.numel() for p in params], fragments)
        return params

    def _place(self, params, device_mesh, group) -> None:
        """The exchange group: FSDP2's replicate group (the replicas of this rank's
        shards) or ``group``; checked against the parameters' device."""
        self._sharding = sharded.resolve(params, device_mesh, group)
        device = check_params([sharded.own_shard(p) for p in params])
        self.group = self._sharding.replicate if self._sharding is not None else group
        if self.manager is not None:
            self._check_replica()
            self.world_size = 1  # the quorum's replicas, at each sync
            return
        pg, self.world_size = resolve_group(self.group)
        check_group_device(pg, self.world_size, device)

    def _check_replica(self) -> None:
        """With a manager: a replica is one process, or its own job whose ranks the model is
        FSDP2-sharded over; ValueError otherwise."""
        if self._sharding is not None:
            if self._sharding.replicas != 1:
                raise ValueError(
                    f"DiLoCo with manager= and FSDP2: a replica is one shard group and the "
                    f"replicas are torchft's, but device_mesh holds {self._sharding.replicas} "
                    "replicas; pass device_mesh=None (or the 1-D mesh the model is sharded "
                    "over) and start each replica as its own torch.distributed job")
            position = dist.get_rank(self._sharding.shard) if self._sharding.shards > 1 else 0
            elastic.check_replica(self.manager, position, self._sharding.shards)
        elif dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError(
                f"DiLoCo with manager=: this job has {dist.get_world_size()} ranks and the "
                "model is not sharded over them: a replica of several ranks is one voter "
                "through FSDP2 (fully_shard the model over the replica's ranks); else start "
                "one process per replica")

    @staticmethod
    def _trainable(model, inner) -> list:
        """The model's trainable parameters, after checking that ``inner`` holds exactly those
        (and perhaps frozen ones of the model)."""
        names = {id(p): n for n, p in model.named_parameters()}
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("model has no trainable parameters (requires_grad=True)")
        held = set()
        for g, group in enumerate(inner.param_groups):
            for i, p in enumerate(group["params"]):
                if id(p) not in names:
                    raise ValueError(
                        f"inner_optimizer's param group {g} holds a parameter (index {i}, shape "
                        f"{tuple(p.shape)}) that is not one of model's parameters: build the "
                        "inner optimizer over model.parameters()")
                held.add(id(p))
        missing = [names[id(p)] for p in params if id(p) not in held]
        if missing:
            raise ValueError(f"inner_optimizer must hold every trainable parameter of model; "
                             f"missing: {missing}")
        return params

    def _agree_at_start(self, problem, params, device_mesh, group, timeout) -> None:
        """Every rank has the same arguments and model, and the replicas of each tensor (FSDP2:
        of each local shard) the same bytes; else the same ValueError on every rank, before
        anything is kept. One all_gather of a few digests per rank (two with FSDP2: the
        replicate group, then the shard group)."""
        groups, block = agree.start_groups(params, device_mesh, group)
        values = [None] * len(_START_FACTS)
        if problem is None:
            local = [sharded.own_shard(p) for p in params]
            values = [self.sync_every, self.outer, self.outer_lr, self.outer_betas,
                      self.outer_weight_decay, self.outer_momentum, self.merge_alpha, self.mode,
                      self.votes, self.nonfinite, self.fragments, self.overlap_steps,
                      repr(self.outer_options), [(tuple(p.shape), str(p.dtype)) for p in params],
                      [dist.get_world_size(g) for g in groups],
                      [tuple(t.shape) for t in local],
                      agree.digest(local) if block > 1 else b""]
        facts = [agree.Fact(name, value) for name, value in zip(_START_FACTS, values)]
        facts[-2] = agree.Fact(_START_FACTS[-2], values[-2], within=True)  # shards differ
        facts[-1] = agree.Fact(
            "the local shards of the model's parameters" if params and sharded.is_dtensor(
                params[0]) else _START_FACTS[-1], values[-1], within=True, show=False,
            hint="Every rank must start from the same weights (seed the initialization alike). "
                 "Resuming from a checkpoint: build DiLoCo on the fresh model, then load the "
                 "model's, the inner optimizer's and DiLoCo's state dicts.")
        agree.agree(problem, facts, groups, what="DiLoCo(...)", block=block,
                    changed="nothing was built on any rank", timeout=timeout)

    # ------------------------------------------------------------------------- steps

    @torch.no_grad()
    def step(self) -> SyncStats | None:
        """Call after every ``inner_optimizer.step()``. At a sync step: the outer step of the
        fragment that is due (see the module docstring); otherwise nothing. Returns the
        ``SyncStats`` of the sync applied in this call, or None."""
        t = self.inner_step + 1
        applied = None
        if self._reissue:
            self._reissue = False
            self._open(self._inflight.step)
            self._issue(self._inflight)
        if self._inflight is not None and t == self._inflight.step + self.overlap_steps:
            applied = self._apply(t)
        f = frag.due(t, self.sync_every, self.fragments)
        if f is not None:
            if self._open(t):  # healed from a peer: this replica is at the peers' sync now
                t = self.inner_step + 1
                f = frag.due(t, self.sync_every, self.fragments)
            fragment = self._fragments[f]
            self._inflight = _InFlight(fragment, t, fragment.pseudo_gradient())
            self._issue(self._inflight)
            if self.overlap_steps == 0:
                applied = self._apply(t)
        self.inner_step = t
        return applied

    @property
    def label(self) -> str:
        """How a sync's errors name it (with the inner step)."""
        return _LABEL

    @property
    def applied(self) -> str:
        """What a sync's errors say was applied: nothing."""
        return _APPLIED

    def _open(self, step: int) -> bool:
        """With a manager, the quorum of the sync starting at inner step ``step`` (it lasts until
        the sync's apply); returns whether it healed this replica. Without, nothing."""
        gate = self._gate
        if gate is None:
            return False
        gate.begin(step, label=_LABEL, applied=_APPLIED)
        return gate.healed

    def _issue(self, inflight: _InFlight) -> None:
        """Start the sync's collectives (asynchronous)."""
        gate = self._gate
        group = gate.group() if gate is not None else self.group
        inflight.n = resolve_group(group)[1]
        try:
            inflight.sync = self._outer.start(inflight.fragment, inflight.grad, inflight.step,
                                              group)
        except DistributedStepError as e:
            if gate is not None and gate.absorb(e):
                return  # a peer died: the sync applies nothing (``_apply``)
            self._inflight = None
            raise self._as_sync_error(e, inflight) from e

    def _apply(self, t: int) -> SyncStats:
        """Finish the in-flight sync and apply it (or raise, with nothing modified; with a
        manager, a failed collective or a sync not committed applies nothing and raises
        nothing)."""
        inflight, self._inflight = self._inflight, None  # its collectives end here either way
        fragment, gate = inflight.fragment, self._gate
        decision = outer_steps.Decision(
            inflight.step, sharding=self._sharding if self._shards > 1 else None,
            replica=gate is not None, commit=None if gate is None else gate.commit,
            timeout=self.timeout, label=_LABEL, applied=_APPLIED)
        result = outer_steps.SyncResult(True, 0, 0)
        try:
            try:
                if inflight.sync is not None:
                    result = inflight.sync.finish(decision)
            except (DistributedStepError, StepAbortedError) as e:
                if gate is None or not gate.absorb(e):
                    raise
            finally:
                committed = gate.end() if gate is not None else True
        except DistributedStepError as e:
            raise self._as_sync_error(e, inflight) from e
        except NonFiniteGradientError as e:
            raise NonFiniteGradientError(
                f"DiLoCo sync at inner step {inflight.step} (fragment {fragment.index}): a "
                "pseudo-gradient holds inf or NaN on at least one rank; theta_bar, the outer "
                "momenta and the parameters are unchanged on every rank (nonfinite='skip' drops "
                "such syncs and returns every rank to theta_bar)") from e
        skipped = result.skipped or not committed
        # theta_i = theta_bar: the new one, or (skipped) the last synced one, so that a rank
        # never carries a window that was not synced into the next
        if skipped or self.overlap_steps == 0 or self.merge_alpha == 0.0:
            fragment.set_params()
        else:
            fragment.merge_params(self.merge_alpha)
        d_lion = self.outer == "dlion"
        quorum = {} if gate is None else dict(
            participants=inflight.n, committed=committed,
            manager_step=gate.manager.current_step())
        self.last_stats = SyncStats(
            step=inflight.step, applied_step=t, fragment=fragment.index, outer=self.outer,
            numel=fragment.numel, world_size=inflight.n, bytes_sent=result.sent,
            bytes_received=result.received, skipped=skipped,
            mode=self.mode if d_lion else None, votes=self.votes if d_lion else None,
            backend=result.backend if d_lion else None, intra_node_bytes_sent=result.intra,
            shards=self._shards, **quorum)
        self.bytes_sent += result.sent
        return self.last_stats

    def _as_sync_error(self, e: DistributedStepError, inflight: _InFlight):
        if e.step == inflight.step and str(e).startswith(_LABEL):
            return e
        cause = e.__cause__
        detail = f"{type(cause).__name__}: {cause}" if cause is not None else str(e)
        return DistributedStepError(inflight.step, e.collective,
                                    f"fragment {inflight.fragment.index}: {detail}",
                                    label=_LABEL, applied=_APPLIED)

    def _drop_inflight(self) -> None:
        """Finish an in-flight exchange without applying it (every rank does the same)."""
        inflight, self._inflight = self._inflight, None
        if inflight is None or self._reissue:
            return
        try:
            if inflight.sync is not None:
                inflight.sync.abandon()
        finally:
            if self._gate is not None:
                self._gate.end()

    # ------------------------------------------------------------------------- elastic

    @property
    def elastic(self):
        """torchft's quorum around every sync (``elastic.Gate``: its ``key`` on the manager,
        ``close()``), or None without ``manager=``."""
        return self._gate

    def _heal_state(self):
        """What a healing replica copies (``elastic.Gate``): theta_bar and the shared outer state;
        the parameters (local shards) when it is behind; the private outer state by
        ``heal_momentum``; the inner step."""
        params = [sharded.own_shard(p) for f in self._fragments for p in f.params]
        shared = [f.theta for f in self._fragments] + self._outer.shared()
        return elastic.HealState(shared=shared, private=self._outer.private(), local=params,
                                 counters={"inner_step": self.inner_step},
                                 set_counters=self._set_counters)

    def _set_counters(self, counters: dict) -> None:
        self.inner_step = int(counters["inner_step"])

    # ------------------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict:
        """This rank's DiLoCo state (module docstring, "Checkpoints"): copies, safe to keep."""
        options = self._outer.state_dict()  # the outer options' own state (residuals)
        inflight = None
        if self._inflight is not None:
            inflight = {"fragment": self._inflight.fragment.index, "step": self._inflight.step,
                        "pseudo_gradient": self._inflight.grad.clone()}
        return {
            "format": FORMAT,
            "inner_step": self.inner_step,
            "sync_every": self.sync_every, "outer": self.outer, "fragments": self.fragments,
            "overlap_steps": self.overlap_steps, "shards": self._shards,
            "fragment_numels": [f.numel for f in self._fragments],
            "theta_bar": [f.theta.clone() for f in self._fragments],
            "momentum": [f.momentum.clone() for f in self._fragments],
            "in_flight": inflight,
            **({} if options is None else {"outer_options": options}),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore ``state_dict()``'s state (every rank its own). Everything is checked first,
        then one verdict for the job: a state of another configuration on any rank raises
        ValueError, states of other inner steps ``StepMismatchError``, and replicas whose
        theta_bar differ ValueError, the same on every rank, and nothing changes anywhere. An
        exchange in flight in this object is finished first, without being applied (every rank
        loads)."""
        problem, step, theta = None, None, b""
        try:
            self.check_state(state_dict)
            step = (state_dict["inner_step"], None if state_dict["in_flight"] is None else
                    (state_dict["in_flight"]["fragment"], state_dict["in_flight"]["step"]))
            theta = agree.digest(state_dict["theta_bar"]) if self.world_size > 1 else b""
        except Exception as e:  # anything this rank finds must not leave the others waiting
            problem = e
        groups, block = [resolve_group(self.group)[0]], None
        if self._sharding is not None:
            groups, block = [self._sharding.replicate, self._sharding.shard], \
                self._sharding.replicas
        agree.agree(problem, [
            agree.Fact("(inner_step, in-flight (fragment, step))", step, error=StepMismatchError,
                       hint="Every rank must load the state saved at the same inner step."),
            agree.Fact("theta_bar", theta, within=True, show=False,
                       hint="theta_bar is the same on every replica: load states of one save.")],
            groups, what="DiLoCo.load_state_dict", block=block, timeout=self.timeout,
            changed="nothing was loaded on any rank")
        self._drop_inflight()
        self._reissue = False
        for f, theta, mom in zip(self._fragments, state_dict["theta_bar"],
                                 state_dict["momentum"]):
            f.theta.copy_(theta)
            f.momentum.copy_(mom)
        if state_dict.get("outer_options") is not None:
            self._outer.load_state_dict(state_dict["outer_options"])
        self.inner_step = int(state_dict["inner_step"])
        saved = state_dict["in_flight"]
        if saved is not None:
            fragment = self._fragments[saved["fragment"]]
            grad = saved["pseudo_gradient"].to(device=fragment.theta.device,
                                               dtype=torch.float32, copy=True)
            self._inflight = _InFlight(fragment, int(saved["step"]), grad)
            self._reissue = True

    def check_state(self, sd) -> None:
        """ValueError (or TypeError) unless ``sd`` is a state this DiLoCo loads: saved by a DiLoCo
        of the same schedule, outer step, options and model. Changes nothing."""
        if not isinstance(sd, dict) or sd.get("format") != FORMAT:
            raise ValueError("state_dict must come from DiLoCo.state_dict()")
        self._outer.check_state(sd.get("outer_options"))
        for key in ("sync_every", "outer", "fragments", "overlap_steps"):
            if sd.get(key) != getattr(self, key):
                raise ValueError(f"state_dict was saved with {key}={sd.get(key)!r}, this DiLoCo "
                                 f"has {key}={getattr(self, key)!r}")
        if sd.get("shards", 1) != self._shards:
            raise ValueError(f"state_dict was saved with each replica sharded over "
                             f"{sd.get('shards', 1)} ranks (FSDP2's shard dimension), this DiLoCo "
                             f"over {self._shards}: resume on the same mesh (its theta_bar and "
                             "outer momenta are this rank's local shards)")
        numels = [f.numel for f in self._fragments]
        if sd.get("fragment_numels") != numels:
            raise ValueError(f"state_dict's fragments hold {sd.get('fragment_numels')} elements, "
                             f"this model's {numels}: resume with the same model")
        step = sd.get("inner_step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"state_dict's inner_step must be an int >= 0, got {step!r}")
        for key in ("theta_bar", "momentum"):
            tensors = sd.get(key)
            if not isinstance(tensors, (list, tuple)) or len(tensors) != len(numels) or not all(
                    isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() == 1
                    and t.numel() == k for t, k in zip(tensors, numels)):
                raise ValueError(f"state_dict's {key} must be {len(numels)} flat float32 "
                                 f"tensors of {numels} elements")
        saved = sd.get("in_flight")
        if saved is None:
            return
        f, start = saved.get("fragment"), saved.get("step")
        if not (isinstance(f, int) and 0 <= f < self.fragments and isinstance(start, int)
                and frag.due(start, self.sync_every, self.fragments) == f
                and start <= step < start + self.overlap_steps):
            raise ValueError(f"state_dict's in-flight sync (fragment {f!r}, inner step "
                             f"{start!r}) does not fit inner step {step} of this schedule")
        g = saved.get("pseudo_gradient")
        if not (isinstance(g, torch.Tensor) and g.dtype == torch.float32 and g.dim() == 1
                and g.numel() == numels[f]):
            raise ValueError(f"state_dict's in-flight pseudo_gradient must be a flat float32 "
                             f"tensor of {numels[f]} elements")

    # ------------------------------------------------------------------------- inspection

    @property
    def _shards(self) -> int:
        return 1 if self._sharding is None else self._sharding.shards

    @property
    def theta_bar(self) -> list:
        """theta_bar per trainable parameter (fp32 views, ``model.parameters()`` order; with
        FSDP2, of this rank's local shards)."""
        return [v for f in self._fragments for v in f.views(f.theta)]

    @property
    def outer_momenta(self) -> list:
        """This rank's outer momentum per trainable parameter (fp32 views; Nesterov's u; with
        FSDP2, of this rank's local shards)."""
        return [v for f in self._fragments for v in f.views(f.momentum)]

    @property
    def outer_residuals(self) -> list | None:
        """The error-feedback residual of ``outer_options`` per trainable parameter (fp32 views,
        like ``theta_bar``), or None where the options keep none."""
        flats = self._outer.residuals()
        if all(r is None for r in flats):
            return None
        return [v for f in self._fragments for v in f.views(flats[f.index])]

    @property
    def fragment_params(self) -> list:
        """The parameters of each fragment, fragment by fragment (FSDP2: the DTensors)."""
        return [list(f.params) for f in self._fragments]

    # What the outer steps (outer.py) read: named here so that none of them reaches into
    # private state (the builders' state accounting reads theta_bar, outer_momenta and
    # outer_residuals above).

    @property
    def fragment_states(self) -> list:
        """Each fragment's theta_bar, outer momentum, parameters and offsets, in order."""
        return self._fragments

    @property
    def streams(self) -> Streams:
        """The streams the outer step's stages run on."""
        return self._streams


__all__ = ["DiLoCo", "SyncStats"]
