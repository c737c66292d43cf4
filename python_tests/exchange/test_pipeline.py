"""The bucket schedule of exchange/pipeline.py on real gloo ranks (module docstring, Ordering).

DistributedLion(overlap=True) and the DDP comm hook run lag one on the exchange's one group, on
a group of every rank, a subgroup or a group of every rank in another order: a2a(0), a2a(1),
gather(0), a2a(2), gather(1), ..., then the verdict word at step(), with every gather but the
last issued during backward, in bucket order, also when one rank lags behind. The library makes
no group of its own for it. Results are bit-identical to overlap=False in every case."""

import time

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
    """Records the pipeline's collectives and stages (with the bucket index), and whether they
    happened inside backward()."""

    def __init__(self):
        self.events, self.in_backward = [], False

    def __enter__(self):
        self.saved = (pipeline.collective, pipeline.BucketWork.reduce, dist.new_group)
        collective, reduce, new_group = self.saved
        log = self

        def logged_collective(name, *args, **kwargs):
            log.events.append(("issue", name, log.in_backward))
            return collective(name, *args, **kwargs)

        def logged_reduce(work):
            log.events.append(("reduce", work.ex.works.index(work), log.in_backward))
            return reduce(work)

        def logged_new_group(*args, **kwargs):
            log.events.append(("new_group", args, log.in_backward))
            return new_group(*args, **kwargs)

        pipeline.collective, pipeline.BucketWork.reduce = logged_collective, logged_reduce
        dist.new_group = logged_new_group
        return self

    def __exit__(self, *exc):
        pipeline.collective, pipeline.BucketWork.reduce, dist.new_group = self.saved

    def backward(self, loss):
        self.in_backward = True
        try:
            loss.backward()
        finally:
            self.in_backward = False


def _slow(_grad):
    time.sleep(0.05)  # before each gradient of this rank is accumulated: behind its peers


def _train(rank, entry, group=None, log=None, slow=False):
    """STEPS steps of overlap=False ("plain"), overlap=True ("overlap") or the DDP comm hook
    ("ddp") on ``group``; returns the parameters after each step and the optimizer. ``slow``:
    this rank lags behind."""
    model = _mlp()
    opt = dk.DistributedLion(model.parameters(), lr=1e-2, weight_decay=0.1, group=group,
                             overlap=entry == "overlap", bucket_mb=BUCKET_MB)
    net = model
    if entry == "ddp":
        net = DDP(model, bucket_cap_mb=BUCKET_MB, process_group=group)
        dk.register_ddp_comm_hook(net, opt)
    if slow:
        for p in model.parameters():
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


def _lag_one_worker(rank, n):
    # every rank makes every group, as dist.new_group asks; ranks 0 and 1 also train on theirs
    pair = dist.new_group([0, 1])
    reordered = dist.new_group([2, 0, 1], sort_ranks=False)
    out = {}
    for name, group, members in (("world", None, range(n)), ("reordered", reordered, range(n)),
                                 ("pair", pair, (0, 1))):
        if rank not in members:
            continue
        plain, _ = _train(rank, "plain", group)
        runs = {}
        for entry in ("overlap", "ddp"):
            with Log() as log:
                # the last member lags behind on the default group: its peers' all_to_alls are
                # not complete when their next bucket starts
                history, opt = _train(rank, entry, group, log=log,
                                      slow=name == "world" and rank == n - 1)
            runs[entry] = (history, log.events, opt.last_stats.buckets,
                           opt.ddp_hooked if entry == "ddp" else opt.overlap)
        out[name] = (plain, runs)
    return out


def test_lag_one_on_the_one_group_bit_identical():
    ranks = run_workers(3, _lag_one_worker)
    for rank, out in enumerate(ranks):
        assert set(out) == ({"world", "reordered", "pair"} if rank < 2 else {"world", "reordered"})
        for name, (plain, runs) in out.items():
            for entry, (history, events, buckets, overlapped) in runs.items():
                assert overlapped and buckets >= 2, (name, entry)
                # bit-identical to overlap=False, and on every rank
                for a, b, c in zip(history, plain, ranks[0][name][0]):
                    assert all(torch.equal(x, y) and torch.equal(x, z)
                               for x, y, z in zip(a, b, c)), (name, entry)
                # the library makes no group for the overlapped exchange
                assert not [e for e in events if e[0] == "new_group"], (name, entry)
                for step in _steps(events):
                    issued = [e[1] for e in step if e[0] == "issue"]
                    # lag one on the one group, then the overlapped step's verdict word
                    expected = [pipeline.A2A] + [pipeline.A2A, pipeline.GATHER] * (buckets - 1) \
                        + [pipeline.GATHER, pipeline.VERDICT]
                    assert issued == expected, (name, entry, issued)
                    reduced = [e[1] for e in step if e[0] == "reduce"]
                    assert reduced == list(range(buckets)), (name, entry, reduced)
                    # every bucket's gather but the last was issued during backward
                    early = [e[1] for e in step if e[0] == "reduce" and e[2]]
                    assert early == list(range(buckets - 1)), (name, entry, step)


def test_no_second_group_is_made():
    assert not hasattr(pipeline, "companion") and not hasattr(pipeline, "COMPANION")
