"""The bucket engine: ready order, bucket layout, ordered on_ready during backward, flush,
no_sync, the second-backward error, and identical buckets on every gloo rank."""

import itertools

import pytest
import torch
from workers import run_workers

from dlion_kernels.exchange.buckets import BucketEngine, form_buckets
from dlion_kernels.kernels.layout import num_blocks


def _mlp(widths=(5, 33, 31, 7), seed=0):
    torch.manual_seed(seed)
    layers = []
    for a, b in itertools.pairwise(widths):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def _backward(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, model[0].in_features, generator=gen)
    model(x).square().sum().backward()


class Recorder:
    def __init__(self):
        self.events = []

    def __call__(self, bucket):
        self.events.append(("ready", bucket.index, [id(p) for p in bucket.params]))


def test_form_buckets_layout():
    params = [torch.zeros(n) for n in (1, 33, 4097, 31, 64, 0, 5)]
    cap_mb = 4097 * 4 / 2**20  # the 4097-element tensor alone fills a bucket
    buckets = form_buckets(params, cap_mb)
    assert [[p.numel() for p in b.params] for b in buckets] == [[1, 33, 4097], [31, 64, 0, 5]]
    for k, b in enumerate(buckets):
        assert b.index == k
        expected, total = [], 0
        for p in b.params:  # every tensor starts on a 32-element block boundary, from 0
            expected.append(total)
            total += num_blocks(p.numel())
        assert b.offsets == expected and b.blocks == total
    assert len(form_buckets(params, 100.0)) == 1
    # every non-empty tensor closes its own bucket (the empty one joins the next)
    assert len(form_buckets(params, 1e-9)) == len(params) - 1


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-1.0, ValueError),
                                        (float("nan"), ValueError), (float("inf"), ValueError),
                                        ("25", TypeError), (True, TypeError)])
def test_bad_bucket_mb(bad, error):
    model = _mlp()
    with pytest.raises(error, match="bucket_mb"):
        BucketEngine(model.parameters(), bucket_mb=bad, on_ready=Recorder())
    with pytest.raises(TypeError, match="on_ready"):
        BucketEngine(model.parameters(), bucket_mb=1.0, on_ready=None)
    _backward(model)  # no hook was left behind by the failed constructions
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_order_flush_and_overlap():
    model = _mlp()
    rec = Recorder()
    engine = BucketEngine(model.parameters(), bucket_mb=1e-9, on_ready=rec)  # one per tensor
    model[0].register_full_backward_hook(lambda *a: rec.events.append(("first layer",)))

    _backward(model)  # the recording iteration: nothing is made ready during it
    assert rec.events == [("first layer",)]
    assert not engine.formed
    engine.flush()
    # Buckets follow the recorded ready order: the last layer's gradients are ready first.
    ready = [e for e in rec.events if e[0] == "ready"]
    assert [e[1] for e in ready] == list(range(len(ready))) == list(range(6))
    order = [e[2][0] for e in ready]
    assert set(order[:2]) == {id(model[4].weight), id(model[4].bias)}
    assert set(order[-2:]) == {id(model[0].weight), id(model[0].bias)}

    for it in range(2):
        rec.events.clear()
        _backward(model, seed=it + 1)
        # Overlap: buckets were made ready before backward reached the first layer.
        first = rec.events.index(("first layer",))
        assert [e[1] for e in rec.events[:first]] == [0, 1, 2, 3]
        assert [e[2][0] for e in rec.events if e[0] == "ready"] == order
        engine.flush()  # everything was ready already: nothing more
        assert len(rec.events) == 7


def test_flush_readies_unused_and_skips_frozen():
    model = _mlp()
    model[2].weight.requires_grad_(False)  # frozen: in no bucket
    rec = Recorder()
    engine = BucketEngine(model.parameters(), bucket_mb=1e-9, on_ready=rec)
    _backward(model)
    engine.flush()
    ids = [e[2][0] for e in rec.events]
    assert id(model[2].weight) not in ids and len(ids) == 5

    # Only the last layer is used: its buckets go during backward, the rest at flush, in order.
    rec.events.clear()
    x = torch.randn(3, 31)
    model[4](x).sum().backward()
    assert [e[1] for e in rec.events] == [0, 1]
    engine.flush()
    assert [e[1] for e in rec.events] == [0, 1, 2, 3, 4]


def test_unrecorded_params_and_multi_bucket_readiness():
    model = _mlp()
    rec = Recorder()
    engine = BucketEngine(model.parameters(), bucket_mb=1.0, on_ready=rec)  # one bucket
    model[4](torch.randn(2, 31)).sum().backward()  # recording iteration reaches 2 of 6
    engine.flush()
    assert len(engine.buckets) == 1 and len(engine.buckets[0].params) == 6
    rec.events.clear()
    model[4](torch.randn(2, 31)).sum().backward()
    assert rec.events == []  # the bucket still misses 4 gradients
    model[0](torch.randn(2, 5)).sum().backward()  # reaches only parameters not yet ready
    assert rec.events == []  # model[2] is still missing
    engine.flush()
    assert [e[1] for e in rec.events] == [0]


def test_no_sync_and_second_backward():
    model = _mlp()
    rec = Recorder()
    engine = BucketEngine(model.parameters(), bucket_mb=1e-9, on_ready=rec)
    _backward(model)
    engine.flush()
    for p in model.parameters():
        p.grad = None
    rec.events.clear()

    with engine.no_sync():
        _backward(model, seed=1)
        _backward(model, seed=2)
    assert rec.events == []  # nothing made ready inside no_sync
    _backward(model, seed=3)
    assert len(rec.events) == 6
    grads = [p.grad.clone() for p in model.parameters()]

    with pytest.raises(RuntimeError, match="no_sync"):
        _backward(model, seed=4)
    with pytest.raises(RuntimeError, match="no_sync"), engine.no_sync():
        _backward(model, seed=5)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    assert len(rec.events) == 6

    engine.flush()  # a new iteration: backward works again
    rec.events.clear()
    _backward(model, seed=6)
    assert len(rec.events) == 6
    engine.remove()
    engine.flush()
    rec.events.clear()
    _backward(model, seed=7)
    assert rec.events == []


def _rank_order_worker(rank, n):
    model = _mlp(widths=(5, 33, 31, 7, 3))
    rec = Recorder()
    engine = BucketEngine(model.parameters(), bucket_mb=240 * 4 / 2**20, on_ready=rec)
    names = {id(p): name for name, p in model.named_parameters()}
    if rank % 2:
        # This rank reaches only the last layer in the recording iteration: its own order
        # differs from rank 0's, and the buckets must still be rank 0's.
        model[6](torch.randn(2, 7)).sum().backward()
    else:
        _backward(model)
    engine.flush()
    buckets = [[names[id(p)] for p in b.params] for b in engine.buckets]
    rec.events.clear()
    for p in model.parameters():
        p.grad = None
    _backward(model, seed=rank)
    during = [e[1] for e in rec.events]
    engine.flush()
    return buckets, during, [e[1] for e in rec.events]


@pytest.mark.parametrize("n", [2, 3])
def test_buckets_identical_on_every_rank(n):
    results = run_workers(n, _rank_order_worker)
    buckets = results[0][0]
    assert len(buckets) > 2
    assert set(buckets[0]) == {"6.weight", "6.bias", "4.weight", "4.bias"}  # rank 0's order
    for got, during, total in results:
        assert got == buckets
        assert during == list(range(len(buckets)))
        assert total == during


def test_hooks_do_not_keep_their_owners_alive():
    """Hooks live in autograd's C++ metadata, out of the garbage collector's sight: an engine,
    an overlap optimizer or a decentralized wrapper that is dropped must be freed (with its
    buffers and state) and its hooks removed, while the model lives on."""
    import gc
    import weakref

    import dlion_kernels as dk

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    owners = []
    for build in (
        lambda: BucketEngine(model.parameters(), bucket_mb=1e-4, on_ready=lambda b: None),
        lambda: dk.DistributedLion(model.parameters(), lr=1e-3, overlap=True, bucket_mb=1e-4),
        lambda: dk.DecentralizedDataParallel(model, lambda ps: torch.optim.SGD(ps, lr=0.1),
                                             topology="complete"),
    ):
        owner = build()
        for _ in range(2):  # record the order, then a step that uses the buckets
            model(torch.randn(4, 8)).sum().backward()
            if isinstance(owner, BucketEngine):
                owner.flush()
            elif isinstance(owner, dk.DistributedLion):
                owner.step()
            model.zero_grad(set_to_none=True)
        owners.append(weakref.ref(owner))
        del owner
        gc.collect()
    assert [o() for o in owners] == [None, None, None]
    p = next(model.parameters())
    assert not p._backward_hooks and not getattr(p, "_post_accumulate_grad_hooks", None)
    model(torch.randn(4, 8)).sum().backward()  # plain training again, no stale hook runs
    assert p.grad is not None
