"""Failure handling for the overlapped step and the DDP comm hook: a rank killed (SIGKILL) or
stalled (SIGSTOP) while bucket exchanges are in flight during backward, or at step(), makes every
other rank raise DistributedStepError naming the step and the collective, within the timeout plus a
margin, from backward() or step(); the failed step leaves parameters and momenta exactly as they
were (the applies run only after the step's last collective).

Real gloo processes (faults.py); every run is bounded and kills all its processes at the end.
"""

import copy
import datetime
import pickle

import pytest
import torch
import torch.distributed as dist
from faults import Fault, attempt, check_survivors, run_with_fault, snapshot

import dlion_kernels as dk
from dlion_kernels.exchange.pipeline import A2A, GATHER

PG_TIMEOUT = 5.0  # seconds: the group's own timeout, or DistributedLion(timeout=)
MARGIN = 15.0  # spawn jitter on a shared 2-core machine
FAULT_STEP = 2
DEADLINE = 300.0  # a safety net only: a hung run fails (and is killed) after this long
N = 3
BUCKETS = 6  # bucket_mb tiny: one bucket per parameter of _mlp
DDP_BUCKETS = 2  # DDP's own buckets with bucket_cap_mb=0.0005 (after its first iteration)


def _mlp():
    torch.manual_seed(0)  # identical parameters on every rank
    L = torch.nn.Linear
    return torch.nn.Sequential(L(8, 16), torch.nn.Tanh(), L(16, 16), torch.nn.Tanh(), L(16, 4))


def worker(rank, n, group, steps, variant):
    """``variant``: "group" (overlap=True; from FAULT_STEP on, the optimizer's group is the one
    whose timeout is PG_TIMEOUT), "timeout" (overlap=True on the default group, whose timeout is
    long; from FAULT_STEP on DistributedLion(timeout=PG_TIMEOUT) bounds the waits) or "ddp"
    (DDP with dk.register_ddp_comm_hook, default group, timeout= as for "timeout").

    Before FAULT_STEP the ranks line up on the default group before each step (a slow start on
    a loaded machine is not a stall). Returns what this rank saw (faults.check_survivors)."""
    model = _mlp()
    params = list(model.parameters())
    opt = dk.DistributedLion(params, lr=1e-2, weight_decay=0.1, overlap=variant != "ddp",
                             bucket_mb=1e-6)
    net = model
    if variant == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0005)
        dk.register_ddp_comm_hook(net, opt)
    gen = torch.Generator().manual_seed(100 + rank)
    completed, buckets = [], []
    for k in range(steps):
        if k <= FAULT_STEP:
            dist.barrier()
        if k == FAULT_STEP:
            if variant == "group":
                opt.group = group
            else:
                opt.timeout = PG_TIMEOUT
        x = torch.randn(4, 8, generator=gen)
        opt.zero_grad(set_to_none=True)
        before = snapshot(opt, params)
        seen = attempt([("backward", lambda x=x: net(x).square().mean().backward()),
                        ("step", opt.step)])
        if seen is not None:
            return dict(seen, before=before, now=snapshot(opt, params), completed=completed,
                        buckets=buckets)
        completed.append([p.detach().clone() for p in params])
        buckets.append(opt.last_stats.buckets)
    return dict(error=None, completed=completed, buckets=buckets)


CASES = [
    # (variant, action, point, occurrence, collectives the survivors may name, where they raise)
    # The victim dies just after starting bucket 0's all_to_all, during its backward: the
    # survivors notice in backward (reducing bucket 0 when bucket 1 starts) or in step().
    ("group", "kill", "after:" + A2A, 1, {A2A, GATHER}, {"backward", "step"}),
    ("group", "stop", "after:" + A2A, 1, {A2A, GATHER}, {"backward", "step"}),
    # The victim dies before the last bucket's gather, which step() issues: backward completes.
    ("group", "kill", "before:" + GATHER, BUCKETS, {GATHER}, {"step"}),
    ("timeout", "stop", "before:" + GATHER, BUCKETS, {GATHER}, {"step"}),
    ("ddp", "kill", "after:" + A2A, 1, {A2A, GATHER}, {"backward", "step"}),
    ("ddp", "stop", "before:" + GATHER, DDP_BUCKETS, {GATHER}, {"step"}),
]


@pytest.mark.parametrize("variant,action,point,occurrence,names,where", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2].split(':')[0]}-{c[3]}" for c in CASES])
def test_dead_or_stalled_rank_overlap_n3(variant, action, point, occurrence, names, where):
    fault = Fault(rank=1, step=FAULT_STEP, point=point, action=action, occurrence=occurrence)
    results = run_with_fault(N, worker, fault, FAULT_STEP + 2, variant, pg_timeout=PG_TIMEOUT,
                             deadline=DEADLINE)
    check_survivors(results, fault, N, steps={FAULT_STEP}, names=names,
                    limit=PG_TIMEOUT + MARGIN, where=where)
    expected = DDP_BUCKETS if variant == "ddp" else BUCKETS
    for r in (0, 2):  # the fault hit the bucket layout the case was written for
        assert results[r]["buckets"][-1] == expected, results[r]["buckets"]


@pytest.mark.parametrize("bad", [0, -1.0, "5", True, datetime.timedelta(0)])
def test_timeout_option_checked(bad):
    """timeout= of DistributedLion and DecentralizedDataParallel: None, seconds > 0 or a
    timedelta; anything else is a ValueError naming it, before anything is built."""
    model = _mlp()
    with pytest.raises(ValueError, match="timeout"):
        dk.DistributedLion(model.parameters(), timeout=bad)
    with pytest.raises(ValueError, match="timeout"):
        dk.DecentralizedDataParallel(model, lambda ps: dk.AccumAdamW(ps), timeout=bad)


def test_timeout_option_survives_copies():
    opt = dk.DistributedLion(_mlp().parameters(), timeout=7.5)
    assert copy.deepcopy(opt).timeout == 7.5
    assert pickle.loads(pickle.dumps(opt)).timeout == 7.5
