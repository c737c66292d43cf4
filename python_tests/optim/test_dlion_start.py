"""One decision at construction and at load_state_dict (one verdict on every rank), on real gloo
processes: a mistake on one rank only (an argument another rank does not share, an argument
only that rank gets wrong, other starting weights, a loaded state of another step) makes every
rank raise the same error within the bound given (``timeout=``), and nothing is built or
loaded anywhere. Flat and hierarchy on 4 ranks, FSDP2 on a 2 x 2 mesh (``device_mesh=`` and
``group=``), in one launch of 4 processes; each case builds a fresh model. Afterwards the same
process group still steps (the verdict left nothing pending).
"""

import torch
import torch.distributed as dist
from decisions import check_cases, outcome
from torch import nn
from workers import run_workers

import dlion_kernels as dk
from dlion_kernels.exchange import sharded
from dlion_kernels.exchange.collectives import DistributedStepError
from dlion_kernels.exchange.header import StepMismatchError

N, L = 2, 2
SHAPES = [(5, 3), (4,), (3, 2)]
BOUND = 30  # seconds: every wait of the verdict (the object's timeout=)


class Net(nn.Module):
    def __init__(self, seed=1):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.a = nn.Linear(3, 5)
        self.b = nn.Linear(5, 2)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _fsdp(mesh, seed=1):
    from torch.distributed.fsdp import fully_shard

    net = Net(seed)
    fully_shard(net.a, mesh=mesh["shard"])
    fully_shard(net, mesh=mesh["shard"])
    return net


def _train(net, opt, rank, steps):
    for t in range(steps):
        opt.zero_grad()
        gen = torch.Generator().manual_seed(100 * t + rank)
        net(torch.randn(4, 3, generator=gen)).square().mean().backward()
        opt.step()


def _snapshot(opt):
    out = []
    for p in [p for g in opt.param_groups for p in g["params"]]:
        state = opt.state.get(p, {})
        m = state.get("exp_avg")
        m = sharded.own_shard(m).clone() if m is not None else None
        out.append((state.get("step"), m))
    return out, [(g["lr"], g["betas"], g["weight_decay"]) for g in opt.param_groups]


def _same_snapshot(a, b) -> bool:
    (sa, ga), (sb, gb) = a, b
    return ga == gb and len(sa) == len(sb) and all(
        x[0] == y[0] and ((x[1] is None and y[1] is None) or torch.equal(x[1], y[1]))
        for x, y in zip(sa, sb))


def _with_step(sd, step):
    """A copy of ``sd`` whose every state says ``step`` (the same momenta)."""
    return {"state": {i: dict(v, step=step) for i, v in sd["state"].items()},
            "param_groups": sd["param_groups"]}


def _load_case(build, rank, odd_rank, change):
    """Train 2 steps, then every rank loads its own state, ``change``d on ``odd_rank``: the
    outcome, and whether the optimizer's state is as before the load on this rank."""
    net, opt = build()
    _train(net, opt, rank, 2)
    sd = opt.state_dict()
    before = _snapshot(opt)
    loaded = change(sd) if rank == odd_rank else _with_step(sd, 2)
    result = outcome(lambda: opt.load_state_dict(loaded))
    return result, _same_snapshot(before, _snapshot(opt))


def _worker(rank, n):
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    kw = dict(lr=1e-2, timeout=BOUND, backend="torch")

    def flat(seed=1, **extra):
        net = Net(seed)
        return net, dk.DistributedLion(net.parameters(), **{**kw, **extra})

    # flat, 4 ranks
    out["flat other lr"] = outcome(lambda: flat(lr=1e-3 if rank == 3 else 1e-2))
    out["flat bad mode"] = outcome(lambda: flat(mode="bogus" if rank == 3 else "vote"))
    out["flat bad timeout"] = outcome(lambda: flat(timeout=-1 if rank == 0 else BOUND))
    out["flat weights"] = outcome(lambda: flat(seed=2 if rank == 1 else 1))
    out["flat bucket_mb"] = outcome(lambda: flat(overlap=True,
                                                  bucket_mb=1.0 if rank == 2 else 25.0))
    out["hierarchy weights"] = outcome(lambda: flat(seed=2 if rank == 3 else 1, hierarchy=2))
    out["flat load step"] = _load_case(flat, rank, 2, lambda sd: _with_step(sd, 1))
    out["flat load broken"] = _load_case(
        flat, rank, 0, lambda sd: {"state": sd["state"], "param_groups": []})
    # FSDP2, 2 replicas x 2 shards
    mesh = init_device_mesh("cpu", (N, L), mesh_dim_names=("replicate", "shard"))
    replicate = mesh.get_group("replicate")

    def fsdp(seed=1, mesh_kw=None, **extra):
        net = _fsdp(mesh, seed)
        where = dict(device_mesh=mesh) if mesh_kw is None else mesh_kw
        return net, dk.DistributedLion(net.parameters(), **{**kw, **where, **extra})

    out["fsdp other wd"] = outcome(lambda: fsdp(weight_decay=0.1 if rank == 3 else 0.0))
    out["fsdp bad votes"] = outcome(lambda: fsdp(votes="many" if rank == 1 else "binary"))
    out["fsdp weights"] = outcome(lambda: fsdp(seed=2 if rank == 2 else 1))
    out["fsdp group= weights"] = outcome(
        lambda: fsdp(seed=2 if rank == 3 else 1, mesh_kw=dict(group=replicate)))
    out["fsdp hierarchy"] = outcome(lambda: fsdp(hierarchy=2 if rank == 0 else None))
    out["fsdp load step"] = _load_case(fsdp, rank, 3, lambda sd: _with_step(sd, 7))
    # after every refusal, the same groups still work: a good optimizer on each path steps
    net, opt = flat()
    _train(net, opt, rank, 1)
    out["flat after"] = [p.detach().clone() for p in net.parameters()]
    net, opt = fsdp()
    _train(net, opt, rank, 1)
    out["fsdp after"] = [sharded.own_shard(p).detach().clone() for p in net.parameters()]
    out["replicate rank"] = dist.get_rank(replicate)
    return out


EXPECTED = {  # case: (error type, what every message names)
    "flat other lr": ("ValueError", ["ranks [3]", "lr", "0.001", "nothing was built"]),
    "flat bad mode": ("ValueError", ["failed on ranks [3]", "mode", "bogus"]),
    "flat bad timeout": ("ValueError", ["failed on ranks [0]", "timeout must be"]),
    "flat weights": ("ValueError", ["the parameters on ranks [1] differ from rank 0's",
                                    "same weights"]),
    "flat bucket_mb": ("ValueError", ["ranks [2]", "(overlap, bucket_mb)=(True, 1.0)"]),
    "hierarchy weights": ("ValueError", ["the parameters on ranks [3] differ from rank 0's"]),
    "flat load step": ("StepMismatchError", ["ranks [2] step=1", "step=2",
                                             "nothing was loaded"]),
    "flat load broken": ("ValueError", ["failed on ranks [0]", "parameter groups"]),
    "fsdp other wd": ("ValueError", ["ranks [3]", "weight_decay", "0.1"]),
    "fsdp bad votes": ("ValueError", ["failed on ranks [1]", "votes"]),
    # rank 2 is rank 0's replica (same shard): only their shards differ
    "fsdp weights": ("ValueError", ["the parameters on ranks [2] differ from rank 0's"]),
    "fsdp group= weights": ("ValueError", ["the parameters on ranks [3] differ from rank 1's"]),
    "fsdp hierarchy": ("ValueError", ["failed on ranks [0]", "does not apply to FSDP2"]),
    "fsdp load step": ("StepMismatchError", ["ranks [3] step=7", "nothing was loaded"]),
}


def test_one_decision_on_every_rank():
    ranks = run_workers(4, _worker, timeout=600)
    check_cases(ranks, EXPECTED)  # the same error everywhere; load cases: nothing loaded
    for key in ("flat after", "fsdp after"):
        for r in range(4):  # replicas bit-identical after a step
            peer = r ^ 2 if key == "fsdp after" else 0
            assert all(torch.equal(a, b) for a, b in zip(ranks[r][key], ranks[peer][key]))
    assert DistributedStepError.__name__ not in repr(ranks) and StepMismatchError


def test_single_process_raises_the_local_error():
    """Without a process group the verdict is this rank's own: the error as before."""
    net = Net()
    try:
        dk.DistributedLion(net.parameters(), lr=-1.0)
    except ValueError as e:
        assert "lr" in str(e) and "ranks" not in str(e)
    else:
        raise AssertionError("lr=-1 must raise")
