"""The bucket schedule of exchange/pipeline.py on real gloo ranks (module docstring, Ordering).

With the gathers' second group (``companion``: DistributedLion(overlap=True) and the DDP comm hook
on a group of every rank) no hook waits on the host, and each bucket's gather is issued during
backward as soon as its all_to_all is complete, in bucket order. Without one (a group that is not
every rank of the job) the schedule is lag one. The second group keeps the group's rank order.
Results are bit-identical to overlap=False in every case."""

import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from workers import run_workers

import dlion_kernels as dk
from dlion_kernels.exchange import pipeline

STEPS = 3
BUCKET_MB = 300 * 4 / 2**20  # ~300 fp32 elements: a bucket per layer or two


def _mlp():
    torch.manual_seed(0)
    widths = (6, 17, 33, 9, 21, 3)
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


class Log:
    """Records the pipeline's host waits for a collective not yet complete, its collectives and
    stages (with the bucket index) and whether they happened inside backward()."""

    def __init__(self):
        self.events, self.in_backward = [], False

    def __enter__(self):
        self.saved = (pipeline.wait_work, pipeline.collective, pipeline.BucketWork.reduce)
        wait_work, collective, reduce = self.saved
        log = self

        def logged_wait(work, step, name, *args, **kwargs):
            # a wait for a collective already complete returns at once: not a wait for a peer
            if not work.is_completed():
                log.events.append(("wait", name, log.in_backward))
            return wait_work(work, step, name, *args, **kwargs)

        def logged_collective(name, *args, **kwargs):
            log.events.append(("issue", name, log.in_backward))
            return collective(name, *args, **kwargs)

        def logged_reduce(work):
            log.events.append(("reduce", work.ex.works.index(work), log.in_backward))
            return reduce(work)

        pipeline.wait_work, pipeline.collective = logged_wait, logged_collective
        pipeline.BucketWork.reduce = logged_reduce
        return self

    def __exit__(self, *exc):
        pipeline.wait_work, pipeline.collective, pipeline.BucketWork.reduce = self.saved

    def backward(self, loss):
        self.in_backward = True
        try:
            loss.backward()
        finally:
            self.in_backward = False


def _until_arrived(opt):
    """A post-accumulate-grad hook: wait (outside the pipeline) until every bucket started so
    far has its all_to_all complete, so that the next bucket's start finds it complete."""

    def hook(_param):
        deadline = time.monotonic() + 60
        ex = opt._path.exchange
        while ex is not None and not all(w.stage > 0 or w.arrived() for w in ex.works):
            assert time.monotonic() < deadline, "an all_to_all never completed"
            time.sleep(0.001)

    return hook


def _slow(_grad):
    time.sleep(0.1)  # before each gradient of this rank is accumulated: behind its peers


def _train(rank, entry, group=None, log=None, settle=False, slow=False):
    """STEPS steps of overlap=False ("plain"), overlap=True ("overlap") or the DDP comm hook
    ("ddp") on ``group``; returns the parameters after each step. ``settle``: each bucket's
    all_to_all completes before the next bucket starts; ``slow``: this rank lags behind."""
    model = _mlp()
    opt = dk.DistributedLion(model.parameters(), lr=1e-2, weight_decay=0.1, group=group,
                             overlap=entry == "overlap", bucket_mb=BUCKET_MB)
    net = model
    if entry == "ddp":
        net = DDP(model, bucket_cap_mb=BUCKET_MB, process_group=group)
        dk.register_ddp_comm_hook(net, opt)
    for p in model.parameters():
        if settle:
            p.register_post_accumulate_grad_hook(_until_arrived(opt))
        if slow:
            p.register_hook(_slow)
    gen = torch.Generator().manual_seed(100 + rank)
    history = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = net(torch.randn(5, 6, generator=gen)).square().mean()
        if log is not None:
            log.events.append(("step", step, False))
            log.backward(loss)
        else:
            loss.backward()
        opt.step()
        history.append([p.detach().clone() for p in model.parameters()])
    return history, opt


def _steps(events):
    """The logged events of each step after the first (the first records the ready order)."""
    marks = [i for i, e in enumerate(events) if e[0] == "step"] + [len(events)]
    return [events[a + 1:b] for a, b in zip(marks[1:], marks[2:])]


def _never_waits_worker(rank, n):
    plain, _ = _train(rank, "plain")
    out = {}
    for entry, settle in (("overlap", False), ("ddp", False), ("overlap", True)):
        with Log() as log:
            # the last rank lags behind (unless settled): its peers' all_to_alls are not
            # complete when their next bucket starts
            history, opt = _train(rank, entry, log=log, settle=settle,
                                  slow=rank == n - 1 and not settle)
        out[entry, settle] = (history, _steps(log.events), opt.last_stats.buckets,
                              opt.ddp_hooked if entry == "ddp" else opt.overlap)
    companion = pipeline.companion(None, "cpu", 0)
    return plain, out, dist.get_process_group_ranks(companion), companion is \
        pipeline.companion(dist.group.WORLD, "cpu", 0)


@pytest.mark.parametrize("n", [2, 3])
def test_hooks_never_wait_gathers_start_in_backward(n):
    ranks = run_workers(n, _never_waits_worker)
    for rank, (plain, out, companion_ranks, cached) in enumerate(ranks):
        assert companion_ranks == list(range(n)) and cached
        for (entry, settle), (history, steps, buckets, overlapped) in out.items():
            assert overlapped and buckets >= 2
            for a, b, c in zip(history, plain, ranks[0][0]):  # bit-identical, every rank
                assert all(torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(a, b, c))
            for events in steps:
                inside = [e for e in events if e[2]]
                # no host wait for a slower rank inside backward
                assert not [e for e in inside if e[0] == "wait"], (entry, inside)
                reduced = [e[1] for e in events if e[0] == "reduce"]
                assert reduced == list(range(buckets)), (entry, reduced)  # bucket order
                gathers = [e for e in events if e[:2] == ("issue", pipeline.GATHER)]
                assert len(gathers) == buckets
                if settle:
                    # each all_to_all had completed when the next bucket started: every
                    # bucket's gather but (perhaps) the last was issued during backward
                    early = [e[1] for e in events if e[0] == "reduce" and e[2]]
                    assert early[:buckets - 1] == list(range(buckets - 1)), events


def _subgroup_worker(rank, n):
    # every rank makes every group, as dist.new_group asks; ranks 0 and 1 train on theirs
    pair = dist.new_group([0, 1])
    reordered = dist.new_group([2, 0, 1], sort_ranks=False)
    out = {"pair ranks": None}
    if rank in (0, 1):
        assert pipeline.companion(pair, "cpu", 0) is None  # not every rank: lag one
        plain, _ = _train(rank, "plain", pair)
        with Log() as log:
            over, opt = _train(rank, "overlap", pair, log=log)
        out["pair"] = (plain, over, _steps(log.events), opt.last_stats.buckets)
    # a group of every rank in another order: its gathers' group keeps that order
    out["reordered ranks"] = dist.get_process_group_ranks(
        pipeline.companion(reordered, "cpu", 0))
    out["reordered"] = (_train(rank, "plain", reordered)[0],
                        _train(rank, "overlap", reordered)[0])
    return out


def test_subgroup_lag_one_and_reordered_group():
    ranks = run_workers(3, _subgroup_worker)
    for rank, out in enumerate(ranks):
        assert out["reordered ranks"] == [2, 0, 1]
        plain, over = out["reordered"]
        for a, b, c in zip(plain, over, ranks[0]["reordered"][0]):
            assert all(torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(a, b, c))
        if rank == 2:
            continue
        plain, over, steps, buckets = out["pair"]
        for a, b, c in zip(plain, over, ranks[0]["pair"][0]):
            assert all(torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(a, b, c))
        for events in steps:
            issued = [e[1] for e in events if e[0] == "issue"]
            # lag one on the one group: a2a(0), a2a(1), gather(0), a2a(2), gather(1), ...,
            # then the overlapped step's verdict word at step()
            expected = [pipeline.A2A] + [pipeline.A2A, pipeline.GATHER] * (buckets - 1) + \
                [pipeline.GATHER, pipeline.VERDICT]
            assert issued == expected, issued


def test_companion_needs_a_cpu_job_of_several_ranks():
    assert not dist.is_initialized()
    assert pipeline.companion(None, "cpu", 0) is None
    assert pipeline.companion(None, "cuda", 0) is None
    assert run_workers(1, _one_rank) == [None]


def _one_rank(rank, n):
    return pipeline.companion(None, "cpu", 0)
