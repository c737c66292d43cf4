"""DistributedLion over FSDP2-sharded parameters on real gloo processes.

The model (``Net``) has the parameters of ``SHAPES`` in two FSDP2 blocks (two param groups with
their own hyper-parameters) and the loss sum_i (W_i * x_i).sum(), so the gradient of W_i is the
data x_i: integer-valued, which makes FSDP's mean over the L ranks of a replica exact, and equal
to hierarchical D-Lion's node mean (hierarchy=L). The shapes have odd sizes, so FSDP's shards are
uneven or empty ((33, 6): 17 and 16 rows with L = 2; (1,): one element and none); every local
shard starts at an even element index of its tensor, so even the binary tie rule (the parity of
an element's position, kernels/layout.py) breaks alike here and under hierarchy: the parameters
and momenta are compared with ``hierarchy=L`` bit for bit, for every mode and vote.
"""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn
from workers import run_workers

import dlion_kernels as dk
from dlion_kernels.exchange import sharded
from dlion_kernels.kernels.layout import aggregate_planes, num_blocks, shard_blocks, vote_planes

SHAPES = [(33, 6), (7,), (5, 4), (1,)]
GROUPS = [dict(lr=0.01, betas=(0.9, 0.99), weight_decay=0.1),
          dict(lr=0.02, betas=(0.8, 0.95), weight_decay=0.0)]
VARIANTS = [("vote", "binary"), ("average", "binary"), ("vote", "ternary"),
            ("average", "ternary")]
STEPS = 4


class Block(nn.Module):
    def __init__(self, shapes, gen):
        super().__init__()
        self.ws = nn.ParameterList([nn.Parameter(torch.randn(s, generator=gen)) for s in shapes])

    def forward(self, xs):
        return sum((w * x).sum() for w, x in zip(self.ws, xs))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(1)
        self.blocks = nn.ModuleList([Block(SHAPES[:2], gen), Block(SHAPES[2:], gen)])

    def forward(self, xs):
        return self.blocks[0](xs[:2]) + self.blocks[1](xs[2:])


def _mesh(N, L):
    from torch.distributed.device_mesh import init_device_mesh

    if N is None:
        return init_device_mesh("cpu", (L,), mesh_dim_names=("shard",))
    return init_device_mesh("cpu", (N, L), mesh_dim_names=("replicate", "shard"))


def _shard_mesh(mesh):
    return mesh["shard"] if mesh.ndim == 2 else mesh


def _fsdp(mesh, **kw):
    from torch.distributed.fsdp import fully_shard

    net = Net()
    for b in net.blocks:
        fully_shard(b, mesh=_shard_mesh(mesh), **kw)
    fully_shard(net, mesh=_shard_mesh(mesh), **kw)
    return net


def _groups(net):
    return [dict(params=list(b.parameters()), **g) for b, g in zip(net.blocks, GROUPS)]


def _data(step, rank):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randint(-3, 4, s, generator=gen).float() for s in SHAPES]


def _backward(net, step, rank):
    net(_data(step, rank)).backward()


def _locals(net):
    return [sharded.own_shard(p).detach().clone() for p in net.parameters()]


def _momenta(opt, net):
    return [sharded.momentum_local(opt.state[p]["exp_avg"]).clone() for p in net.parameters()]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _replicas_identical(net, group) -> bool:
    """Every replica of this rank's shards holds the same bits."""
    same = True
    for p in net.parameters():
        mine = sharded.own_shard(p).detach()
        got = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(got, mine.contiguous(), group=group)
        same &= all(torch.equal(g, mine) for g in got)
    return same


class GroupBytes:
    """Bytes this rank hands to all_to_all_single / all-gathers, by process group: ``inter``
    for the replicate group (between nodes), ``intra`` for any other (inside the node)."""

    NAMES = ("all_to_all_single", "all_gather_into_tensor", "all_gather_single")

    def __init__(self, replicate):
        self.replicate, self.inter, self.intra, self.saved = replicate, 0, 0, {}

    def __enter__(self):
        for name in self.NAMES:
            if hasattr(dist, name):
                self.saved[name] = original = getattr(dist, name)
                setattr(dist, name, self._counted(name, original))
        return self

    def _counted(self, name, original):
        def counted(output, input, *args, group=None, **kwargs):
            size = dist.get_world_size(group)
            nbytes = input.numel() * input.element_size()
            nbytes = nbytes * (size - 1) // size if name == "all_to_all_single" else \
                nbytes * (size - 1)
            if group is self.replicate:
                self.inter += nbytes
            else:
                self.intra += nbytes
            return original(output, input, *args, group=group, **kwargs)

        return counted

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def _hierarchy_momenta(opt, params, N, L):
    """Hierarchy's node momenta, assembled from every rank's momentum shard."""
    pieces = {i: (opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_range"])
              for i, p in enumerate(params)}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, pieces)
    nodes = []
    for k in range(N):
        node = []
        for i, p in enumerate(params):
            flat = torch.zeros(p.numel())
            for r in range(k * L, (k + 1) * L):
                m, (lo, hi) = everyone[r][i]
                flat[lo:hi] = m
            node.append(flat.view(p.shape))
        nodes.append(node)
    return nodes


# ----------------------------------------------------------------------------- hierarchy


def _vs_hierarchy(rank, n, L, variants, bucket_mb):
    N = n // L
    mesh = _mesh(N, L)
    replicate = mesh["replicate"].get_group()
    out = {}
    for mode, votes in variants:
        net = _fsdp(mesh)
        opt = dk.DistributedLion(_groups(net), mode=mode, votes=votes, device_mesh=mesh)
        over = _fsdp(mesh)
        opt_over = dk.DistributedLion(_groups(over), mode=mode, votes=votes, device_mesh=mesh,
                                      overlap=True, bucket_mb=bucket_mb)
        # the replicate group as group= instead of the mesh: the same steps
        grouped = _fsdp(mesh)
        opt_g = dk.DistributedLion(_groups(grouped), mode=mode, votes=votes, group=replicate)
        plain = Net()
        opt_h = dk.DistributedLion(_groups(plain), mode=mode, votes=votes, hierarchy=L)
        rows = []
        for t in range(STEPS):
            opt.zero_grad()
            _backward(net, t, rank)
            with GroupBytes(replicate) as counted:
                opt.step()
            for m, o in ((over, opt_over), (grouped, opt_g)):
                o.zero_grad()
                _backward(m, t, rank)
                o.step()
            for p, x in zip(plain.parameters(), _data(t, rank)):
                p.grad = x
            opt_h.step()
            full = [p.full_tensor() for p in net.parameters()]
            momenta = [opt.state[p]["exp_avg"].full_tensor() for p in net.parameters()]
            node = _hierarchy_momenta(opt_h, list(plain.parameters()), N, L)
            s = opt.last_stats
            rows.append(dict(
                params=_same(full, [p.detach() for p in plain.parameters()]),
                momenta=all(_same([m[k] for m in momenta], node[k]) for k in range(N)),
                overlap=_same(_locals(net), _locals(over))
                and _same(_momenta(opt, net), _momenta(opt_over, over)),
                group=_same(_locals(net), _locals(grouped))
                and _same(_momenta(opt, net), _momenta(opt_g, grouped)),
                replicas=_replicas_identical(net, replicate),
                counted=(counted.intra, counted.inter),
                stats=(s.intra_node_bytes_sent, s.inter_node_bytes_sent, s.bytes_sent, s.numel,
                       s.world_size, s.shards, s.skipped, type(s).__name__),
                buckets=opt_over.last_stats.buckets,
                steps=sorted({opt.state[p]["step"] for p in net.parameters()})))
        out[(mode, votes)] = rows
    out["local"] = [p.numel() for p in _locals(net)]
    return out


def _check_vs_hierarchy(n, L, variants, bucket_mb, buckets):
    N = n // L
    results = run_workers(n, _vs_hierarchy, L, variants, bucket_mb)
    for r, res in enumerate(results):
        numels = res["local"]
        d, T = sum(numels), sum(num_blocks(k) for k in numels)
        for mode, votes in variants:
            p_in, p_out = vote_planes(votes), aggregate_planes(mode, votes, N)
            # what the exchange sends between nodes, counted: the all_to_all of N - 1 chunks
            # (the 2-word header and the votes of one sub-shard) and the gather of the tally
            S = shard_blocks(T, N)
            exact = (N - 1) * 4 * (2 + S * (p_in + p_out))
            # the wire's bound for N voters on the d local elements, plus padding: one block per
            # tensor and per rank, and the header words
            spec = (p_in + p_out) * (N - 1) / N * d / 8
            padding = (N - 1) * 4 * ((p_in + p_out) * (len(numels) / N + 1) + 2)
            intra = (N * L - 1) * 2 * 4  # this rank's [flag, step] to the n - 1 others
            for t, row in enumerate(res[(mode, votes)]):
                where = (r, mode, votes, t)
                assert row["params"] and row["momenta"], where
                assert row["overlap"] and row["replicas"] and row["group"], where
                assert row["buckets"] == buckets, where
                assert row["steps"] == [t + 1], where
                assert row["counted"] == (intra, exact), (where, row["counted"])
                assert row["counted"][1] <= spec + padding, where
                assert row["stats"] == (intra, exact, intra + exact, d, N, L, False,
                                        "StepStats"), (where, row["stats"])


def test_2x2_against_hierarchy():
    """2 replicas x 2 shards, every mode and vote, against hierarchy=2: parameters and momenta
    bit for bit, replicas identical, bytes counted; overlap=True (one bucket per tensor) and
    group= (the replicate group instead of the mesh) bit for bit the same."""
    _check_vs_hierarchy(4, 2, VARIANTS, bucket_mb=1e-6, buckets=len(SHAPES))


def test_4x2_against_hierarchy():
    """4 replicas x 2 shards (8 processes), the paper's vote: as above, overlap in one bucket."""
    _check_vs_hierarchy(8, 2, [("vote", "binary")], bucket_mb=25.0, buckets=1)


# ----------------------------------------------------------------------------- 1-D mesh


def _one_dimensional(rank, n):
    import lion_pytorch

    mesh = _mesh(None, n)
    net = _fsdp(mesh)
    opt = dk.DistributedLion(_groups(net), votes="ternary", device_mesh=mesh)
    # without device_mesh, group=None: the parameters are sharded over every rank, N = 1
    net2 = _fsdp(mesh)
    opt2 = dk.DistributedLion(_groups(net2), votes="ternary", overlap=True)
    plain = Net()
    opt_h = dk.DistributedLion(_groups(plain), votes="ternary", hierarchy=n)
    lion = Net()
    opt_l = lion_pytorch.Lion(_groups(lion))
    out = dict(hierarchy=[], group=[], lion=[])
    for t in range(STEPS):
        for m, o in ((net, opt), (net2, opt2)):
            o.zero_grad()
            _backward(m, t, rank)
            o.step()
        data = [_data(t, r) for r in range(n)]
        for p, q, *xs in zip(plain.parameters(), lion.parameters(), *data):
            p.grad = sum(xs) / n  # the exact mean (integer data)
            q.grad = p.grad.clone()
        opt_h.step()
        opt_l.step()
        full = [p.full_tensor() for p in net.parameters()]
        out["hierarchy"].append(_same(full, [p.detach() for p in plain.parameters()]))
        out["group"].append(_same(_locals(net), _locals(net2)))
        # same votes; only the order of the weight-decay rounding differs (test_step.py)
        out["lion"].append(all(torch.allclose(a, b.detach(), rtol=(t + 1) * 2**-23, atol=1e-7)
                               for a, b in zip(full, lion.parameters())))
    s = opt.last_stats
    out["stats"] = (s.world_size, s.shards, s.inter_node_bytes_sent, s.intra_node_bytes_sent)
    return out


def test_one_dimensional_mesh_is_plain_lion():
    """A 1-D mesh (N = 1): plain Lion on FSDP's exact mean gradient, bit for bit hierarchy=n
    (one node) and lion_pytorch.Lion to within one fp32 rounding per step (only the order of the
    weight-decay rounding differs); without device_mesh and with group=None the same."""
    pytest.importorskip("lion_pytorch")
    n = 2
    for r, res in enumerate(run_workers(n, _one_dimensional)):
        assert all(res["hierarchy"]) and all(res["group"]) and all(res["lion"]), (r, res)
        # no replicate exchange; the header gather inside the mesh: [flag, step] to n - 1 ranks
        assert res["stats"] == (1, n, 0, (n - 1) * 2 * 4), (r, res["stats"])


# ----------------------------------------------------------------------------- one decision


def _step_outcome(opt):
    try:
        opt.step()
    except (dk.NonFiniteGradientError, dk.StepMismatchError, RuntimeError) as e:
        return type(e).__name__, str(e)
    return ("skipped" if opt.last_stats.skipped else "stepped"), ""


def _decisions(rank, n):
    mesh = _mesh(2, 2)
    out = {}
    # A NaN in rank 2's data, in rows of the (33, 6) weight that rank 3 holds: after FSDP's
    # reduce-scatter only rank 3's gradient shard has it (replica 1, shard 1). Ranks 0 and 2 learn
    # it only through the shard group's header gather.
    for nonfinite in ("raise", "skip"):
        net = _fsdp(mesh)
        opt = dk.DistributedLion(_groups(net), device_mesh=mesh, nonfinite=nonfinite)
        _backward(net, 0, rank)
        opt.step()
        before = (_locals(net), _momenta(opt, net))
        opt.zero_grad()
        xs = _data(1, rank)
        if rank == 2:
            xs[0][20, 3] = float("nan")
        net(xs).backward()
        has_nan = any(not sharded.own_shard(p.grad).isfinite().all() for p in net.parameters())
        outcome = _step_outcome(opt)[0]
        out[nonfinite] = (outcome, has_nan, _same(before[0], _locals(net)),
                          _same(before[1], _momenta(opt, net)),
                          sorted({opt.state[p]["step"] for p in net.parameters()}))

    # Shard 1 of both replicas (ranks 1 and 3) two steps ahead: each replicate group agrees
    # within itself, the shard groups do not. Every rank raises; nothing moves.
    net = _fsdp(mesh)
    opt = dk.DistributedLion(_groups(net), device_mesh=mesh)
    _backward(net, 0, rank)
    opt.step()
    if rank % 2:
        for p in net.parameters():
            opt.state[p]["step"] += 2
    before = (_locals(net), _momenta(opt, net))
    opt.zero_grad()
    _backward(net, 1, rank)
    outcome, message = _step_outcome(opt)
    out["mismatch"] = (outcome, message, _same(before[0], _locals(net)),
                       _same(before[1], _momenta(opt, net)))

    # overlap=True: a second backward reduces gradients already exchanged: step() refuses,
    # nothing moves; the next step goes on as if the refused one had not been tried.
    net, twin = _fsdp(mesh), _fsdp(mesh)
    opt = dk.DistributedLion(_groups(net), device_mesh=mesh, overlap=True, bucket_mb=1e-6)
    opt_t = dk.DistributedLion(_groups(twin), device_mesh=mesh)
    for m, o in ((net, opt), (twin, opt_t)):
        _backward(m, 0, rank)
        o.step()
        o.zero_grad()
    before = (_locals(net), _momenta(opt, net))
    _backward(net, 1, rank)
    _backward(net, 1, rank)
    outcome, message = _step_outcome(opt)
    refused = (outcome, message, _same(before[0], _locals(net)),
               _same(before[1], _momenta(opt, net)))
    for m, o in ((net, opt), (twin, opt_t)):
        o.zero_grad()
        _backward(m, 2, rank)
        o.step()
    out["twice"] = refused + (_same(_locals(net), _locals(twin))
                              and _same(_momenta(opt, net), _momenta(opt_t, twin)),)

    # Gradient accumulation through FSDP2's own switch: overlap on and off bit for bit.
    nets = [_fsdp(mesh), _fsdp(mesh)]
    opts = [dk.DistributedLion(_groups(m), device_mesh=mesh, overlap=o, bucket_mb=1e-6)
            for m, o in zip(nets, (False, True))]
    for t in range(3):
        for m, o in zip(nets, opts):
            o.zero_grad()
            m.set_requires_gradient_sync(False)
            _backward(m, 10 + t, rank)
            m.set_requires_gradient_sync(True)
            _backward(m, 20 + t, rank)
            o.step()
    out["accumulate"] = _same(_locals(nets[0]), _locals(nets[1])) and \
        _same(_momenta(opts[0], nets[0]), _momenta(opts[1], nets[1]))
    return out


def test_one_decision_for_all_ranks():
    """2 x 2: a non-finite value reaches one rank's reduced shard, yet every rank raises (or
    skips) and nothing moves anywhere; shard groups at different steps all raise; with overlap a
    second backward is refused at step() with nothing modified; accumulation with
    set_requires_gradient_sync(False) gives overlap on and off the same bits."""
    for r, res in enumerate(run_workers(4, _decisions)):
        assert res["raise"] == ("NonFiniteGradientError", r == 3, True, True, [1]), (r, res)
        assert res["skip"] == ("skipped", r == 3, True, True, [1]), (r, res)
        outcome, message, *unchanged = res["mismatch"]
        assert outcome == "StepMismatchError" and "step 1" in message and "step 3" in message, \
            (r, res["mismatch"])
        assert unchanged == [True, True], r
        outcome, message, *same = res["twice"]
        assert outcome == "RuntimeError" and "set_requires_gradient_sync(False)" in message, \
            (r, message)
        assert same == [True, True, True], (r, same)
        assert res["accumulate"], r


# ----------------------------------------------------------------------------- mixed precision


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.lin1, self.lin2 = nn.Linear(7, 33), nn.Linear(33, 5)

    def forward(self, x):
        return self.lin2(torch.relu(self.lin1(x)))


def _mlp(mesh, dtype):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    net = MLP()
    for m in (net.lin1, net.lin2, net):
        fully_shard(m, mesh=mesh["shard"], mp_policy=policy)
    return net


def _loss(net, step, rank, scale=1.0):
    gen = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(8, 7, generator=gen) * scale, torch.randn(8, 5, generator=gen)
    return (net(x).float() - y).pow(2).mean()


def _oracle(opt, net, replicate, step, lr, betas, weight_decay):
    """What one vote/binary step must give this rank's shards: the N replicas' gradient and
    momentum shards gathered, the votes, tally and apply done by the reference stages."""
    from dlion_kernels.kernels import reference
    from dlion_kernels.kernels.layout import block_offsets

    params = [sharded.own_shard(p).detach().clone() for p in net.parameters()]
    grads = [sharded.own_shard(p.grad) for p in net.parameters()]
    moms = _momenta(opt, net)
    offsets, total = block_offsets(p.numel() for p in params)
    N = dist.get_world_size(replicate)

    def gathered(t):
        got = [torch.empty_like(t) for _ in range(N)]
        dist.all_gather(got, t.contiguous(), group=replicate)
        return got

    every_grad, every_mom = [gathered(g) for g in grads], [gathered(m) for m in moms]
    stacked = torch.zeros(N, total, dtype=torch.int32)
    for i in range(N):
        reference.local_step([g[i] for g in every_grad], [m[i] for m in every_mom], stacked[i],
                             offsets, betas[0], False)
    aggregate = torch.empty(total, dtype=torch.int32)
    reference.tally(stacked, aggregate, N, "vote", False, step)
    reference.apply(params, grads, moms, aggregate, offsets, lr, weight_decay, betas[1], N,
                    "vote", False)
    return params, moms


def _mixed_precision(rank, n):
    mesh = _mesh(2, 2)
    replicate = mesh["replicate"].get_group()
    out = {}
    hyper = dict(lr=0.01, betas=(0.9, 0.99), weight_decay=0.1)
    # bf16 compute, fp32 reduce: the optimizer sees fp32 shards and fp32 reduced gradients
    nets = [_mlp(mesh, torch.bfloat16) for _ in range(2)]
    opts = [dk.DistributedLion(m.parameters(), device_mesh=mesh, overlap=o, bucket_mb=1e-6,
                               backend="torch", **hyper) for m, o in zip(nets, (False, True))]
    rows = []
    for t in range(3):
        for m, o in zip(nets, opts):
            o.zero_grad()
            _loss(m, t, rank).backward()
        expect = _oracle(opts[0], nets[0], replicate, t, **hyper)
        for o in opts:
            o.step()
        rows.append(dict(
            dtypes={(sharded.own_shard(p).dtype, sharded.own_shard(p.grad).dtype)
                    for p in nets[0].parameters()},
            oracle=_same(expect[0], _locals(nets[0])) and _same(expect[1], _momenta(opts[0],
                                                                                 nets[0])),
            overlap=_same(_locals(nets[0]), _locals(nets[1]))
            and _same(_momenta(opts[0], nets[0]), _momenta(opts[1], nets[1])),
            replicas=_replicas_identical(nets[0], replicate)))
    out["bf16"] = rows

    # fp16 compute with torch.amp.GradScaler (overlap=False): an overflow in replica 1's
    # backward skips the step on every rank, and every rank's scaler backs off alike.
    net = _mlp(mesh, torch.float16)
    opt = dk.DistributedLion(net.parameters(), device_mesh=mesh, **hyper)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    seen = []
    for t in range(3):
        opt.zero_grad()
        scaler.scale(_loss(net, t, rank, scale=1e6 if t == 1 and rank == 2 else 1.0)).backward()
        before = _locals(net)
        scaler.step(opt)
        scaler.update()
        seen.append((opt.last_stats.skipped, not _same(before, _locals(net)), scaler.get_scale()))
    out["fp16"] = (seen, _replicas_identical(net, replicate))

    # fp16 GradScaler with overlap=True: the votes were taken from scaled gradients, refused
    net = _mlp(mesh, torch.float16)
    opt = dk.DistributedLion(net.parameters(), device_mesh=mesh, overlap=True, **hyper)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(_loss(net, 0, rank)).backward()
    before = _locals(net)
    try:
        scaler.step(opt)
        out["fp16 overlap"] = "stepped"
    except ValueError as e:
        out["fp16 overlap"] = (str(e), _same(before, _locals(net)))
    return out


def test_mixed_precision():
    """FSDP2's MixedPrecisionPolicy: bf16 compute with fp32 reduce (each step equals the
    reference stages on the replicas' gathered shards; overlap on and off bit for bit; replicas
    identical); fp16 compute with a GradScaler (overflow on one replica: every rank skips, the
    scales stay equal); fp16 GradScaler with overlap=True refused."""
    for r, res in enumerate(run_workers(4, _mixed_precision)):
        for t, row in enumerate(res["bf16"]):
            assert row["dtypes"] == {(torch.float32, torch.float32)}, (r, t, row)
            assert row["oracle"] and row["overlap"] and row["replicas"], (r, t, row)
        seen, replicas = res["fp16"]
        assert [s[:2] for s in seen] == [(False, True), (True, False), (False, True)], (r, seen)
        assert [s[2] for s in seen] == [2.0**8, 2.0**7, 2.0**7], (r, seen)
        assert replicas, r
        message, unchanged = res["fp16 overlap"]
        assert "GradScaler cannot be combined with overlap=True" in message and unchanged, r


# ----------------------------------------------------------------------------- checkpoints


def _train(net, opt, steps, rank):
    for t in steps:
        opt.zero_grad()
        _backward(net, t, rank)
        opt.step()


def _dcp_state(net, opt):
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    return {"model": get_model_state_dict(net), "optim": get_optimizer_state_dict(net, opt)}


def _dcp_load(net, opt, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = _dcp_state(net, opt)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(net, state["model"])
    set_optimizer_state_dict(net, opt, state["optim"])


def _checkpoints(rank, n, directory):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    mesh = _mesh(2, 2)
    replicate = mesh["replicate"].get_group()
    out = {}
    # A fresh optimizer has its state: get_optimizer_state_dict runs no step (torch's
    # _init_optim_state would call step() with zero gradients on an empty state). Rank 0
    # alone calls it: a collective would hang.
    net = _fsdp(mesh)
    opt = dk.DistributedLion(_groups(net), device_mesh=mesh)
    before = _locals(net)
    if rank == 0:
        state = get_optimizer_state_dict(net, opt)["state"]
        out["fresh"] = (opt.last_stats is None, _same(before, _locals(net)),
                        {v["step"] for v in state.values()},
                        {tuple(v["exp_avg"].shape) for v in state.values()})
    dist.barrier()

    _train(net, opt, range(2), rank)
    dcp.save(_dcp_state(net, opt), checkpoint_id=os.path.join(directory, "dcp"))
    dk.save_state(opt, os.path.join(directory, "dk"))
    at_save = (_locals(net), _momenta(opt, net))
    out["full momenta"] = [opt.state[p]["exp_avg"].full_tensor() for p in net.parameters()]
    out["full params"] = [p.full_tensor() for p in net.parameters()]
    # the replicas' momenta differ (their data do): a checkpoint must keep each
    other = []
    for m in at_save[1]:
        got = [torch.empty_like(m) for _ in range(2)]
        dist.all_gather(got, m, group=replicate)
        other.append(m.numel() == 0 or not torch.equal(got[0], got[1]))
    out["replicas differ"] = all(other)
    _train(net, opt, range(2, 4), rank)
    goal = (_locals(net), _momenta(opt, net))

    # DCP: a fresh model and optimizer on the same mesh resume exactly, each rank with its own
    # replica's momentum
    net2 = _fsdp(mesh)
    opt2 = dk.DistributedLion(_groups(net2), device_mesh=mesh)
    _dcp_load(net2, opt2, os.path.join(directory, "dcp"))
    out["dcp loaded"] = (_same(at_save[0], _locals(net2)), _same(at_save[1], _momenta(opt2, net2)),
                         sorted({opt2.state[p]["step"] for p in net2.parameters()}))
    _train(net2, opt2, range(2, 4), rank)
    out["dcp resumed"] = _same(goal[0], _locals(net2)) and _same(goal[1], _momenta(opt2, net2))

    # dk.save_state / dk.load_state: every rank's file back to its rank (the parameters come
    # from the model's own checkpoint: here the values at the save)
    net3 = _fsdp(mesh)
    with torch.no_grad():
        for p, x in zip(net3.parameters(), at_save[0]):
            sharded.own_shard(p).copy_(x)
    opt3 = dk.DistributedLion(_groups(net3), device_mesh=mesh)
    dk.load_state(opt3, os.path.join(directory, "dk"))
    out["dk loaded"] = _same(at_save[1], _momenta(opt3, net3))
    _train(net3, opt3, range(2, 4), rank)
    out["dk resumed"] = _same(goal[0], _locals(net3)) and _same(goal[1], _momenta(opt3, net3))

    # Another number of replicas (4 x 1): the momentum's global shape differs, DCP refuses it
    # before anything is loaded; dk.load_state refuses the other mesh.
    mesh4 = _mesh(4, 1)
    net4 = _fsdp(mesh4)
    opt4 = dk.DistributedLion(_groups(net4), device_mesh=mesh4)
    kept = _momenta(opt4, net4)
    try:
        dcp.load({"optim": get_optimizer_state_dict(net4, opt4)},
                 checkpoint_id=os.path.join(directory, "dcp"))
        out["dcp 4x1"] = "loaded"
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        out["dcp 4x1"] = (type(e).__name__, str(e)[-2000:])
    try:
        dk.load_state(opt4, os.path.join(directory, "dk"))
        out["dk 4x1"] = "loaded"
    except dk.CheckpointError as e:
        out["dk 4x1"] = str(e)
    out["4x1 unchanged"] = _same(kept, _momenta(opt4, net4))
    return out


def _resharded(rank, n, directory):
    """The 2 x 2 checkpoint on 2 ranks, a 2 x 1 mesh: same N, so DCP reshards each replica's
    momentum (and the parameters) onto its one rank."""
    mesh = _mesh(2, 1)
    net = _fsdp(mesh)
    opt = dk.DistributedLion(_groups(net), device_mesh=mesh)
    try:
        dk.load_state(opt, os.path.join(directory, "dk"))
        refused = "loaded"
    except dk.CheckpointError as e:
        refused = str(e)
    _dcp_load(net, opt, os.path.join(directory, "dcp"))
    return _locals(net), _momenta(opt, net), refused


def test_checkpoints():
    """DCP (get/set_optimizer_state_dict, dcp.save/load) and dk.save_state/load_state on a 2 x 2
    mesh: exact resume, each replica's own momentum restored (they differ); a fresh optimizer's
    state dict runs no step; on 2 x 1 (same N) DCP reshards every replica's momentum to its
    owner; on 4 x 1 (another N) DCP and dk.load_state refuse the momentum's shape, and
    dk.load_state refuses another world size."""
    with tempfile.TemporaryDirectory() as directory:
        results = run_workers(4, _checkpoints, directory)
        resharded = run_workers(2, _resharded, directory)
    fresh = results[0]["fresh"]
    assert fresh[:3] == (True, True, {0}), fresh
    assert fresh[3] == {(2, *s) for s in SHAPES}, fresh
    for r, res in enumerate(results):
        assert res["replicas differ"], r
        assert res["dcp loaded"] == (True, True, [2]), (r, res["dcp loaded"])
        assert res["dcp resumed"] and res["dk loaded"] and res["dk resumed"], r
        kind, message = res["dcp 4x1"]
        assert kind == "CheckpointException" and "Size mismatch" in message, (r, message)
        assert "torch.Size([2, 33, 6])" in message and "torch.Size([4, 33, 6])" in message, r
        assert "has shape (2, 33, 6), this optimizer's is (4, 33, 6)" in res["dk 4x1"], \
            (r, res["dk 4x1"])
        assert res["4x1 unchanged"], r
    # replica i of the 2 x 2 run (ranks 2i, 2i+1) is rank i of the 2 x 1 run
    for i, (params, momenta, refused) in enumerate(resharded):
        assert "saved on 4 ranks with FSDP2 parameters" in refused, refused
        assert _same(params, results[0]["full params"]), i
        assert _same(momenta, [m[i] for m in results[0]["full momenta"]]), i


# ----------------------------------------------------------------------------- copies


def _copies(rank, n):
    """deepcopy and pickle of a sharded optimizer after 2 steps; each copy and the original
    then step on the same gradients."""
    import copy
    import pickle

    mesh = _mesh(2, 2)
    net = _fsdp(mesh)
    opt = dk.DistributedLion(_groups(net), mode="average", votes="ternary", device_mesh=mesh)
    _train(net, opt, range(2), rank)
    # deepcopy copies each parameter's .grad too; FSDP2's are views into one reduce-scatter
    # buffer, which torch's deepcopy fails on ("invalid python storage"): copy without them
    opt.zero_grad()
    copies = {"deepcopy": copy.deepcopy(opt), "pickle": pickle.loads(pickle.dumps(opt))}
    _backward(net, 2, rank)
    grads = [p.grad.detach().clone() for p in net.parameters()]
    opt.step()
    out = {}
    for how, c in copies.items():
        params = [p for g in c.param_groups for p in g["params"]]
        for q, g in zip(params, grads):
            q.grad = g.clone()
        c.step()
        out[how] = dict(
            options=(c.mode, c.votes, c.sharded, c.device_mesh.mesh.tolist(),
                     [(g["lr"], g["betas"]) for g in c.param_groups]),
            params=_same(_locals(net), [sharded.own_shard(q).detach() for q in params]),
            momenta=_same(_momenta(opt, net),
                          [sharded.momentum_local(c.state[q]["exp_avg"]) for q in params]),
            steps={c.state[q]["step"] for q in params})
    return out


def test_copies():
    """copy.deepcopy and pickle of a DistributedLion over FSDP2 parameters keep its options,
    mesh and every momentum, and the copy's next step equals the original's, bit for bit."""
    for r, res in enumerate(run_workers(4, _copies)):
        for how in ("deepcopy", "pickle"):
            got = res[how]
            assert got["options"] == ("average", "ternary", True, [[0, 1], [2, 3]],
                                      [(g["lr"], g["betas"]) for g in GROUPS]), (r, how, got)
            assert got["params"] and got["momenta"] and got["steps"] == {3}, (r, how, got)


# ----------------------------------------------------------------------------- bad input


def _errors(make):
    try:
        make()
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _bad_input(rank, n):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = _mesh(2, 2)
    net = _fsdp(mesh)
    params = list(net.parameters())
    plain = list(Net().parameters())
    DL = dk.DistributedLion
    out = {
        "mixed": _errors(lambda: DL(params + plain[:1], device_mesh=mesh)),
        "plain with mesh": _errors(lambda: DL(plain, device_mesh=mesh)),
        "not a mesh": _errors(lambda: DL(params, device_mesh="replicate")),
        # dims named the other way round: along its shard dim this rank is with another rank
        "other mesh": _errors(lambda: DL(params, device_mesh=_mesh_named(("shard",
                                                                          "replicate")))),
        "3-D mesh": _errors(lambda: DL(params, device_mesh=_mesh3())),
        "1-D mesh of the world": _errors(lambda: DL(params, device_mesh=_mesh(None, 4))),
        "hierarchy": _errors(lambda: DL(params, device_mesh=mesh, hierarchy=2)),
        "hierarchy auto": _errors(lambda: DL(params, device_mesh=mesh, hierarchy="auto")),
        "group and mesh": _errors(lambda: DL(params, device_mesh=mesh,
                                             group=mesh["replicate"].get_group())),
        "no replicate group": _errors(lambda: DL(params)),
        "world as replicate group": _errors(lambda: DL(params, group=dist.group.WORLD)),
        "replicate placement": _errors(lambda: DL([nn.Parameter(distribute_tensor(
            torch.zeros(4), mesh["shard"], [Replicate()]))], device_mesh=mesh)),
    }
    hsdp = MLP()
    fully_shard(hsdp, mesh=mesh)  # HSDP: FSDP all-reduces the replicas' gradients itself
    out["hsdp"] = _errors(lambda: DL(hsdp.parameters(), device_mesh=mesh))
    ddp = torch.nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
    out["ddp hook"] = _errors(lambda: dk.register_ddp_comm_hook(ddp, DL(params,
                                                                         device_mesh=mesh)))
    # After construction: nothing changes when a param group or a state dict does not fit
    opt = DL(_groups(net), device_mesh=mesh)
    _train(net, opt, range(1), rank)
    kept = (_momenta(opt, net), len(opt.param_groups))
    out["add plain group"] = _errors(lambda: opt.add_param_group({"params": plain[:1]}))
    state = opt.state_dict()
    bad = {**state, "state": {i: {**v, "exp_avg": sharded.own_shard(v["exp_avg"]).clone()}
                              for i, v in state["state"].items()}}
    out["plain momentum"] = _errors(lambda: opt.load_state_dict(bad))
    plain_opt = DL(plain)
    out["dtensor momentum"] = _errors(lambda: plain_opt.load_state_dict(state))
    out["unchanged"] = _same(kept[0], _momenta(opt, net)) and kept[1] == len(opt.param_groups)
    return out


def _mesh_named(names):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=names)


def _mesh3():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("a", "replicate", "shard"))


EXPECTED_ERRORS = {
    "mixed": "ValueError: params mixes DTensor parameters",
    "plain with mesh": "ValueError: device_mesh is for FSDP2's DTensor parameters",
    "not a mesh": "TypeError: device_mesh must be a torch.distributed.device_mesh.DeviceMesh",
    "other mesh": "does not match the parameters' mesh",
    "3-D mesh": "device_mesh must be 1-D (shard) or 2-D (replicate, shard)",
    "1-D mesh of the world": "does not match the parameters' mesh",
    "hierarchy": "hierarchy=2 does not apply to FSDP2 parameters",
    "hierarchy auto": "hierarchy='auto' does not apply to FSDP2 parameters",
    "group and mesh": "either as device_mesh= or as group=, not both",
    "no replicate group": "pass device_mesh= (the 2-D mesh",
    "world as replicate group": "group= must be the replicate group",
    "replicate placement": "allowed: Shard(d) from fully_shard",
    "hsdp": "on a 2-D mesh",
    "ddp hook": "FSDP2",
    "add plain group": "params mixes DTensor parameters",
    "plain momentum": "keeps each momentum as a DTensor of global shape",
    "dtensor momentum": "is a DTensor, saved by a DistributedLion over FSDP2 parameters",
}


def test_bad_input():
    """Clear errors naming what is allowed, before anything is modified."""
    for r, res in enumerate(run_workers(4, _bad_input)):
        for key, expected in EXPECTED_ERRORS.items():
            assert expected in res[key], (r, key, res[key])
        assert res["unchanged"], r


# ----------------------------------------------------------------------------- failures


FAULT_STEP, PG_TIMEOUT, MARGIN = 2, 5.0, 20.0


def _fault_worker(rank, n, group, steps, overlap=False):
    """2 x 2, overlap on or off; DistributedLion(timeout=PG_TIMEOUT) from FAULT_STEP on (the ranks
    line up on the default group before each step up to it). Survivors report what they saw
    (faults.py)."""
    from faults import attempt

    mesh = _mesh(2, 2)
    net = _fsdp(mesh)
    opt = dk.DistributedLion(_groups(net), device_mesh=mesh, overlap=overlap, bucket_mb=1e-6)
    completed = []
    for t in range(steps):
        if t <= FAULT_STEP:
            dist.barrier()
        if t == FAULT_STEP:
            opt.timeout = PG_TIMEOUT
        opt.zero_grad()
        _backward(net, t, rank)
        before = (_locals(net), _momenta(opt, net))
        seen = attempt([("step", opt.step)])
        if seen is not None:
            return dict(seen, before=before, now=(_locals(net), _momenta(opt, net)),
                        completed=completed)
        completed.append([p.full_tensor() for p in net.parameters()])
    return dict(error=None, completed=completed)


CASES = [
    # (victim, action, point, steps the survivors fail at, collectives they may name)
    # rank 3 (replica 1, shard 1) dies before its vote exchange: rank 1 fails in the exchange,
    # ranks 0 and 2 in the agreement over the whole mesh (rank 3 never joins it).
    (3, "kill", "before:all_to_all_single(votes)", {FAULT_STEP},
     {"all_to_all_single(votes)", "all_gather(aggregate)", sharded.HEADERS}),
    # rank 3 stalls before the agreement, the step's last collective: it runs over the whole
    # mesh, so no rank completes it and no rank applies the step (with it inside the shard
    # group, ranks 0 and 1 used to apply step t while ranks 2 and 3 did not).
    (3, "stop", "before:" + sharded.HEADERS, {FAULT_STEP}, {sharded.HEADERS}),
]


@pytest.mark.parametrize("victim,action,point,steps,names", CASES,
                         ids=["kill-exchange", "stop-header-gather"])
def test_dead_or_stalled_rank(victim, action, point, steps, names):
    """Failures on a 2 x 2 mesh: every survivor raises DistributedStepError naming the step and
    the collective within the timeout (plus a margin), with its shards and momenta as before."""
    from faults import Fault, check_survivors, run_with_fault

    fault = Fault(rank=victim, step=FAULT_STEP, point=point, action=action)
    results = run_with_fault(4, _fault_worker, fault, FAULT_STEP + 3, pg_timeout=PG_TIMEOUT,
                             deadline=300.0)
    check_survivors(results, fault, 4, steps=steps, names=names,
                    limit=2 * PG_TIMEOUT + MARGIN, where={"step"})
