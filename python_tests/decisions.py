"""Helpers of the one-decision tests: run a call that may fail on some ranks, and check that every
rank reached the same verdict (the same error type and the same message, naming what it must);
and the small model and first step of the "mistake on one rank" cases of ``DistributedLion``."""

import torch
import torch.distributed as dist

import dlion_kernels as dk


class Net(torch.nn.Module):
    """Linear, Tanh, Linear, and a layer forward never reaches (its gradient stays None)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)  # identical parameters on every rank
        L = torch.nn.Linear
        self.body = torch.nn.Sequential(L(8, 16), torch.nn.Tanh(), L(16, 4))
        self.unused = L(4, 4)

    def forward(self, x):
        return self.body(x)


def loss(net, rank, t, nan=False):
    """Rank ``rank``'s loss at step ``t``; ``nan``: a non-finite gradient on this rank (taken
    during backward with overlap)."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * t + rank))
    if nan:
        x[0, 0] = float("nan")
    return net(x).square().mean()


def identical(tensors) -> bool:
    """Whether every rank of the default group holds these tensors bit for bit."""
    flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(out, flat)
    return all(torch.equal(out[0], o) for o in out)


def stepped_once(rank, param_groups=False, **options):
    """A fresh ``Net`` and a ``DistributedLion(**options)`` on it (``param_groups``: the body and
    the unused layer as two groups) after one good step, which forms the buckets, with the
    gradients set to None: where a case then makes its mistake. Returns (net, optimizer)."""
    net = Net()
    params = ([{"params": net.body.parameters()}, {"params": net.unused.parameters()}]
              if param_groups else net.parameters())
    opt = dk.DistributedLion(params, **options)
    loss(net, rank, 0).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return net, opt


def outcome(fn):
    """('ok', None) or (exception type name, message); never lets an exception out."""
    try:
        fn()
        return ("ok", None)
    except Exception as e:  # noqa: BLE001 - the type is the result
        return (type(e).__name__, str(e))


def same_decision(got, kind: str, words, case) -> str:
    """``got``: every rank's ``outcome``. Every rank raised ``kind`` (never a
    ``DistributedStepError``: no rank waited out a timeout) with one message holding every one of
    ``words``; returns that message."""
    assert {k for k, _ in got} == {kind}, (case, got)
    messages = {m for _, m in got}
    assert len(messages) == 1, (case, got)  # the same error on every rank
    message = messages.pop()
    for word in words:
        assert word in message, (case, word, message)
    return message


def check_cases(ranks, expected) -> None:
    """``ranks``: every rank's dict of case -> ``outcome`` (or (``outcome``, whether this rank's
    object is unchanged)); ``expected``: case -> (error type, words of its message)."""
    for case, (kind, words) in expected.items():
        got = [r[case] for r in ranks]
        if isinstance(got[0][0], tuple):  # (outcome, unchanged on this rank)
            assert all(unchanged for _, unchanged in got), (case, got)  # nothing changed
            got = [result for result, _ in got]
        same_decision(got, kind, words, case)
