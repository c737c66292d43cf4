"""``DiLoCo``: local steps, and every ``sync_every`` inner steps an outer step (SPEC §11), with
D-Lion's 1-bit vote or DiLoCo's fp32 Nesterov as the outer optimizer.

Rank i keeps theta_bar, the parameters at the last sync (fp32, bit-identical on every rank; at
first the initial parameters, which must be identical on every rank: checked at construction),
and trains alone with its inner optimizer. At a sync (inner step t) it forms its pseudo-gradient
d_i = theta_bar - theta_i in fp32 and:

    outer="dlion"     SPEC §1 with d_i as rank i's gradient and m_i its own outer momentum:
                        c_i = b1 m_i + (1 - b1) d_i ;  D = aggregate(vote(c_1), .., vote(c_n))
                        m_i = b2 m_i + (1 - b2) d_i ;  theta_bar -= lr (D + wd theta_bar)
                      on the exchange's fused stages and two collectives (``exchange/``): 1 bit
                      per parameter each way for vote/binary (SPEC §2); the tie rule's step is t.
    outer="nesterov"  DiLoCo (Douillard et al., arXiv 2311.08105): d = (sum_i d_i) / n by one
                      fp32 all-reduce (a sum, then a division by n); per tensor, with torch.optim.
                      SGD(nesterov=True)'s operations: u = mu u + d ;  theta_bar -= lr (d + mu u)

then theta_i = theta_bar on every rank. The inner optimizer's state is left as it is. Between syncs
``step()`` sends nothing and changes nothing.

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

FSDP2 (``device_mesh=``, SPEC §10's mesh of N replicas x L shards, the model sharded with
``fully_shard(module, mesh=mesh["shard"])``): every rank takes the steps above on its local
shards. theta_bar, the outer momenta and d_i are of the local shard; the vote (or Nesterov's
all-reduce) runs in the replicate group, between the N ranks holding the same shard, so the bytes
are SPEC §2's for N voters on the local elements, between nodes. The fragments are cut by the
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

Failures (SPEC §9): a dead or stalled peer makes ``step()`` raise ``DistributedStepError``
naming the sync's inner step and the collective; theta_bar, the outer momenta and the
parameters are as before the call (an exchange that failed is dropped). A pseudo-gradient with
inf or NaN on any rank: ``nonfinite="raise"`` raises ``NonFiniteGradientError`` on every rank
with nothing modified; ``"skip"`` drops the sync on every rank (theta_bar and momenta unchanged)
and returns the fragment's parameters to theta_bar, so a rank that diverged restarts from the
last synced point. Either way the inner step counter does not advance past a failed call.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..decentralized.wrapper import gossip_bytes_per_step
from ..exchange import sharded
from ..exchange.checks import check_hyperparameters, check_options, check_params
from ..exchange.collectives import DistributedStepError, as_timedelta, collective, wait
from ..exchange.pipeline import (
    Exchange,
    NonFiniteGradientError,
    Segment,
    Streams,
    all_gather,
    check_group_device,
    resolve_group,
)
from ..kernels.layout import block_offsets
from . import fragments as frag

OUTERS = ("dlion", "nesterov")
# Nesterov: DiLoCo's values. D-Lion: see the docs (docs/diloco.md, "Choosing outer_lr").
DEFAULT_OUTER_LR = {"dlion": 1e-2, "nesterov": 0.7}
FORMAT = "dlion_kernels.DiLoCo"
ALL_REDUCE = "all_reduce(pseudo-gradient)"
DIGESTS = "all_gather(parameter digests)"
# FSDP2: the non-finite flag of Nesterov's mean, agreed over the whole mesh
FLAGS = "all_reduce(mesh non-finite flags)"
_LABEL = "DiLoCo sync at inner step"
_APPLIED = ("nothing of this sync was applied: theta_bar, the outer momenta and the parameters "
            "are as before this step() on this rank")


@dataclass(frozen=True)
class SyncStats:
    """One sync of one fragment on this rank. Bytes are what this rank's collectives sent and
    received for it (D-Lion: the exchange's own count; Nesterov: a ring all-reduce's
    2 (n-1)/n * 4 numel)."""

    step: int           # inner step of the sync (its pseudo-gradient and exchange start)
    applied_step: int   # inner step at which it was applied: step + overlap_steps
    fragment: int
    outer: str
    numel: int
    world_size: int
    bytes_sent: int
    bytes_received: int
    skipped: bool = False
    mode: str | None = None     # D-Lion only
    votes: str | None = None
    backend: str | None = None
    # FSDP2 (``device_mesh=``): numel counts this rank's local elements and world_size is N, the
    # replicas voting on them; bytes_sent adds the small agreement over the whole mesh
    intra_node_bytes_sent: int = 0
    shards: int = 1

    @property
    def inter_node_bytes_sent(self) -> int:
        """What went between the replicas (all of ``bytes_sent`` without FSDP2)."""
        return self.bytes_sent - self.intra_node_bytes_sent

    @property
    def allreduce_fp32_bytes(self) -> int:
        """What a ring all-reduce of the fp32 pseudo-gradients sends per rank (DiLoCo's sync)."""
        return round(gossip_bytes_per_step(self.numel, 4, self.world_size))


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
        return [sharded.local(p) for p in self.params]

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
        self.exchange = None  # D-Lion: the Exchange after add()
        self.work = None      # Nesterov: the all-reduce's Work (None with one rank)
        self.summed = None    # Nesterov: the all-reduce's buffer


class DiLoCo:
    """Local steps with an outer step every ``sync_every`` inner steps (SPEC §11; the module
    docstring gives the math, the fragments' schedule, the overlap merge, checkpoints and
    failures).

    model: the ``torch.nn.Module`` every rank trains; its trainable parameters (``requires_grad``
        at construction; frozen ones are left out, as torch optimizers leave them) are synced.
        They must be bit-identical on every rank at construction (checked: ValueError otherwise).
    inner_optimizer: any ``torch.optim.Optimizer`` over the model's parameters (``dk.AccumAdamW``
        and ``dk.AccumLion`` included) holding every trainable one. Call ``diloco.step()`` after
        each ``inner_optimizer.step()``; nothing else is sent between syncs.
    sync_every: H, inner steps between two syncs of a fragment (a multiple of ``fragments``).
    outer: "dlion" (1-bit vote, per-rank outer momentum) or "nesterov" (DiLoCo's fp32 all-reduce).
    outer_lr: None for the default: 0.7 for Nesterov (DiLoCo's); 1e-2 for D-Lion, whose sign step
        moves every element by outer_lr per sync: about 0.4 x inner lr x H was best in a sweep
        (docs/diloco.md, "Choosing outer_lr"), so scale it with your inner lr and H.
    outer_betas, outer_weight_decay, mode, votes, backend: D-Lion's (SPEC §1, §3).
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

    ``last_stats`` is the ``SyncStats`` of the last sync applied (None before the first);
    ``bytes_sent`` adds up every sync's bytes on this rank.
    """

    def __init__(self, model, inner_optimizer, sync_every: int, outer: str = "dlion", *,
                 outer_lr: float | None = None, outer_betas=(0.9, 0.99),
                 outer_weight_decay: float = 0.0, outer_momentum: float = 0.9,
                 mode: str = "vote", votes: str = "binary", fragments: int = 1,
                 overlap_steps: int = 0, merge_alpha: float = 0.5, group=None, backend=None,
                 nonfinite: str = "raise", timeout=None, device_mesh=None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise TypeError("inner_optimizer must be a torch.optim.Optimizer, got "
                            f"{type(inner_optimizer).__name__}")
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
        if outer_lr is None:
            outer_lr = DEFAULT_OUTER_LR[outer]
        beta1, beta2 = check_hyperparameters(outer_lr, outer_betas, outer_weight_decay)
        if not isinstance(outer_momentum, (int, float)) or isinstance(outer_momentum, bool) \
                or not 0.0 <= outer_momentum < 1.0:
            raise ValueError(f"outer_momentum must be a number in [0, 1), got {outer_momentum!r}")
        if not isinstance(merge_alpha, (int, float)) or isinstance(merge_alpha, bool) \
                or not 0.0 <= merge_alpha <= 1.0:
            raise ValueError(f"merge_alpha must be a number in [0, 1], got {merge_alpha!r}")
        check_options(mode, votes, backend, nonfinite)
        self.timeout = as_timedelta(timeout)
        params = self._trainable(model, inner_optimizer)
        # FSDP2: the exchange runs between the replicas of this rank's shards (SPEC §10)
        self._sharding = sharded.resolve(params, device_mesh, group)
        device = check_params([sharded.local(p) for p in params])
        exchange_group = self._sharding.replicate if self._sharding is not None else group
        pg, self.world_size = resolve_group(exchange_group)
        check_group_device(pg, self.world_size, device)

        self.model, self.inner_optimizer, self.group = model, inner_optimizer, exchange_group
        self.sync_every, self.outer, self.outer_lr = sync_every, outer, float(outer_lr)
        self.outer_betas, self.outer_weight_decay = (beta1, beta2), float(outer_weight_decay)
        self.outer_momentum, self.merge_alpha = float(outer_momentum), float(merge_alpha)
        self.mode, self.votes, self.backend, self.nonfinite = mode, votes, backend, nonfinite
        self.fragments, self.overlap_steps = fragments, overlap_steps
        cuts = frag.split([p.numel() for p in params], fragments)
        self._check_same_start(params, cuts)
        segment = Segment([], [], [], self.outer_lr, beta1, beta2, self.outer_weight_decay) \
            if outer == "dlion" else None
        self._fragments = [_Fragment(f, [params[i] for i in cut], segment)
                           for f, cut in enumerate(cuts)]
        self._streams = Streams(device)
        self.inner_step = 0
        self.last_stats: SyncStats | None = None
        self.bytes_sent = 0
        self._inflight: _InFlight | None = None
        self._reissue = False  # a loaded in-flight sync whose exchange the next step() issues

    # ------------------------------------------------------------------------- construction

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

    def _config(self, params, cuts) -> bytes:
        mesh = None if self._sharding is None else (self._sharding.replicas,
                                                    self._sharding.shards)
        return repr((self.sync_every, self.outer, self.outer_lr, self.outer_betas,
                     self.outer_weight_decay, self.outer_momentum, self.merge_alpha, self.mode,
                     self.votes, self.nonfinite, self.fragments, self.overlap_steps, mesh,
                     [(tuple(p.shape), str(p.dtype)) for p in params],
                     [(c.start, c.stop) for c in cuts])).encode()

    def _gather_digests(self, digest: bytes, group, device) -> torch.Tensor:
        """Every rank's ``digest`` in ``group``: [ranks, len(digest)] uint8 on the CPU."""
        mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8).to(device)
        size = dist.get_world_size(group)
        out = torch.empty(size * mine.numel(), dtype=torch.uint8, device=device)
        collective(DIGESTS, 0, all_gather, out, mine, group, timeout=self.timeout, label=_LABEL,
                   applied="nothing was built")
        return out.view(size, -1).cpu()

    def _check_same_start(self, params, cuts) -> None:
        """Every rank has the same arguments and each replica bit-identical parameters (one
        all_gather of two 16-byte digests in the exchange's group; with FSDP2 one more of the
        arguments' digest in the shard group); ValueError on every rank otherwise, before
        anything is kept."""
        config = hashlib.blake2b(self._config(params, cuts), digest_size=16).digest()
        device = sharded.local(params[0]).device
        if self._sharding is not None and self._sharding.shards > 1:
            rows = self._gather_digests(config, self._sharding.shard, device)
            differs = [r for r in range(rows.shape[0]) if not torch.equal(rows[r], rows[0])]
            if differs:
                ranks = dist.get_process_group_ranks(self._sharding.shard)
                raise ValueError(
                    f"ranks {[ranks[r] for r in differs]} of this rank's shard group {ranks} "
                    f"built DiLoCo with other arguments, or over another mesh or model, than rank "
                    f"{ranks[0]}: every rank must call DiLoCo(...) alike")
        if self.world_size == 1:
            return
        weights = hashlib.blake2b(digest_size=16)
        for p in params:
            local = sharded.local(p).detach().reshape(-1).contiguous()
            weights.update(local.view(torch.uint8).cpu().numpy())
        pg = resolve_group(self.group)[0]
        rows = self._gather_digests(config + weights.digest(), pg, device)
        # rank names: global ranks (the group's position when it is the default group)
        ranks = dist.get_process_group_ranks(pg) if self._sharding is not None \
            else list(range(self.world_size))
        config_differs = [ranks[r] for r in range(self.world_size)
                          if not torch.equal(rows[r, :16], rows[0, :16])]
        if config_differs:
            raise ValueError(f"ranks {config_differs} built DiLoCo with other arguments or a model "
                             f"of other parameter shapes/dtypes than rank {ranks[0]}: every rank "
                             "must call DiLoCo(...) alike")
        differs = [ranks[r] for r in range(self.world_size)
                   if not torch.equal(rows[r, 16:], rows[0, 16:])]
        if differs:
            what = "local shards of the model's parameters" if self._sharding is not None \
                else "model's parameters"
            raise ValueError(f"{what} on ranks {differs} differ from rank {ranks[0]}'s: every "
                             "rank must start from the same weights (seed the initialization "
                             "alike). Resuming from a checkpoint: build DiLoCo on the fresh "
                             "model, then load the model's, the inner optimizer's and DiLoCo's "
                             "state dicts")

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
            self._issue(self._inflight)
        if self._inflight is not None and t == self._inflight.step + self.overlap_steps:
            applied = self._apply(t)
        f = frag.due(t, self.sync_every, self.fragments)
        if f is not None:
            fragment = self._fragments[f]
            self._inflight = _InFlight(fragment, t, fragment.pseudo_gradient())
            self._issue(self._inflight)
            if self.overlap_steps == 0:
                applied = self._apply(t)
        self.inner_step = t
        return applied

    def _issue(self, inflight: _InFlight) -> None:
        """Start the sync's exchange (asynchronous)."""
        fragment, n = inflight.fragment, self.world_size
        try:
            if self.outer == "dlion":
                ex = Exchange(device=fragment.theta.device, mode=self.mode, votes=self.votes,
                              group=self.group, backend=self.backend, step=inflight.step,
                              nonfinite=self.nonfinite, streams=self._streams,
                              timeout=self.timeout)
                rows = [ex.row(x, g, m, off, fragment.segment) for x, g, m, off in zip(
                    fragment.views(fragment.theta), fragment.views(inflight.grad),
                    fragment.views(fragment.momentum), fragment.offsets)]
                ex.add(rows, fragment.blocks)
                inflight.exchange = ex
            else:
                # overlap: the pseudo-gradient stays apart from the buffer being reduced (a
                # checkpoint inside the window saves it)
                summed = inflight.grad.clone() if self.overlap_steps else inflight.grad
                if n > 1:
                    inflight.work = collective(ALL_REDUCE, inflight.step, dist.all_reduce,
                                               summed, group=resolve_group(self.group)[0],
                                               async_op=True, label=_LABEL, applied=_APPLIED)
                inflight.summed = summed
        except DistributedStepError as e:
            self._inflight = None
            raise self._as_sync_error(e, inflight) from e

    def _apply(self, t: int) -> SyncStats:
        """Finish the in-flight sync and apply it (or raise, with nothing modified)."""
        inflight, self._inflight = self._inflight, None  # its collectives end here either way
        fragment, n = inflight.fragment, self.world_size
        try:
            intra = 0
            if self.outer == "dlion":
                agreement = None if self._sharding is None else \
                    sharded.ShardAgreement(self._sharding, inflight.step, self.timeout)
                stats = inflight.exchange.finish(agree=agreement)
                skipped, sent = stats.skipped, stats.bytes_sent
                intra = 0 if agreement is None else agreement.sent
            else:
                if inflight.work is not None:
                    wait(inflight.work, inflight.step, ALL_REDUCE, self.timeout, label=_LABEL,
                         applied=_APPLIED)
                mean = inflight.summed.div_(n) if n > 1 else inflight.summed
                skipped, intra = self._nonfinite_anywhere(mean, inflight.step)
                if skipped and self.nonfinite == "raise":
                    raise NonFiniteGradientError("a pseudo-gradient holds inf or NaN")
                if not skipped:
                    self._nesterov(fragment, mean)
                sent = round(gossip_bytes_per_step(fragment.numel, 4, n))
            sent = received = sent + intra
        except DistributedStepError as e:
            raise self._as_sync_error(e, inflight) from e
        except NonFiniteGradientError as e:
            raise NonFiniteGradientError(
                f"DiLoCo sync at inner step {inflight.step} (fragment {fragment.index}): a "
                "pseudo-gradient holds inf or NaN on at least one rank; theta_bar, the outer "
                "momenta and the parameters are unchanged on every rank (nonfinite='skip' drops "
                "such syncs and returns every rank to theta_bar)") from e
        if skipped or self.overlap_steps == 0 or self.merge_alpha == 0.0:
            fragment.set_params()
        else:
            fragment.merge_params(self.merge_alpha)
        d_lion = self.outer == "dlion"
        self.last_stats = SyncStats(
            step=inflight.step, applied_step=t, fragment=fragment.index, outer=self.outer,
            numel=fragment.numel, world_size=n, bytes_sent=sent, bytes_received=received,
            skipped=skipped, mode=self.mode if d_lion else None,
            votes=self.votes if d_lion else None,
            backend=inflight.exchange.backend if d_lion else None, intra_node_bytes_sent=intra,
            shards=self._shards)
        self.bytes_sent += sent
        return self.last_stats

    def _nonfinite_anywhere(self, mean: torch.Tensor, step: int) -> tuple[bool, int]:
        """Whether the mean pseudo-gradient holds inf or NaN here or, with FSDP2, on any rank of
        the mesh (the other shards' means: one decision for the whole model), and the
        bytes that cost this rank (a ring all-reduce of one int32 flag)."""
        flag = torch.isfinite(mean).all().logical_not().to(torch.int32).view(1)
        if self._shards == 1:
            return bool(flag), 0
        # over the whole mesh, the sync's last collective: it completes on no rank unless every
        # rank has its mean, so the sync applies on every rank or on none
        mesh = sharded.mesh_group(self._sharding, step, self.timeout)
        collective(FLAGS, step, dist.all_reduce, flag, op=dist.ReduceOp.MAX,
                   group=mesh, timeout=self.timeout, label=_LABEL, applied=_APPLIED)
        return bool(flag), round(gossip_bytes_per_step(1, 4, dist.get_world_size(mesh)))

    def _nesterov(self, fragment: _Fragment, mean: torch.Tensor) -> None:
        """torch.optim.SGD(momentum=mu, nesterov=True)'s update, tensor by tensor."""
        d, u = fragment.views(mean), fragment.views(fragment.momentum)
        torch._foreach_mul_(u, self.outer_momentum)
        torch._foreach_add_(u, d)
        update = torch._foreach_add(d, u, alpha=self.outer_momentum)
        torch._foreach_add_(fragment.views(fragment.theta), update, alpha=-self.outer_lr)

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
        if inflight.exchange is not None:
            inflight.exchange.abandon()
        elif inflight.work is not None:
            wait(inflight.work, inflight.step, ALL_REDUCE, self.timeout, label=_LABEL,
                 applied=_APPLIED)

    # ------------------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict:
        """This rank's DiLoCo state (module docstring, "Checkpoints"): copies, safe to keep."""
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
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore ``state_dict()``'s state (every rank its own). Everything is checked first:
        a state of another configuration raises ValueError and changes nothing. An exchange in
        flight in this object is finished first, without being applied (every rank loads)."""
        self._check_state(state_dict)
        self._drop_inflight()
        self._reissue = False
        for f, theta, mom in zip(self._fragments, state_dict["theta_bar"],
                                 state_dict["momentum"]):
            f.theta.copy_(theta)
            f.momentum.copy_(mom)
        self.inner_step = int(state_dict["inner_step"])
        saved = state_dict["in_flight"]
        if saved is not None:
            fragment = self._fragments[saved["fragment"]]
            grad = saved["pseudo_gradient"].to(device=fragment.theta.device,
                                               dtype=torch.float32, copy=True)
            self._inflight = _InFlight(fragment, int(saved["step"]), grad)
            self._reissue = True

    def _check_state(self, sd) -> None:
        if not isinstance(sd, dict) or sd.get("format") != FORMAT:
            raise ValueError("state_dict must come from DiLoCo.state_dict()")
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
    def fragment_params(self) -> list:
        """The parameters of each fragment, fragment by fragment (FSDP2: the DTensors)."""
        return [list(f.params) for f in self._fragments]


__all__ = ["DiLoCo", "SyncStats"]
