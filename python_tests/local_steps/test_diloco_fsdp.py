"""dk.DiLoCo over an FSDP2-sharded model (local steps composed with FSDP2) on real gloo processes:
2 replicas x 2 shards (4 processes) and the 1-D mesh (2 processes, N = 1). Pseudo-gradients are
taken on the local shards and voted (or all-reduced) between the replicas of each shard.

Between syncs nothing is sent and nothing changes; at each sync the replicas of every shard are
bit-identical and equal the outer step computed here from their pseudo-gradients (test_diloco's
references, on the local shards); bytes between replicas within the wire's bound for N voters
on the local elements, plus the few bytes of the agreement inside the shard group; fragments and
overlap_steps on their schedule and merge rule; a non-finite pseudo-gradient on one shard is
skipped or raised on every rank of the mesh; exact resume inside an overlap window; bad input.
"""

import io

import pytest
import torch
import torch.distributed as dist
from test_diloco import _Recorder, _unchanged, check_outer_step, spec_bound
from torch import nn
from workers import run_workers

import dlion_kernels as dk
from dlion_kernels.exchange import sharded
from dlion_kernels.local_steps import fragments as frag
from dlion_kernels.local_steps.diloco import DiLoCo

# odd sizes: FSDP's shards are uneven or empty ((33, 6): 17 and 16 rows; (1,): one and none)
SHAPES = [(33, 6), (7,), (5, 4), (1,)]
LR, WD, BETAS = 5e-2, 0.1, (0.9, 0.99)


class Block(nn.Module):
    def __init__(self, shapes, gen):
        super().__init__()
        self.ws = nn.ParameterList([nn.Parameter(torch.randn(s, generator=gen)) for s in shapes])

    def forward(self, xs):
        return sum((torch.tanh(w) * x).sum() for w, x in zip(self.ws, xs))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(1)  # the same initial weights on every rank
        self.blocks = nn.ModuleList([Block(SHAPES[:2], gen), Block(SHAPES[2:], gen)])

    def forward(self, xs):
        return self.blocks[0](xs[:2]) + self.blocks[1](xs[2:])


def _mesh(N, L):
    from torch.distributed.device_mesh import init_device_mesh

    if N == 1:
        return init_device_mesh("cpu", (L,), mesh_dim_names=("shard",))
    return init_device_mesh("cpu", (N, L), mesh_dim_names=("replicate", "shard"))


def _fsdp(mesh):
    from torch.distributed.fsdp import fully_shard

    shard = mesh["shard"] if mesh.ndim == 2 else mesh
    net = Net()
    for b in net.blocks:
        fully_shard(b, mesh=shard)
    fully_shard(net, mesh=shard)
    return net


def _inner_step(net, inner, rank, t):
    gen = torch.Generator().manual_seed(1000 * t + rank)  # each rank its own data
    inner.zero_grad()
    net([torch.randn(s, generator=gen) for s in SHAPES]).backward()
    inner.step()


def _snap(net, diloco):
    return ([sharded.own_shard(p).detach().clone() for p in net.parameters()],
            [t.clone() for t in diloco.theta_bar], [m.clone() for m in diloco.outer_momenta])


class _ByGroup(_Recorder):
    """test_diloco's recorder, by group: the collectives called inside, in order, as (name,
    "replicate" | "shard"), and the bytes this rank hands to them per group (all_to_all: (k-1)/k
    of its input, all_gather: its input to each of k-1 peers, all_reduce: a ring's 2 (k-1)/k of
    it; k the group's size)."""

    def __init__(self, replicate):
        self.replicate, self.calls, self.sent = replicate, [], {"replicate": 0, "shard": 0}

    def _wrap(self, name, fn):
        def call(*args, group=None, **kwargs):
            short = "all_gather" if name.startswith("all_gather") else name
            where = "replicate" if group is self.replicate else "shard"
            k = dist.get_world_size(group)
            x = args[1] if short in ("all_gather", "all_to_all_single") else args[0]
            nbytes = x.numel() * x.element_size()
            self.calls.append((short, where))
            self.sent[where] += (nbytes * (k - 1) // k if short == "all_to_all_single" else
                                 nbytes * (k - 1) if short == "all_gather" else
                                 round(2 * (k - 1) / k * nbytes))
            return fn(*args, group=group, **kwargs)

        return call


# ----------------------------------------------------------------------------- syncs

CASES = [  # (outer, mode, votes, sync_every, fragments, overlap_steps)
    ("dlion", "vote", "binary", 2, 1, 0),
    ("dlion", "average", "ternary", 4, 2, 1),
    ("nesterov", "vote", "binary", 2, 1, 0),
    ("nesterov", "vote", "binary", 4, 2, 1),
]
STEPS = 9
ALPHA = 0.5


def _sync_worker(rank, n, N):
    L = n // N
    mesh = _mesh(N, L)
    out = {}
    for outer, mode, votes, h, p, tau in CASES:
        net = _fsdp(mesh)
        inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
        diloco = DiLoCo(net, inner, sync_every=h, outer=outer, outer_lr=LR, outer_betas=BETAS,
                        outer_weight_decay=WD if outer == "dlion" else 0.0, mode=mode,
                        votes=votes, fragments=p, overlap_steps=tau, merge_alpha=ALPHA,
                        device_mesh=mesh,
                        # the reference is the plain step's math: every option off
                        outer_options={} if outer == "dlion" else None)
        index = {id(q): i for i, q in enumerate(net.parameters())}
        records = []
        for t in range(1, STEPS + 1):
            _inner_step(net, inner, rank, t)
            before = _snap(net, diloco)
            with _ByGroup(diloco.group) as rec:
                stats = diloco.step()
            records.append(dict(before=before, after=_snap(net, diloco), stats=stats,
                                calls=rec.calls, sent=dict(rec.sent)))
        out[outer, mode, votes, h, p, tau] = dict(
            records=records, fragments=[[index[id(q)] for q in f] for f in diloco.fragment_params],
            local=[sharded.own_shard(q).numel() for q in net.parameters()])
    return out


@pytest.mark.parametrize("N,L", [(2, 2), (1, 2)], ids=["2x2", "1-D"])
def test_syncs_on_local_shards(N, L):
    """Each replicate group (the N ranks holding one shard) against the reference outer step on
    its local shards; the fragments cut by the global sizes; bytes per group."""
    n = N * L
    results = run_workers(n, _sync_worker, N)
    cuts_expected = [list(c) for c in frag.split([_numel(s) for s in SHAPES], 2)]
    for case in results[0]:
        outer, mode, votes, h, p, tau = case
        for j in range(L):  # the replicate group of shard position j: ranks j, L + j, ...
            runs = [results[i * L + j][case] for i in range(N)]
            numels = runs[0]["local"]
            cuts = cuts_expected if p == 2 else [list(range(len(SHAPES)))]
            assert all(run["fragments"] == cuts for run in runs)
            pending = None  # (start, fragment) of an exchange in flight
            for t in range(1, STEPS + 1):
                recs = [run["records"][t - 1] for run in runs]
                starting = [f for f in range(p) if t % h == (f + 1) * h // p % h]
                due = None
                if tau == 0 and starting:
                    due = (t, starting[0])
                elif pending is not None and t == pending[0] + tau:
                    due, pending = pending, None
                if due is None:
                    for rec in recs:  # nothing changes; only a starting exchange is issued
                        assert rec["stats"] is None
                        first = "all_to_all_single" if outer == "dlion" else "all_reduce"
                        assert rec["calls"] == ([(first, "replicate")] if starting and N > 1
                                                else []), (case, t, rec["calls"])
                        _unchanged(rec, range(len(SHAPES)))
                    if starting:
                        pending = (t, starting[0])
                    continue
                start, f = due
                idx = cuts[f]
                check_outer_step(runs, t, idx, start, outer, mode, votes, N)
                d = sum(numels[i] for i in idx)
                for run, rec in zip(runs, recs):
                    _unchanged(rec, [i for i in range(len(SHAPES)) if i not in idx])
                    params, theta, _ = rec["after"]
                    for i in idx:
                        if tau == 0:
                            assert torch.equal(params[i], theta[i])
                        else:  # the documented merge, on this rank's values at t
                            assert torch.equal(params[i],
                                               torch.lerp(theta[i], rec["before"][0][i], ALPHA))
                    s = rec["stats"]
                    assert (s.step, s.applied_step, s.fragment, s.numel, s.world_size, s.shards,
                            s.skipped) == (start, t, f, d, N, L, False), (case, t)
                    inter, intra = rec["sent"]["replicate"], rec["sent"]["shard"]
                    if outer == "dlion":
                        if tau:  # the all_to_all went at the start: the whole exchange's bytes
                            inter += run["records"][start - 1]["sent"]["replicate"]
                        assert s.inter_node_bytes_sent == inter, (case, t)
                        assert s.inter_node_bytes_sent <= spec_bound(N, mode, votes, d, len(idx))
                        # the agreement over the whole mesh: [flag, step] to the n - 1 others
                        assert s.intra_node_bytes_sent == intra == (N * L - 1) * 2 * 4
                    else:
                        # 2 step words per replica ride in the all-reduce; the flag's
                        # all-reduce over the whole mesh carries every rank's row of steps
                        assert s.inter_node_bytes_sent == \
                            round(2 * (N - 1) / N * 4 * (d + 2 * N if N > 1 else 0))
                        n = N * L
                        assert s.intra_node_bytes_sent == intra == \
                            (0 if L == 1 else round(2 * (n - 1) / n * 4 * (1 + n * N)))
                    assert s.bytes_sent == s.bytes_received == \
                        s.inter_node_bytes_sent + s.intra_node_bytes_sent


def _numel(shape):
    k = 1
    for s in shape:
        k *= s
    return k


# ----------------------------------------------------------------------------- non-finite


def _nonfinite_worker(rank, n):
    mesh = _mesh(2, 2)
    out = {}
    for outer in ("dlion", "nesterov"):
        for policy in ("raise", "skip"):
            net = _fsdp(mesh)
            inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
            diloco = DiLoCo(net, inner, sync_every=2, outer=outer, outer_lr=LR,
                            nonfinite=policy, device_mesh=mesh)
            res = dict(error=None)
            for t in range(1, 7):
                _inner_step(net, inner, rank, t)
                if t == 4 and rank == 1:  # replica 0's second shard diverged in this window
                    with torch.no_grad():
                        sharded.own_shard(next(net.parameters()))[0, 0] = float("nan")
                before = _snap(net, diloco)
                try:
                    stats = diloco.step()
                except dk.NonFiniteGradientError as e:
                    res.update(error=str(e), at=t, unchanged=_equal(before, _snap(net, diloco)),
                               inner_step=diloco.inner_step)
                    break
                if t == 4:
                    res.update(skipped=stats.skipped, theta_kept=_equal(
                        before[1:], _snap(net, diloco)[1:]), reset=all(torch.equal(
                            x, y) for x, y in zip(_snap(net, diloco)[0], diloco.theta_bar)))
                if t == 6:
                    res.update(later=stats.skipped, finite=all(
                        bool(torch.isfinite(x).all()) for x in diloco.theta_bar))
            out[outer, policy] = res
    return out


def _equal(a, b):
    """The same bits (NaN included) in two snapshots (lists of lists of fp32 tensors)."""
    return all(torch.equal(x.view(torch.int32), y.view(torch.int32))
               for u, v in zip(a, b, strict=True) for x, y in zip(u, v, strict=True))


def test_nonfinite_on_one_shard_is_decided_on_every_rank():
    """A NaN in one rank's shard reaches the votes of its replicate group only; the shard group's
    agreement makes all four ranks skip (or raise) together, with nothing modified."""
    results = run_workers(4, _nonfinite_worker)
    for rank, res in enumerate(results):
        for outer in ("dlion", "nesterov"):
            raised = res[outer, "raise"]
            assert raised["error"] is not None and raised["at"] == 4, (rank, outer)
            assert "inner step 4" in raised["error"]
            assert raised["unchanged"] and raised["inner_step"] == 3, (rank, outer)
            skipped = res[outer, "skip"]
            assert skipped["error"] is None, (rank, outer)
            assert skipped["skipped"] and skipped["theta_kept"] and skipped["reset"], (rank, outer)
            assert not skipped["later"] and skipped["finite"], (rank, outer)


# ----------------------------------------------------------------------------- resume


def _resume_worker(rank, n, outer):
    mesh = _mesh(2, 2)
    kw = dict(sync_every=4, outer=outer, outer_lr=LR, fragments=2, overlap_steps=1,
              device_mesh=mesh)

    def build():
        net = _fsdp(mesh)
        inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
        return net, inner, DiLoCo(net, inner, **kw)

    net, inner, diloco = build()
    for t in range(1, 11):
        _inner_step(net, inner, rank, t)
        diloco.step()
    straight = _snap(net, diloco)

    net, inner, diloco = build()
    for t in range(1, 7):  # step 6 starts fragment 0's sync, applied at 7: saved in flight
        _inner_step(net, inner, rank, t)
        diloco.step()
    buffer = io.BytesIO()
    torch.save(dict(model=net.state_dict(), inner=inner.state_dict(),
                    diloco=diloco.state_dict()), buffer)
    in_flight = diloco.state_dict()["in_flight"] is not None
    for t in range(7, 9):  # this object goes on and is then overwritten by the load
        _inner_step(net, inner, rank, t)
        diloco.step()
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    net2, inner2, diloco2 = build()
    net2.load_state_dict(saved["model"])
    inner2.load_state_dict(saved["inner"])
    diloco2.load_state_dict(saved["diloco"])
    for t in range(7, 11):
        _inner_step(net2, inner2, rank, t)
        diloco2.step()
    return dict(same=_equal(straight, _snap(net2, diloco2)), in_flight=in_flight)


@pytest.mark.parametrize("outer", ["dlion", "nesterov"])
def test_exact_resume_inside_an_overlap_window(outer):
    for res in run_workers(4, _resume_worker, outer):
        assert res["in_flight"] and res["same"]


# ----------------------------------------------------------------------------- bad input


def _bad_input_worker(rank, n):
    mesh = _mesh(2, 2)
    errors = {}

    def attempt(key, fn):
        try:
            fn()
        except (ValueError, TypeError) as e:
            errors[key] = str(e)

    plain = Net()
    attempt("plain model", lambda: DiLoCo(plain, torch.optim.AdamW(plain.parameters()), 2,
                                          device_mesh=mesh))
    net = _fsdp(mesh)
    inner = torch.optim.AdamW(net.parameters())
    attempt("both", lambda: DiLoCo(net, inner, 2, device_mesh=mesh,
                                   group=mesh["replicate"].get_group()))
    # one rank of each shard group asks for another sync_every: refused on every rank
    attempt("config", lambda: DiLoCo(net, inner, 2 if rank % 2 == 0 else 4, device_mesh=mesh))
    # replica 1 starts from other weights: refused in the replicate group
    other = _fsdp(mesh)
    if rank >= 2:
        with torch.no_grad():
            sharded.own_shard(next(other.parameters())).add_(1.0)
    attempt("weights", lambda: DiLoCo(other, torch.optim.AdamW(other.parameters()), 2,
                                      device_mesh=mesh))
    # the replicate group as group= works like the mesh; a checkpoint of a 1-D mesh is refused
    ok = DiLoCo(net, inner, 2, group=mesh["replicate"].get_group())
    state = ok.state_dict()
    state["shards"] = 1
    attempt("state", lambda: ok.load_state_dict(state))
    return errors, ok.world_size


def test_bad_input():
    for rank, (errors, world) in enumerate(run_workers(4, _bad_input_worker)):
        assert world == 2
        assert "plain tensors" in errors["plain model"]
        assert "not both" in errors["both"]
        assert "ranks [1, 3] sync_every=4; rank 0 sync_every=2" in errors["config"]
        assert "nothing was built on any rank" in errors["config"]
        # each replicate group compares its own shard; every rank hears of both
        assert "local shards" in errors["weights"] and "[2, 3]" not in errors["weights"]
        assert "ranks [2] differ from rank 0's" in errors["weights"], errors["weights"]
        assert "ranks [3] differ from rank 1's" in errors["weights"], errors["weights"]
        assert "sharded over 1" in errors["state"]
