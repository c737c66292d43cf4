"""DistributedLion(overlap=True) and register_ddp_comm_hook against overlap=False on real gloo
ranks: bit-identical parameters and momenta (param groups, None and rank-dependent gradients,
frozen parameters, no_sync accumulation, a non-finite gradient on one rank, bf16), the order of
events that proves the overlap, bytes per step, and every bad use."""

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from workers import CountingCollectives, run_workers

import dlion_kernels as dk
from dlion_kernels.kernels.layout import aggregate_planes, vote_planes

ENTRIES = ("plain", "overlap", "ddp")
COMBOS = [("vote", "binary", torch.float32), ("average", "ternary", torch.bfloat16)]
STEPS = 5
NONFINITE_STEP, ACCUM_STEP = 2, 3


class Net(torch.nn.Module):
    """An MLP with a frozen layer, a layer no rank uses (gradient None) and a branch only odd
    ranks use (None on even ranks, a gradient on odd ones)."""

    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(6, 33)
        self.frozen = torch.nn.Linear(33, 33)
        self.frozen.requires_grad_(False)
        self.mid = torch.nn.Linear(33, 31)
        self.branch = torch.nn.Linear(31, 31)
        self.unused = torch.nn.Linear(4, 5)
        self.last = torch.nn.Linear(31, 3)
        self.to(dtype)

    def forward(self, x, use_branch):
        h = torch.tanh(self.mid(torch.tanh(self.frozen(torch.tanh(self.first(x))))))
        if use_branch:
            h = h + self.branch(h)
        return self.last(h)


def _batch(rank, step, micro, dtype):
    gen = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    x = torch.randn(4, 6, generator=gen).to(dtype)
    if step == NONFINITE_STEP and rank == 1:
        x[0, 0] = float("inf")  # a non-finite gradient on one rank only
    return x


def _make(entry, mode, votes, dtype, nonfinite="skip"):
    net = Net(dtype)
    groups = [
        {"params": [*net.first.parameters(), *net.unused.parameters()], "lr": 1e-2},
        {"params": [*net.mid.parameters(), *net.branch.parameters()], "lr": 3e-2,
         "betas": (0.8, 0.95), "weight_decay": 0.1},
        {"params": list(net.last.parameters()), "lr": 2e-2, "weight_decay": 0.01},
    ]
    frozen = list(net.frozen.parameters())
    opt = dk.DistributedLion(groups + [{"params": frozen}], mode=mode, votes=votes,
                             backend="cpu", nonfinite=nonfinite, overlap=entry == "overlap",
                             bucket_mb=300 * 4 / 2**20)
    model = net
    if entry == "ddp":
        model = DDP(net, find_unused_parameters=True, bucket_cap_mb=300 * 4 / 2**20)
        dk.register_ddp_comm_hook(model, opt)
    return net, model, opt


class _Uncounted:
    sent, calls = None, None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def _train(rank, n, entry, mode, votes, dtype, log=None):
    net, model, opt = _make(entry, mode, votes, dtype)
    if log is not None:
        net.first.register_full_backward_hook(lambda *a: log.append("first layer"))
    history = []
    for step in range(STEPS):
        opt.zero_grad()
        micro = 2 if step == ACCUM_STEP else 1
        # (the first step also broadcasts the ready order once: not counted)
        with CountingCollectives(n, log) if step > 0 else _Uncounted() as counter:
            for k in range(micro):
                x = _batch(rank, step, k, dtype)
                sync = model.no_sync if entry == "ddp" else opt.no_sync
                if k < micro - 1:
                    with sync():
                        model(x, rank % 2 == 1).float().square().mean().backward()
                else:
                    if log is not None:
                        log.append("backward")
                    model(x, rank % 2 == 1).float().square().mean().backward()
            if log is not None:
                log.append("step")
            opt.step()
        history.append((
            [p.detach().clone() for p in net.parameters()],
            [opt.state[p]["exp_avg"].clone() if p in opt.state else None
             for p in net.parameters()],
            opt.last_stats, counter.sent, counter.calls,
            [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in net.parameters()],
        ))
    return history


def _bit_identity_worker(rank, n):
    out = {}
    for mode, votes, dtype in COMBOS:
        for entry in ENTRIES:
            out[mode, votes, dtype, entry] = _train(rank, n, entry, mode, votes, dtype)
    log = []
    _train(rank, n, "overlap", "vote", "binary", torch.float32, log)
    out["log overlap"] = log
    log = []
    _train(rank, n, "ddp", "vote", "binary", torch.float32, log)
    out["log ddp"] = log
    return out


def _bound(n, mode, votes, d, tensors, buckets):
    """The wire-format bound 2 (n-1)/n d/8 (docs/wire-format.md) plus padding (a word per tensor
    and per rank in each plane), the 8-byte header to each peer per bucket, and an overlapped
    step's verdict word to each peer."""
    p = vote_planes(votes) + aggregate_planes(mode, votes, n)
    return (n - 1) / n * p * d / 8 + 4 * p * (tensors + n * buckets) + 8 * (n - 1) * buckets \
        + 4 * (n - 1)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_overlap_and_ddp_hook_bit_identical(n):
    ranks = run_workers(n, _bit_identity_worker)
    net = Net(torch.float32)
    trainable = [p for p in net.parameters() if p.requires_grad]
    d, tensors = sum(p.numel() for p in trainable), len(trainable)
    for mode, votes, dtype in COMBOS:
        ref = ranks[0][mode, votes, dtype, "plain"]
        for r, result in enumerate(ranks):
            plain = result[mode, votes, dtype, "plain"]
            for entry in ENTRIES:
                got = result[mode, votes, dtype, entry]
                for step, (params, moms, stats, sent, calls, grads) in enumerate(got):
                    # every rank keeps its local gradient: no all-reduce ran (not even DDP's)
                    assert all(torch.equal(a.nan_to_num(), b.nan_to_num())
                               for a, b in zip(grads, plain[step][5])), (entry, step)
                    # the same parameters as rank 0 and as overlap=False, bit for bit
                    for a, b, c in zip(params, plain[step][0], ref[step][0]):
                        assert torch.equal(a, b) and torch.equal(a, c), (entry, step)
                    for a, b in zip(moms, plain[step][1]):
                        assert (a is None and b is None) or torch.equal(a, b), (entry, step)
                    assert stats.skipped == (step == NONFINITE_STEP and n > 1)
                    if step > 0:
                        assert sent == stats.bytes_sent
                        assert sent <= _bound(n, mode, votes, d, tensors, stats.buckets)
                        assert calls.count("all_to_all_single") == stats.buckets * (n > 1)
                        # overlapped (buckets in backward): one more, the verdict word
                        late = entry != "plain"
                        assert calls.count("all_gather") == (stats.buckets + late) * (n > 1)
                    if entry == "overlap" and step > 0:
                        assert stats.buckets > 2
                # the skipped step changed no parameter and no momentum on any rank
                before, skipped = got[NONFINITE_STEP - 1], got[NONFINITE_STEP]
                if n > 1:
                    assert all(torch.equal(a, b) for a, b in zip(before[0], skipped[0]))
                    assert all(a is None or torch.equal(a, b)
                               for a, b in zip(before[1], skipped[1]))
                # frozen parameters never move and have no state
                assert torch.equal(got[-1][0][2], net.frozen.weight.to(dtype))
                assert got[-1][1][2] is None
    for result in ranks:
        for key in ("log overlap", "log ddp"):
            log = result[key]
            # Overlap: in every backward after the first, the first bucket's collective is
            # issued before backward reaches the first layer, and before step().
            starts = [i for i, e in enumerate(log) if e == "backward"][1:]
            for s in starts:
                first = log.index("first layer", s)
                issued = [e for e in log[s:first] if e == "all_to_all_single"]
                assert len(issued) >= (1 if n > 1 else 0), (key, log[s:first + 1])


def _bad_use_worker(rank, n):
    errors = []
    net, model, opt = _make("overlap", "vote", "binary", torch.float32, nonfinite="raise")

    def expect(exc, match, fn):
        with pytest.raises(exc, match=match):
            fn()
        errors.append(exc.__name__)

    def loss():
        return model(_batch(rank, 0, 0, torch.float32), False).square().mean()

    for _ in range(2):  # the first iteration records the order, the second overlaps
        opt.zero_grad()
        loss().backward()
        params = [p.detach().clone() for p in net.parameters()]
        grads = [None if p.grad is None else p.grad.clone() for p in net.parameters()]
        moms = {p: s["exp_avg"].clone() for p, s in opt.state.items()}
        expect(RuntimeError, "no_sync", lambda: loss().backward())
        with opt.no_sync():
            expect(RuntimeError, "no_sync", lambda: loss().backward())
        assert all(torch.equal(a, b) for a, b in zip(params, net.parameters()))
        assert all(a is None and p.grad is None or torch.equal(a, p.grad)
                   for a, p in zip(grads, net.parameters()))
        assert all(torch.equal(m, opt.state[p]["exp_avg"]) for p, m in moms.items())
        opt.step()  # the step that the error interrupted still works
    # a non-finite gradient with nonfinite="raise": an error on every rank, nothing modified
    opt.zero_grad()
    x = _batch(rank, 0, 0, torch.float32)
    x[0, 0] = float("inf")
    model(x, False).square().mean().backward()
    params = [p.detach().clone() for p in net.parameters()]
    moms = {p: s["exp_avg"].clone() for p, s in opt.state.items()}
    expect(dk.NonFiniteGradientError, "inf or NaN", opt.step)
    assert all(torch.equal(a, b) for a, b in zip(params, net.parameters()))
    assert all(torch.equal(m, opt.state[p]["exp_avg"]) for p, m in moms.items())
    assert all(s["step"] == 2 for s in opt.state.values())

    # fp16 GradScaler with overlap: the votes were taken from scaled gradients -> a clear error
    # on every rank, nothing modified, and the next step works
    opt.zero_grad()
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(loss()).backward()
    params = [p.detach().clone() for p in net.parameters()]
    moms = {p: s["exp_avg"].clone() for p, s in opt.state.items()}
    expect(ValueError, "GradScaler", lambda: scaler.step(opt))
    assert all(torch.equal(a, b) for a, b in zip(params, net.parameters()))
    assert all(torch.equal(m, opt.state[p]["exp_avg"]) for p, m in moms.items())
    opt.zero_grad()
    loss().backward()
    opt.step()
    assert all(s["step"] == 3 for s in opt.state.values())

    params = list(net.parameters())
    expect(TypeError, "overlap", lambda: dk.DistributedLion(params, overlap="yes"))
    expect(ValueError, "bucket_mb", lambda: dk.DistributedLion(params, overlap=True,
                                                               bucket_mb=0))
    expect(TypeError, "bucket_mb", lambda: dk.DistributedLion(params, bucket_mb="25"))
    ddp = DDP(Net(torch.float32), find_unused_parameters=True)
    good = dk.DistributedLion(ddp.parameters())
    expect(TypeError, "DistributedDataParallel", lambda: dk.register_ddp_comm_hook(net, good))
    expect(TypeError, "DistributedLion",
           lambda: dk.register_ddp_comm_hook(ddp, torch.optim.SGD(ddp.parameters(), lr=1.0)))
    expect(ValueError, "trainable parameters", lambda: dk.register_ddp_comm_hook(
        ddp, dk.DistributedLion(list(ddp.parameters())[:2])))
    dk.register_ddp_comm_hook(ddp, good)
    expect(RuntimeError, "already", lambda: dk.register_ddp_comm_hook(ddp, good))
    return errors


@pytest.mark.parametrize("n", [1, 2])
def test_bad_uses_raise_and_modify_nothing(n):
    for errors in run_workers(n, _bad_use_worker):
        assert len(errors) == 13
