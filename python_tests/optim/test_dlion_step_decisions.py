"""One decision at every step of ``DistributedLion``, on real gloo processes: a mistake on one
rank only, found late in the step (a non-finite gradient, a gradient the step refuses, a
learning rate or another param group setting changed on that rank alone, before backward or
after it, a closure that fails there), makes every rank raise the same
error within the bound given (``timeout=``), and no rank applies the step. Flat with overlap off
and on (2, 3 and 4 ranks), ``hierarchy=2`` (2 and 4 ranks), and DDP with the D-Lion comm hook
(3 ranks); every case of one world size runs in one launch. After each case the settings are put
back and the same optimizer steps again on the same process group, then a new one (with the
hook: on a new DDP wrapper), with bit-identical parameters on every rank (nothing was left in
flight).
"""

import datetime
import gc

import pytest
import torch
import torch.distributed as dist
from decisions import Net, identical, loss, outcome, same_decision
from torch.nn.parallel import DistributedDataParallel
from workers import run_workers

import dlion_kernels as dk

BOUND = 20  # seconds: the bound of every wait of a step (the optimizer's timeout=)
LR, WD, BETAS = 1e-2, 0.0, (0.9, 0.99)

# case: (the error type every rank raises, words every message holds)
CASES = {
    "non-finite gradient": ("NonFiniteGradientError", ["inf or NaN"]),
    "sparse gradient": ("TypeError", ["failed on ranks [{odd}]", "dense (strided)",
                                      "nothing was updated on any rank"]),
    "gradient of another shape": ("ValueError", ["failed on ranks [{odd}]", "shape"]),
    "negative lr": ("ValueError", ["failed on ranks [{odd}]", "lr must be"]),
    "negative lr before backward": ("ValueError", ["failed on ranks [{odd}]", "lr must be"]),
    "other lr": ("ValueError", ["ranks [{odd}]", "0.5", "nothing was updated on any rank"]),
    "other weight_decay": ("ValueError", ["ranks [{odd}]", "0.3"]),
    "other betas": ("ValueError", ["ranks [{odd}]", "(0.9, 0.5)"]),
    "other lr before backward": ("ValueError", ["ranks [{odd}]", "0.5"]),
    "closure fails": ("RuntimeError", ["failed on ranks [{odd}]", "closure failed here"]),
}


def _state(net, opt):
    return [p.detach().clone() for p in net.parameters()] + [
        s["exp_avg"].clone() for s in opt.state.values() if "exp_avg" in s]


def _make(net, overlap, hierarchy, group):
    """The model to call and a DistributedLion over ``net`` (``overlap="ddp"``: ``net`` wrapped in
    DDP, whose buckets run the exchange through the comm hook, one parameter each after the
    first step)."""
    groups = [{"params": net.body.parameters()}, {"params": net.unused.parameters()}]
    opt = dk.DistributedLion(groups, lr=LR, betas=BETAS, weight_decay=WD,
                             overlap=overlap is True, bucket_mb=1e-6, hierarchy=hierarchy,
                             group=group, timeout=BOUND, backend="torch")
    model = net
    if overlap == "ddp":
        model = DistributedDataParallel(net, process_group=group, find_unused_parameters=True,
                                        bucket_cap_mb=1e-6)
        dk.register_ddp_comm_hook(model, opt)
    return model, opt


def _case(rank, n, case, overlap, hierarchy, group):
    odd = rank == n - 1
    net = Net()
    model, opt = _make(net, overlap, hierarchy, group)
    loss(model, rank, 0).backward()
    opt.step()  # one good step (forms the buckets)
    opt.zero_grad(set_to_none=True)
    before = _state(net, opt)
    last = opt.param_groups[-1]

    def attempt():
        if odd and case == "other lr before backward":
            last["lr"] = 0.5
        if odd and case == "negative lr before backward":
            last["lr"] = -1.0
        loss(model, rank, 1, nan=case == "non-finite gradient" and odd).backward()
        closure = None
        if odd:
            if case == "sparse gradient":
                net.unused.weight.grad = torch.zeros(4, 4).to_sparse()
            elif case == "gradient of another shape":
                net.body[0].weight.grad.data = torch.zeros(3)
            elif case == "negative lr":
                last["lr"] = -1.0
            elif case == "other lr":
                last["lr"] = 0.5
            elif case == "other weight_decay":
                last["weight_decay"] = 0.3
            elif case == "other betas":
                last["betas"] = (0.9, 0.5)
        if case == "closure fails":
            def closure():
                if odd:
                    raise RuntimeError("closure failed here")
        opt.step(closure)

    seen = outcome(attempt)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, _state(net, opt)))
    # put everything back: the same optimizer steps again, on the same group
    last.update(lr=LR, weight_decay=WD, betas=BETAS)
    opt.zero_grad(set_to_none=True)

    def again():
        loss(model, rank, 2).backward()
        opt.step()

    after = outcome(again)
    fresh = after == ("ok", None) and identical(list(net.parameters()))
    # and a new optimizer (with the hook: a new DDP wrapper too) on the same group
    model = opt = None  # the old optimizer's hooks (and DDP's reducer) go with them
    gc.collect()

    def anew():
        model, opt = _make(net, overlap, hierarchy, group)
        for t in (3, 4):
            opt.zero_grad(set_to_none=True)
            loss(model, rank, t).backward()
            opt.step()

    renewed = outcome(anew)
    fresh = fresh and renewed == ("ok", None) and identical(list(net.parameters()))
    return dict(error=seen, unchanged=unchanged, fresh=fresh, after=(after, renewed))


def _worker(rank, n, paths):
    out = {}
    for overlap, hierarchy in paths:
        for case in CASES:
            # flat: a group of every rank made with the bound, one per case, so that a rank
            # left waiting shows as itself and leaves the other cases alone
            dist.barrier()  # the default group's long timeout: every rank is done with the last
            group = None if hierarchy else dist.new_group(
                list(range(n)), timeout=datetime.timedelta(seconds=BOUND))
            out[(overlap, hierarchy, case)] = _case(rank, n, case, overlap, hierarchy, group)
    return out


def _check(results, n):
    wrong = []
    for key in results[0]:
        kind, words = CASES[key[2]]
        got = [r[key] for r in results]
        if key in APPLIES:  # every rank applies the same update
            kind, words = "ok", []
        try:
            assert all(g["unchanged"] != (key in APPLIES) for g in got), "applied or not"
            assert all(g["fresh"] for g in got), "not fresh"  # the group steps, identical
            same_decision([g["error"] for g in got], kind,
                          [w.format(odd=n - 1) for w in words], key)
        except AssertionError as e:
            wrong.append((key, str(e)[:600], [g["after"] for g in got]))
    assert not wrong, "\n".join(map(str, wrong))


# With overlap, hierarchy takes the votes and the node-mean gradient during backward and reads
# the gradients no more: one replaced afterwards changes nothing, and every rank applies the step.
# So does DDP's hook: it votes on DDP's own gradient buffer, and the step applies from it.
APPLIES = {(True, 2, "gradient of another shape"), ("ddp", None, "gradient of another shape"),
           ("ddp", None, "sparse gradient")}
FLAT = [(False, None), (True, None)]
HIERARCHY = [(False, 2), (True, 2)]
DDP = [("ddp", None)]  # DDP with dk.register_ddp_comm_hook


@pytest.mark.parametrize("n,paths", [(2, FLAT + HIERARCHY), (3, FLAT + DDP),
                                     (4, FLAT + HIERARCHY)],
                         ids=["n2", "n3", "n4"])
def test_one_decision_at_every_step(n, paths):
    results = run_workers(n, _worker, paths, timeout=900)
    _check(results, n)
