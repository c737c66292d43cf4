"""The three ways ``DistributedLion`` runs a step, one object each, chosen once per optimizer
(``DistributedLion._runtime``) from its parameters and options:

- ``FlatPath``: one process group, every rank a voter (docs/usage.md; with ``overlap=True`` or
  DDP's comm hook the buckets start during backward, docs/overlap.md);
- ``HierarchyPath``: ``hierarchy=L``, nodes of L ranks, node means vote (docs/hierarchy.md);
- ``ShardedPath``: FSDP2's DTensor parameters, the replicas of each shard vote
  (docs/fsdp.md).

``Path`` holds what they share for one step: the per-group ``Segment`` settings, the streams,
the bucket engine (``overlap=True``), giving a step up on this rank's own error so that every
rank raises the same one, and the deferred verdict. Everything here is runtime state: copies of
the optimizer (deepcopy, pickle) start without it, and make a new path on first use.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref

import torch
import torch.distributed as dist

from ..exchange import agree, sharded
from ..exchange import hierarchy as hier
from ..exchange.buckets import BucketEngine, WeakHook, remove_when_collected
from ..exchange.checks import check_hyperparameters, check_tensors
from ..exchange.collectives import DistributedStepError
from ..exchange.copying import attached_group
from ..exchange.header import settings_word
from ..exchange.pipeline import (
    ABORTED,
    Exchange,
    Segment,
    StepCounter,
    StepStats,
    Streams,
    capturing,
    resolve_group,
)
from ..kernels.layout import block_offsets
from . import amp


def trainable(param_groups) -> list:
    """The parameters that take part in a step, in param group order."""
    return [p for g in param_groups for p in g["params"] if p.requires_grad]


class Path:
    """The step machinery every path shares, for the optimizer ``opt`` (held weakly: the path
    is its runtime state and lives as long as it).

    A path runs ``step`` (the whole step, from ``DistributedLion.step``) and, with
    ``overlap=True``, ``bucket_ready`` (a bucket's part of the step, during backward). An error
    of this rank's own (bad input, a wrong setting, a failing closure) gives the step up
    (``give_up``): this rank still issues every collective of the step, nothing is applied, and
    every rank raises the same error."""

    sharding = None  # the FSDP2 layout (``exchange.sharded.Sharding``): ShardedPath's only

    def __init__(self, opt):
        self._opt = weakref.ref(opt)
        self.engine: BucketEngine | None = None  # overlap=True: the backward hooks' buckets
        self.ddp_hooked = False  # DDP's comm hook starts the buckets (optim/ddp_hook.py)
        self.streams: Streams | None = None
        self.segments: list[Segment] | None = None  # one per param group, this step
        self.group_of: dict[int, int] = {}  # parameter id -> its param group's index
        self.problem = None  # a setting found wrong at this step's start: the step is given up
        self.pending = None  # a deferred step's (verdict, stats, params, step): settle()
        self.giving_up = False
        self.flushed = False  # step() flushed the engine: every bucket of the step has started

    @property
    def opt(self):
        return self._opt()

    @property
    def gate(self):
        """torchft's quorum around the step (``elastic.Gate``), or None."""
        return self.opt.elastic

    def trainable(self) -> list:
        return trainable(self.opt.param_groups)

    def group(self):
        """The process group of the exchange: the optimizer's, or the quorum's (elastic)."""
        gate = self.gate
        if gate is not None:
            return gate.group()
        opt = self.opt
        return attached_group(opt.group, opt)

    def order_group(self):
        """The process group whose rank 0 fixes the buckets' order: the exchange's, or with a
        gate the replica's own (the order is the model's, the same in every replica)."""
        gate = self.gate
        return gate.replica_group if gate is not None else self.group()

    # ------------------------------------------------------------------------- the verdict

    def settle(self) -> None:
        """Read a deferred step's decision: a skipped step's counters go back, a step mismatch
        raises now (on every rank)."""
        pending = self.pending
        if pending is None:
            return
        self.pending = None
        opt = self.opt
        verdict, stats, params, step = pending
        skipped = True  # also when resolve() raises (a step mismatch): the step is rolled back
        try:
            skipped = verdict.resolve()
        finally:
            if skipped:
                for p in params:
                    opt.state[p]["step"] = step
        opt.last_stats = dataclasses.replace(stats, skipped=skipped)

    # ------------------------------------------------------------------------- one step

    def begin(self) -> tuple[int, torch.device]:
        """What every path needs once at the start of a step (the first bucket, or step()):
        the last step's decision settled, ``segments`` (one ``Segment`` per param group: the
        one way they are built; each path fills in its tensors), ``group_of``, and the streams.
        Returns (step counter, device)."""
        opt = self.opt
        self.settle()  # the step counters of the last step, for this step's header
        self.segments, self.group_of = [], {}
        self.problem = None
        for k, g in enumerate(opt.param_groups):
            try:
                beta1, beta2 = check_hyperparameters(g["lr"], g["betas"], g["weight_decay"])
                settings = float(g["lr"]), beta1, beta2, float(g["weight_decay"])
            except (TypeError, ValueError) as e:
                self.problem = self.problem or e
                settings = 0.0, 0.0, 0.0, 0.0
            self.segments.append(Segment([], [], [], *settings))
            self.group_of.update((id(p), k) for p in g["params"])
        params = self.trainable()
        step = max((opt.state[p].get("step", 0) for p in params), default=0)
        device = params[0].device if params else torch.device("cpu")
        if self.streams is None or self.streams.device != device:
            self.streams = Streams(device)
        return step, device

    def refresh(self) -> None:
        """lr, beta2 and weight_decay apply when the step applies (a scheduler may have changed
        them since backward started the step); beta1 was read by the local step."""
        for seg, g in zip(self.segments, self.opt.param_groups):
            _, seg.beta2 = check_hyperparameters(g["lr"], g["betas"], g["weight_decay"])
            seg.lr, seg.weight_decay = float(g["lr"]), float(g["weight_decay"])

    @staticmethod
    def closure(closure):
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    @contextlib.contextmanager
    def one_decision(self):
        """Around the part of a step where this rank may find something wrong on its own (a
        closure, bad input, a setting): on such an error it gives the step up (``give_up``),
        so no collective is left in flight and every rank raises the same error. A peer's
        failure (``DistributedStepError``) is raised as it is: the exchange retired its groups.
        """
        try:
            yield
        except DistributedStepError:
            raise
        except BaseException as e:
            if not getattr(e, "dlion_decided", False):  # not already the step's one verdict
                self.give_up(e)
            raise

    def give_up(self, problem=None) -> None:
        """This rank gives up the step in flight after an error of its own (``problem``: a
        second backward, bad input or a wrong setting found on this rank, a failing closure, a
        refused GradScaler): every collective that the other ranks issue for this step is
        issued here too (``give_up_step``) and waited for, and nothing is applied. So no
        collective is left pending on any group, the same or a new optimizer can step next,
        and every rank skips the step and raises the same error (``Exchange.explain``, here
        too; marked ``dlion_decided``), or, when the decision is deferred, the others raise
        ``StepAbortedError`` at their next step."""
        if self.giving_up:
            return
        self.giving_up = True
        try:
            self.give_up_step(problem)
        except DistributedStepError:
            raise  # the exchange retired its groups; this step is dropped below
        except Exception as e:  # the step's one verdict, the same on every rank
            e.dlion_decided = True
            raise
        finally:
            self.giving_up = False
            self.drop_step()

    def give_up_step(self, problem) -> None:
        raise NotImplementedError

    def in_flight(self) -> bool:
        """Whether a bucket of this step has started."""
        raise NotImplementedError

    def buckets_started(self) -> int:
        """How many buckets of this step have started."""
        raise NotImplementedError

    def forget(self) -> None:
        """Forget the step in flight; the engine's iteration is left as it is."""
        self.flushed = False

    def drop_step(self) -> None:
        """Forget the step in flight (given up, finished, or failed)."""
        self.forget()
        if self.engine is not None:
            self.engine.reset()

    def refuse_scaler(self, grad_scaler) -> None:
        opt = self.opt
        scaled = (grad_scaler is not None and grad_scaler.is_enabled()) or any(
            getattr(opt, name, None) is not None for name in ("grad_scale", "found_inf"))
        if not scaled:
            return
        problem = ValueError(
            "fp16 GradScaler cannot be combined with overlap=True or the DDP comm hook: the votes "
            "are taken during backward, from still-scaled gradients. Use overlap=False without "
            "the hook, or bf16 autocast (no scaler); nothing was updated")
        # Finish this step's collectives (the same on every rank) and drop them: nothing moves.
        if self.in_flight():
            self.give_up(problem)
        raise problem

    # ------------------------------------------------------------------------- buckets

    def build_engine(self) -> None:
        if self.engine is not None:
            self.engine.remove()
        opt = self.opt
        self.engine = BucketEngine(self.trainable(), bucket_mb=opt.bucket_mb,
                                   group=self.order_group(), on_ready=self.bucket_ready,
                                   on_misuse=self.drain)

    def bucket_ready(self, bucket) -> None:
        if self.opt is None:  # a dropped optimizer: its engine's hooks go at the next collection
            return
        gate = self.gate
        if gate is not None and gate.failure is not None:
            return  # a collective of this step failed: step() drops it (elastic.py)
        try:
            self.start_bucket(bucket)
        except DistributedStepError as e:
            if gate is not None:  # reported, not raised: the step commits nothing
                gate.fail(e)
                return
            self.drop_step()  # a peer failed: the exchange retired the groups it made
            raise
        except (TypeError, ValueError) as e:
            if not self.leave_for_step(e):
                self.fail_in_backward(e)
                raise
        except BaseException as e:
            self.fail_in_backward(e)
            raise

    def fail_in_backward(self, e) -> None:
        if not self.giving_up and not getattr(e, "dlion_decided", False):
            self.give_up(e)  # bad input found in backward: give the step up here

    def leave_for_step(self, e) -> bool:
        """Whether a setting found wrong while a bucket started in backward is left for
        ``step()`` to raise (the bucket went out flagged "gave up") instead of raising here;
        only where finishing the step inside backward would wait for peers that wait for this
        rank (FSDP2)."""
        return False

    def start_bucket(self, bucket) -> None:
        raise NotImplementedError

    def drain(self) -> None:
        """A second ``backward()`` is being refused: the step stays open (its gradients are
        untouched and ``step()`` can still finish it), but every collective it started is
        completed now, on every group, so that none is left pending if the optimizer is
        dropped after the error (a new one on the same group would pair its collectives with
        the stale ones: gloo aborts the process)."""
        if self.opt is None:
            return
        try:
            self.abandon()
        except DistributedStepError:
            self.drop_step()  # a peer failed: the exchange retired the groups it made
            raise

    def abandon(self) -> None:
        raise NotImplementedError

    def attach_ddp_hook(self) -> None:
        if self.ddp_hooked:
            raise RuntimeError("opt already runs the D-Lion exchange of a DDP model")
        if self.engine is not None:
            self.engine.remove()
            self.engine = None
        self.ddp_hooked = True

    def added(self, group: dict) -> None:
        """A param group was added after construction."""
        if self.engine is not None:
            self.build_engine()  # the new parameters need hooks; the order is re-recorded

    # ------------------------------------------------------------------------- state

    def check_momentum(self, m, p, where: str) -> None:
        """A loaded momentum ``m`` of ``p`` (before anything is loaded)."""
        if sharded.is_dtensor(m):
            raise ValueError(f"{where} is a DTensor, saved by a DistributedLion over FSDP2 "
                             "parameters; this one's parameters are plain tensors")

    def loaded_momentum(self, m, p):
        """The loaded momentum as the state keeps it: fp32 (torch would cast to p's dtype)."""
        return m.to(device=p.device, dtype=torch.float32, copy=True)

    def after_load(self) -> None:
        """After ``load_state_dict``."""

    def load_groups(self) -> tuple[list, int | None]:
        """The groups (and block) of ``load_state_dict``'s one verdict (``agree.agree``)."""
        opt = self.opt
        return [resolve_group(attached_group(opt.group, opt))[0]], None


class FlatPath(Path):
    """One process group, every rank a voter (``exchange/pipeline.py``). Without overlap the
    whole step is one bucket, exchanged at ``step()``. With ``overlap=True`` the bucket engine
    (``exchange/buckets.py``) groups the parameters into buckets of about ``bucket_mb`` MiB in
    the order their gradients become ready and starts each bucket's local step and exchange
    during ``backward()``; ``step()`` exchanges what is left (parameters no bucket carried),
    finishes them and applies, bit-identical to ``overlap=False``. DDP's comm hook
    (``optim/ddp_hook.py``) starts DDP's buckets the same way (``exchange_bucket``).

    The decision of a step on CUDA with ``nonfinite="skip"`` or a GradScaler stays on the device
    until ``settle`` (``pending``): until then the step's counters (``state[p]["step"]``) count
    it as taken, and a step mismatch raises there (at the next step, naming the mismatched one;
    that step changed nothing). With ``nonfinite="raise"`` a step reads the ranks' headers once.
    A GradScaler's overflow on any rank skips the step on every rank, whatever ``nonfinite``
    says, and every rank's scaler sees that one decision (``optim/amp.py``); with overlap or
    the DDP hook the votes are taken from still-scaled gradients, so fp16 ``GradScaler`` raises
    ``ValueError`` at ``step()``."""

    def __init__(self, opt, *, defer_on_cpu: bool = False):
        super().__init__(opt)
        self.defer_on_cpu = defer_on_cpu  # tests: settle the verdict later on CPU too
        self.exchange: Exchange | None = None  # this step's exchange, once a bucket started
        self.exchanged: set[int] = set()  # ids of the params exchanged this step
        self.found_inf = None  # fp16 GradScaler: this rank's overflow flag for the header
        self.stepping = False  # inside step() (else a bucket starts during backward)
        self.counter: StepCounter | None = None  # the step count on the device (CUDA graphs)

    def settle(self) -> None:
        """Also inside CUDA graph capture, where nothing is read: a step left to settle then is
        dropped (the device's step counter has its count). Once a step was captured, the step
        counts of the state come from the device's counter (graphs may have advanced it)."""
        device = self.counter.device if self.counter is not None else None
        if device is not None and capturing(device):
            self.pending = None
            return
        super().settle()
        if self.counter is not None and self.counter.captured:
            count = self.counter.read()
            for p in self.trainable():
                if self.opt.state[p]:
                    self.opt.state[p]["step"] = count

    def after_load(self) -> None:
        if self.counter is not None:  # replays of a captured step go on from the loaded step
            params = self.trainable()
            self.counter.reset(max((self.opt.state[p].get("step", 0) for p in params),
                                   default=0))

    def in_flight(self) -> bool:
        return self.exchange is not None

    def buckets_started(self) -> int:
        return 0 if self.exchange is None else len(self.exchange.works)

    def step(self, closure, grad_scaler):
        opt = self.opt
        gate = self.gate
        if gate is not None and gate.failure is not None:  # a bucket's collective failed
            self.give_up_failed()
            raise gate.failure  # reported: the gate drops the step (elastic.py)
        if self.exchange is None:
            self.settle()
        loss = None
        device = next((p.device for g in opt.param_groups for p in g["params"]),
                      torch.device("cpu"))
        if self.engine is not None or self.ddp_hooked:
            self.refuse_scaler(grad_scaler)
        self.stepping = True
        try:
            with self.one_decision():
                loss = self.closure(closure)
                self.found_inf = amp.before_exchange(opt, grad_scaler, device)
                if self.engine is not None:
                    self.engine.flush()  # buckets never made ready this step (unused params)
                    self.flushed = True
                self.check_reduced_once()
                params = self.trainable()
                rest = [p for p in params if id(p) not in self.exchanged] if self.exchange \
                    else params
                if rest or self.exchange is None:
                    self.exchange_bucket(rest)  # without overlap: the whole step is one bucket
                self.refresh()
                if self.exchange.late:  # the gradients the apply reads, changed since backward?
                    self.exchange.check_rows()
            ex, self.exchange = self.exchange, None
            agreement = self.take_agreement()
            defer = self.defer(device)
            stats = self.finished(ex.finish(defer=defer, agree=agreement,
                                            commit=None if gate is None else gate.commit),
                                  agreement)
        except DistributedStepError:
            if gate is not None:
                self.give_up_failed()
            raise
        finally:
            self.forget()
            if opt.overlap and self.engine is None and not self.ddp_hooked:
                self.build_engine()  # a copy's hooks (the next backward records the order)
        opt.last_stats = stats
        amp.after_exchange(opt, grad_scaler, ex.verdict.skip if defer else stats.skipped)
        if not stats.skipped:  # deferred: counted as taken until settle() reads the verdict
            for p in params:
                opt.state[p]["step"] = ex.step + 1
        if defer:
            self.pending = (ex.verdict, stats, params, ex.step)
        return loss

    def defer(self, device) -> bool:
        """Whether nothing can raise from this step's decision, so it stays on the device (no
        host sync) until ``settle``: CUDA with ``nonfinite="skip"`` or a GradScaler (not with a
        gate: torchft's commit reads the host anyway)."""
        return (device.type == "cuda" or self.defer_on_cpu) and self.gate is None and (
            self.opt.nonfinite == "skip" or self.found_inf is not None)

    def give_up_failed(self) -> None:
        """A collective of this step failed on this rank (a peer died; the gate reported it):
        the step is dropped here. On a replica of several ranks its other ranks still wait for
        this one in the replica's own collectives: ``ShardedPath`` issues them."""
        self.drop_step()

    def forget(self) -> None:
        super().forget()
        self.exchange, self.found_inf = None, None
        self.exchanged = set()
        self.stepping = False

    # The FSDP2 path's differences (ShardedPath): nothing on one process group.

    def take_agreement(self):
        """This step's ``sharded.ShardAgreement`` (FSDP2), handed over once."""
        return None

    def finished(self, stats: StepStats, agreement) -> StepStats:
        return stats

    def check_reduced_once(self) -> None:
        pass

    def local(self, params, grads, exp_avgs):
        """The tensors the exchange runs on."""
        return params, grads, exp_avgs

    def started(self, ex: Exchange, step: int, timeout) -> None:
        """A new step's exchange was made."""

    # ------------------------------------------------------------------------- buckets

    def start_bucket(self, bucket) -> None:
        self.exchange_bucket(bucket.params, layout=(bucket.offsets, bucket.blocks))

    def abandon(self) -> None:
        if self.exchange is not None:
            self.exchange.abandon()

    def give_up_step(self, problem) -> None:
        """The buckets not started yet are started, with the ``ABORTED`` flag, and so is the
        step's one bucket when nothing was started yet."""
        ex = self.exchange
        if ex is None and self.ddp_hooked:
            return  # DDP's hook starts the buckets: nothing of the step was started
        ex = self.start_step()
        ex.aborted, ex.problem = True, problem
        if self.engine is not None and not self.flushed:
            self.engine.flush()  # the buckets the others start at their step()
        rest = [p for p in self.trainable() if id(p) not in self.exchanged]
        if (rest or not ex.works) and not self.ddp_hooked:
            self.exchange_bucket(rest)  # what step() exchanges after the buckets
        device = ex.device
        ex.finish(agree=self.take_agreement(), abort=True, defer=self.defer(device))

    def start_step(self) -> Exchange:
        """The exchange of this step, created when its first bucket starts (with a gate, once
        this step's quorum is in: ``elastic.Gate.join``)."""
        if self.exchange is None:
            opt = self.opt
            gate = self.gate
            if gate is not None:
                gate.join(in_backward=not self.stepping)
            step, device = self.begin()
            timeout = getattr(opt, "timeout", None)
            group = self.group()
            overlapped = self.engine is not None or self.ddp_hooked  # buckets in backward
            if self.counter is None or self.counter.device != device:
                self.counter = StepCounter(device)
            step = self.counter.start(step)
            self.exchange = Exchange(device=device, mode=opt.mode, votes=opt.votes,
                                     group=group, backend=opt.backend, step=step,
                                     nonfinite=opt.nonfinite, found_inf=self.found_inf,
                                     streams=self.streams, timeout=timeout,
                                     segments=self.segments, late=overlapped,
                                     counter=self.counter.value)
            self.exchange.explainer = agree.explain_step  # one error on every rank
            if gate is not None:  # one error on every rank of this replica; none between them
                self.exchange.explain_groups = [gate.replica_group]
                if gate.replica_group is None:
                    self.exchange.explainer = None
                # a heal came after this rank's gradients: its vote must not count
                self.exchange.aborted = gate.behind
            self.exchanged = set()
            self.started(self.exchange, step, timeout)
        return self.exchange

    def momenta(self) -> list:
        """This rank's momentum tensors, one per trainable parameter (its local piece; created
        zero where missing): what a healing replica's ``heal_momentum`` acts on."""
        params = self.trainable()
        return list(self.local(params, params, [self.exp_avg(p) for p in params])[2])

    def exp_avg(self, p):
        """The momentum of ``p``, created (zero, step 0) if it has no state yet."""
        state = self.opt.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = self.zero_momentum(p)
        return state["exp_avg"]

    def zero_momentum(self, p):
        return torch.zeros(p.shape, dtype=torch.float32, device=p.device)

    def exchange_bucket(self, params, grads=None, layout=None) -> None:
        """Start the exchange of one bucket: ``params`` (requires_grad) with ``grads`` (default:
        their ``.grad``), laid out from block 0 in this order; ``layout``: their (block offsets,
        blocks) when the caller has them (the bucket engine's), else computed here."""
        with torch.no_grad():
            ex = self.start_step()
            grads = [p.grad for p in params] if grads is None else list(grads)
            exp_avgs = [self.exp_avg(p) for p in params]
            segments = [self.segments[self.group_of[id(p)]] for p in params]
            ids = [id(p) for p in params]
            params, grads, exp_avgs = self.local(params, grads, exp_avgs)
            offsets, blocks = layout if layout is not None else block_offsets(
                p.numel() for p in params)
            if ex.aborted:  # giving the step up: the bucket keeps its size, carries no votes
                ex.add_aborted(blocks)
                self.exchanged.update(ids)
                return
            try:
                if self.problem is not None:  # a setting of this step is wrong on this rank
                    raise self.problem
                check_tensors(list(params), grads, exp_avgs)
            except (TypeError, ValueError):
                # bad input on this rank only, found after other buckets may have been sent:
                # the others still get this bucket, flagged, and skip the step as well
                ex.add_aborted(blocks)
                self.exchanged.update(ids)
                raise
            ex.add([ex.row(p, g, m, off, seg) for p, g, m, off, seg
                    in zip(params, grads, exp_avgs, offsets, segments)], blocks)
            self.exchanged.update(ids)


class ShardedPath(FlatPath):
    """FSDP2 (``exchange/sharded.py``, docs/fsdp.md): the parameters are DTensors sharded by
    ``fully_shard(module, mesh=mesh["shard"])``; the mesh's "replicate" dimension (else its
    first) holds the N replicas of each shard, the voters. Each rank runs the flat step on its
    local shards: local step, the exchange in its replicate group, apply to the local tensors in
    place (nothing is gathered). ``state[p]["exp_avg"]`` is an fp32 DTensor of global shape
    (N, *p.shape), replica i's momentum in row i, made at construction (so
    ``torch.distributed.checkpoint`` never has to run a step to create the state). One
    skip/raise decision for all n ranks of the mesh (``sharded.ShardAgreement``); ``last_stats``
    is a ``StepStats`` with intra- and inter-node bytes and ``shards``. A 1-D mesh is N = 1; without
    ``device_mesh`` the replicate group is the optimizer's ``group`` (None: N = 1, the
    parameters sharded over every rank).

    With ``overlap=True`` a bucket's vote starts when FSDP2 has reduced its gradients (buckets
    are sized by the parameters' full size, the same on every rank). FSDP2 accumulates a second
    backward's reduced gradient into ``.grad`` before it calls the sharded parameter's hooks
    and never calls its tensor pre-hooks (the sharded parameter is not in the autograd graph),
    so the engine's guard cannot refuse it first: ``reduced`` notes it (before the engine's
    hook, which may exchange the bucket) and ``step()`` then raises ``RuntimeError`` with
    nothing modified. Accumulate with FSDP2's ``model.set_requires_gradient_sync(False)``."""

    def leave_for_step(self, e) -> bool:
        # this backward goes on with FSDP's reduce-scatters in this rank's shard group, which
        # its peers wait for: finishing the step here would wait for them in turn. The bucket
        # went out flagged "gave up", and so do the later ones: step() raises the same error
        # on every rank.
        ex = self.exchange
        if ex is None or not ex.aborted or self.giving_up:
            return False
        ex.problem = ex.problem or e
        return True

    def __init__(self, opt, sharding, *, defer_on_cpu: bool = False):
        super().__init__(opt, defer_on_cpu=defer_on_cpu)
        self.sharding = sharding  # the mesh, replicate and shard groups
        self.agreement = None  # this step's sharded.ShardAgreement
        self.handed = None  # ... once handed to the exchange's finish
        self.reduced_again = False  # a gradient exchanged this step was reduced again
        self.guards: list = []  # with overlap: the hooks of reduced()

    def group(self):
        gate = self.gate
        return gate.group() if gate is not None else self.sharding.replicate

    def started(self, ex: Exchange, step: int, timeout) -> None:
        # with a gate the replicas are other jobs: the decision is taken inside this replica,
        # from every header its ranks received (ShardAgreement's replica mode)
        replica = self.gate is not None
        self.agreement = sharded.ShardAgreement(self.sharding, step, timeout, replica=replica)
        if not replica:
            ex.explain_groups = [self.sharding.replicate, self.sharding.shard]  # every mesh rank

    def give_up_failed(self) -> None:
        """This rank's exchange failed (the gate reported it): its replica's other ranks still
        wait for it in the agreement over their own group, so it takes part, flagged as given
        up (every rank of the replica then applies nothing)."""
        agreement = self.agreement or self.handed
        segments = self.segments
        super().give_up_failed()
        if agreement is None:
            step = max((self.opt.state[p].get("step", 0) for p in self.trainable()), default=0)
            agreement = sharded.ShardAgreement(self.sharding, step,
                                               getattr(self.opt, "timeout", None), replica=True)
        if not agreement.issued:
            word = torch.full((1,), settings_word(ABORTED, segments), dtype=torch.int32)
            agreement(None, word)

    def take_agreement(self):
        agreement, self.agreement = self.agreement, None
        self.handed = agreement  # until the step is over (give_up_failed)
        return agreement

    def finished(self, stats: StepStats, agreement) -> StepStats:
        return stats if agreement is None else sharded.step_stats(stats, agreement)

    def forget(self) -> None:
        super().forget()
        self.agreement, self.handed, self.reduced_again = None, None, False

    def local(self, params, grads, exp_avgs):
        return ([sharded.own_shard(p) for p in params], [sharded.own_shard(g) for g in grads],
                [sharded.momentum_local(m) for m in exp_avgs])

    def zero_momentum(self, p):
        return self.sharding.zero_momentum(p)

    def start_bucket(self, bucket) -> None:
        self.exchange_bucket(bucket.params)  # the engine's layout is of the full tensors

    def build_engine(self) -> None:
        for h in self.guards:
            h.remove()
        self.guards = [p.register_post_accumulate_grad_hook(WeakHook(self, "reduced"))
                       for p in self.trainable()]
        remove_when_collected(self, self.guards)
        super().build_engine()

    def reduced(self, param) -> None:
        if id(param) in self.exchanged:
            self.reduced_again = True

    def check_reduced_once(self) -> None:
        if not self.reduced_again:
            return
        problem = RuntimeError(
            "a second backward() reduced gradients (FSDP2 added them into .grad) whose votes "
            "were already exchanged this step; nothing was updated. Accumulate with FSDP2's "
            "model.set_requires_gradient_sync(False) for every micro-batch but the last, then "
            "zero_grad() and redo this step")
        self.give_up(problem)  # every rank's collectives stay matched; nothing applied
        raise problem

    def added(self, group: dict) -> None:
        for p in group["params"]:
            if p.requires_grad:
                self.exp_avg(p)
        super().added(group)

    def check_momentum(self, m, p, where: str) -> None:
        self.sharding.check_momentum(m, p, where)

    def loaded_momentum(self, m, p):
        return self.sharding.loaded_momentum(m, p)

    def after_load(self) -> None:
        for p in self.trainable():
            self.exp_avg(p)  # parameters the state_dict had no state for

    def load_groups(self) -> tuple[list, int | None]:
        return [self.sharding.replicate, self.sharding.shard], self.sharding.replicas


class HierarchyPath(Path):
    """``hierarchy=L`` (``exchange/hierarchy.py``, docs/hierarchy.md): nodes of L ranks, the
    exact gradient mean inside a node, the nodes vote. Each rank keeps momentum only for its
    shard, ~1/L of the elements (``momentum``): ``state[p]["exp_avg"]`` is 1-D and covers
    elements ``state[p]["exp_avg_range"]`` of ``p``; resume needs the same n and L. fp16
    ``GradScaler`` works as in the flat case (one overflow decision for all n ranks).

    With ``overlap=True`` each bucket's hierarchical phases run during backward
    (``hier.OverlapStep``, ``overlap_step``), bit-identical to ``overlap=False``; the momentum
    shards then follow the buckets (``layouts``, ``bucket_momentum``, laid out by the step's
    first bucket), so resume also needs the same ``overlap`` and ``bucket_mb`` (else
    ``ValueError`` at the first step); fp16 ``GradScaler`` raises as with flat overlap."""

    def __init__(self, opt):
        super().__init__(opt)
        self.momentum = hier.ShardedMomentum()  # this rank's shard of every momentum
        self.overlap_step: hier.OverlapStep | None = None  # overlap: this step, in flight
        self.layouts: list | None = None  # overlap: each bucket's ShardLayout
        self.bucket_momentum: list | None = None  # overlap: each bucket's momentum shard

    def in_flight(self) -> bool:
        return self.overlap_step is not None

    def buckets_started(self) -> int:
        return 0 if self.overlap_step is None else len(self.overlap_step.works)

    def forget(self) -> None:
        super().forget()
        self.overlap_step = None

    def momenta(self) -> list:
        """This rank's momentum shard, one view per trainable parameter (laid out now if no step
        made it yet: on a replica of torchft's quorum the layout is that of one node)."""
        opt = self.opt
        params = self.trainable()
        states = [opt.state[p] for p in params]
        for state in states:
            state.setdefault("step", 0)
        device = params[0].device if params else torch.device("cpu")
        topo = hier.Topology(opt.ranks_per_node, opt.ranks_per_node, 1, 0,
                             dist.get_rank() % opt.ranks_per_node, None, None, layout_nodes=1)
        self.momentum.states = states
        self.momentum.shard(hier.ShardLayout.build((p.numel() for p in params), topo), device)
        return [state["exp_avg"] for state in states]

    def step(self, closure, grad_scaler):
        opt = self.opt
        self.settle()
        loss = None
        device = next((p.device for g in opt.param_groups for p in g["params"]),
                      torch.device("cpu"))
        if opt.overlap:
            with self.one_decision():
                loss = self.closure(closure)
            opt.last_stats = self.overlap_finish(grad_scaler)
            return loss
        problem = None
        try:  # a closure that fails here: the step runs given up (the others learn it)
            loss = self.closure(closure)
        except Exception as e:
            problem = e
        # fp16 GradScaler: unscaled here, the local overflow flag joins the step's flags
        found_inf = amp.before_exchange(opt, grad_scaler, device)
        opt.last_stats = stats = self.whole_step(found_inf, problem)
        amp.after_exchange(opt, grad_scaler, stats.skipped)
        return loss

    def whole_step(self, found_inf=None, problem=None) -> StepStats:
        """The whole step without overlap; ``found_inf``: the GradScaler's local overflow flag
        (``amp.before_exchange``) or None; ``problem``: an error of this rank's own found
        before (a closure's). A problem (or a setting or gradient found wrong here) gives the
        step up: this rank still takes part in its collectives, with no gradient, and every
        rank raises the same error."""
        opt = self.opt
        step, _ = self.begin()
        problem = problem or self.problem
        states = []
        for seg, g in zip(self.segments, opt.param_groups):
            seg.params = [p for p in g["params"] if p.requires_grad]
            seg.grads = [p.grad for p in seg.params]
            for p in seg.params:
                states.append(opt.state[p])
                states[-1].setdefault("step", 0)  # the momentum shard comes at the step
        try:
            hier.check_tensors(*[sum((getattr(s, k) for s in self.segments), [])
                                 for k in ("params", "grads")])
        except (TypeError, ValueError) as e:
            problem = problem or e
        if problem is not None:
            for seg in self.segments:
                seg.grads = [None] * len(seg.params)
        self.momentum.states = states  # new dicts after load_state_dict: the shard is rebuilt
        gate = self.gate
        topo = None
        if gate is not None:  # a replica of L ranks on torchft's quorum
            gate.join()
            group = gate.group()
            topo = hier.quorum_topology(group, group.size(), group.rank())
        stats = hier.run_hierarchical_step(
            self.segments, self.momentum, ranks_per_node=opt.ranks_per_node, mode=opt.mode,
            votes=opt.votes, group=opt.group, backend=opt.backend, step=step,
            nonfinite=opt.nonfinite, timeout=getattr(opt, "timeout", None),
            found_inf=found_inf, problem=problem, topo=topo, gate=gate)
        if not stats.skipped:
            for state in states:
                state["step"] = step + 1
        return stats

    def start_bucket(self, bucket) -> None:
        """A bucket's hierarchical phases 1-4 and its node gather (``OverlapStep``), during
        backward. The first bucket of a step lays out the momentum shards of every bucket
        (checking loaded ones) before anything is sent."""
        with torch.no_grad():
            opt = self.opt
            hs = self.overlap_step
            if hs is None:
                step, device = self.begin()
                for p in self.trainable():
                    opt.state[p].setdefault("step", 0)
                timeout = getattr(opt, "timeout", None)
                topo = hier.topology(opt.group, opt.ranks_per_node, timeout)
                buckets = self.engine.buckets
                self.layouts = [hier.ShardLayout.build((p.numel() for p in b.params), topo)
                                for b in buckets]
                self.bucket_momentum = self.momentum.shard_buckets(
                    self.layouts, [[opt.state[p] for p in b.params] for b in buckets], device)
                hs = self.overlap_step = hier.OverlapStep(
                    topo, device=device, mode=opt.mode, votes=opt.votes, backend=opt.backend,
                    step=step, nonfinite=opt.nonfinite, streams=self.streams, timeout=timeout,
                    segments=self.segments)
            segments = [self.segments[self.group_of[id(p)]] for p in bucket.params]
            if not hs.ex.aborted and not self.giving_up:
                try:  # each bucket as it starts (the unused ones at step())
                    hier.check_tensors(bucket.params, [p.grad for p in bucket.params])
                except (TypeError, ValueError) as e:
                    self.problem = self.problem or e
            bad = self.problem is not None and not hs.ex.aborted and not self.giving_up
            if bad or hs.ex.aborted or self.giving_up:  # given up: its collectives, no gradient
                hs.ex.aborted = True
                grads = [None] * len(bucket.params)
            else:
                grads = [p.grad for p in bucket.params]
            hs.add(bucket.params, grads, segments, self.layouts[bucket.index],
                   self.bucket_momentum[bucket.index])
            if bad:
                raise self.problem

    def overlap_finish(self, grad_scaler) -> StepStats:
        """step() with overlap=True: the buckets not started during backward, then wait,
        decide and apply (``OverlapStep.finish``)."""
        opt = self.opt
        if self.engine is None:
            self.build_engine()  # a copy: the buckets are formed from declaration order
        self.refuse_scaler(grad_scaler)
        try:
            with self.one_decision():
                self.engine.flush()  # buckets never made ready this step (unused parameters)
                self.flushed = True
                if self.overlap_step is not None:
                    self.refresh()
            hs, self.overlap_step = self.overlap_step, None
            if hs is None:  # no parameter takes part: nothing to exchange or apply
                return StepStats(0, 0, 0, 1, opt.mode, opt.votes, "none", buckets=0)
            stats = hs.finish()
        finally:
            self.overlap_step = None
            self.flushed = False
        if not stats.skipped:
            for p in self.trainable():
                opt.state[p]["step"] = hs.step + 1
        return stats

    def abandon(self) -> None:
        if self.overlap_step is not None:
            self.overlap_step.abandon()

    def give_up_step(self, problem) -> None:
        """The buckets not started yet are started (given up, no gradient), then the step's
        ``OverlapStep.give_up``; without overlap nothing is in flight here."""
        hs = self.overlap_step
        if hs is not None:
            hs.ex.aborted = True
        if self.engine is not None and not self.flushed:
            self.engine.flush()  # the buckets the others start (given up, no gradient)
        hs = self.overlap_step
        if hs is not None:
            hs.give_up(problem)
