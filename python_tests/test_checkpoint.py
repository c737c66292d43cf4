"""dk.save_state / dk.load_state: per-rank files plus a manifest, exact resume on the
same world size, the mean-momentum rule on another, clear errors before any change, and saves
that a crash cannot turn into a checkpoint that loads wrong."""

import copy
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile

import fuzzing as fz
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from workers import run_workers

import dlion_kernels as dk
from dlion_kernels import checkpoint

SHAPES = [(5, 3), (31,), (2, 2, 2)]


def _model():
    torch.manual_seed(0)
    return [torch.randn(s, requires_grad=True) for s in SHAPES]


def _opt(params, group=None):
    return dk.DistributedLion([{"params": params[:2]}, {"params": params[2:], "lr": 3e-2}],
                              lr=1e-2, weight_decay=0.1, group=group)


def _train(opt, params, rank, steps, start):
    for k in range(start, start + steps):
        gen = torch.Generator().manual_seed(1000 * rank + k)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


def _momenta(opt, params):
    return [opt.state[p]["exp_avg"].clone() for p in params]


def _state_equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


# ----------------------------------------------------------------------------- same world size


def _resume_worker(rank, n, directory):
    params = _model()
    opt = _opt(params)
    _train(opt, params, rank, 3, 0)
    dk.save_state(opt, directory)
    saved_params = [p.detach().clone() for p in params]
    saved_moms = _momenta(opt, params)
    _train(opt, params, rank, 4, 3)
    straight = [p.detach().clone() for p in params], _momenta(opt, params)

    # Resume: fresh parameters (the model weights are saved separately, here a copy), a fresh
    # optimizer, this rank's own state.
    params2 = [p.detach().clone().requires_grad_(True) for p in saved_params]
    opt2 = _opt(params2)
    manifest = dk.load_state(opt2, directory)
    loaded = _momenta(opt2, params2)
    _train(opt2, params2, rank, 4, 3)
    resumed = [p.detach().clone() for p in params2], _momenta(opt2, params2)
    return dict(straight=straight, resumed=resumed, saved_moms=saved_moms, loaded=loaded,
                world_size=manifest["world_size"],
                steps=[opt2.state[p]["step"] for p in params2])


@pytest.mark.parametrize("n", [2, 3])
def test_resume_same_world_size_is_bit_exact(tmp_path, n):
    results = run_workers(n, _resume_worker, str(tmp_path))
    for r, res in enumerate(results):
        assert res["world_size"] == n
        assert _state_equal(res["loaded"], res["saved_moms"])
        assert _state_equal(res["straight"][0], res["resumed"][0])
        assert _state_equal(res["straight"][1], res["resumed"][1])
        assert res["steps"] == [7, 7, 7]
    # Momenta differ between ranks: saving rank 0's alone would be wrong.
    assert not _state_equal(results[0]["saved_moms"], results[1]["saved_moms"])
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["world_size"] == n and len(manifest["files"]) == n
    assert manifest["param_shapes"] == [[[5, 3], [31]], [[2, 2, 2]]]
    assert manifest["library_version"] == dk.__version__ == checkpoint.__version__
    assert sorted(f for f in os.listdir(tmp_path) if f.endswith(".pt")) == sorted(
        r["file"] for r in manifest["files"])


# ----------------------------------------------------------------------------- resizing


def _save_worker(rank, n, directory, steps):
    params = _model()
    opt = _opt(params)
    _train(opt, params, rank, steps, 0)
    dk.save_state(opt, directory)
    return _momenta(opt, params), [p.detach().clone() for p in params]


def _load_worker(rank, n, directory, saved_params):
    params = [p.clone().requires_grad_(True) for p in saved_params]
    opt = _opt(params)
    dk.load_state(opt, directory)
    loaded = _momenta(opt, params)
    steps = [opt.state[p]["step"] for p in params]
    _train(opt, params, rank, 2, 50)
    return loaded, steps, [p.detach().clone() for p in params]


@pytest.mark.parametrize("n_old,n_new", [(2, 3), (3, 2)])
def test_resize_takes_the_mean_momentum(tmp_path, n_old, n_new):
    saved = run_workers(n_old, _save_worker, str(tmp_path), 3)
    loaded = run_workers(n_new, _load_worker, str(tmp_path), saved[0][1])
    mean = [(sum(s[0][i].double() for s in saved) / n_old).float() for i in range(len(SHAPES))]
    for moms, steps, final in loaded:
        assert _state_equal(moms, mean)  # every new rank: the mean, in float64, rounded once
        assert steps == [3, 3, 3]
        assert _state_equal(final, loaded[0][2])  # training goes on, ranks in sync


# ----------------------------------------------------------------------------- errors


def _single_save(directory, steps=2):
    params = _model()
    opt = _opt(params)
    _train(opt, params, 0, steps, 0)
    dk.save_state(opt, directory)
    return params, opt


def _fresh_state(opt):
    sd = opt.state_dict()
    return {k: {kk: vv.clone() if torch.is_tensor(vv) else vv for kk, vv in v.items()}
            for k, v in sd["state"].items()}, [dict(g) for g in sd["param_groups"]]


def _unchanged(opt, before):
    now = _fresh_state(opt)
    assert now[1] == before[1]
    assert now[0].keys() == before[0].keys()
    for k in now[0]:
        for kk in now[0][k]:
            a, b = now[0][k][kk], before[0][k][kk]
            assert torch.equal(a, b) if torch.is_tensor(a) else a == b


def _rank_file(directory, rank=0):
    manifest = json.loads((directory / "manifest.json").read_text())
    return directory / manifest["files"][rank]["file"]


def test_corrupted_file_is_named(tmp_path):
    _single_save(tmp_path)
    path = _rank_file(tmp_path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    params = _model()
    opt = _opt(params)
    _train(opt, params, 5, 1, 0)
    before = _fresh_state(opt)
    with pytest.raises(dk.CheckpointError, match=rf"{path.name}.*sha256.*corrupted"):
        dk.load_state(opt, tmp_path)
    _unchanged(opt, before)


def test_truncated_file_is_named(tmp_path):
    _single_save(tmp_path)
    path = _rank_file(tmp_path)
    path.write_bytes(path.read_bytes()[:100])
    opt = _opt(_model())
    with pytest.raises(dk.CheckpointError, match=rf"{path.name}: 100 bytes.*truncated"):
        dk.load_state(opt, tmp_path)
    assert not opt.state


@pytest.mark.parametrize("damage", ["missing", "garbage", "truncated", "other-format",
                                    "world-size"])
def test_bad_manifest_is_named(tmp_path, damage):
    _single_save(tmp_path)
    manifest = tmp_path / "manifest.json"
    text = manifest.read_text()
    if damage == "missing":
        manifest.unlink()
    elif damage == "garbage":
        manifest.write_bytes(b"\x00\xff" * 10)
    elif damage == "truncated":
        manifest.write_text(text[: len(text) // 2])
    elif damage == "other-format":
        manifest.write_text(json.dumps(dict(json.loads(text), format="something.else")))
    else:
        manifest.write_text(json.dumps(dict(json.loads(text), world_size=2)))
    opt = _opt(_model())
    with pytest.raises(dk.CheckpointError, match="manifest.json"):
        dk.load_state(opt, tmp_path)
    assert not opt.state


def test_missing_rank_file_is_named(tmp_path):
    _single_save(tmp_path)
    path = _rank_file(tmp_path)
    path.unlink()
    with pytest.raises(dk.CheckpointError, match=rf"{path.name}: missing"):
        dk.load_state(_opt(_model()), tmp_path)


def test_mismatched_model_or_optimizer(tmp_path):
    _single_save(tmp_path)
    torch.manual_seed(0)
    other = [torch.randn(s, requires_grad=True) for s in [(5, 3), (30,), (2, 2, 2)]]
    with pytest.raises(dk.CheckpointError, match=r"parameter shapes differ"):
        dk.load_state(_opt(other), tmp_path)
    one_group = dk.DistributedLion(_model(), lr=1e-2)
    with pytest.raises(dk.CheckpointError, match=r"parameter shapes differ"):
        dk.load_state(one_group, tmp_path)
    adamw = torch.optim.AdamW(_model())
    with pytest.raises(dk.CheckpointError, match=r"kind .*DistributedLion.*AdamW"):
        dk.load_state(adamw, tmp_path)
    assert not adamw.state
    with pytest.raises(TypeError, match="state_dict"):
        dk.load_state(object(), tmp_path)


def test_other_optimizers_and_wrappers(tmp_path):
    """Any optimizer, and objects with optimizer_state_dict/load_optimizer_state_dict (the
    DecentralizedDataParallel methods) round-trip exactly."""
    params = _model()
    adamw = torch.optim.AdamW(params, lr=1e-2)
    for p in params:
        p.grad = torch.randn(p.shape)
    adamw.step()
    dk.save_state(adamw, tmp_path / "adamw")
    other = torch.optim.AdamW([p.detach().clone().requires_grad_(True) for p in params])
    dk.load_state(other, tmp_path / "adamw")
    for p, q in zip(params, [p for g in other.param_groups for p in g["params"]]):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(adamw.state[p][key], other.state[q][key])

    class Wrapper:  # stands in for DecentralizedDataParallel
        topology = "ring"

        def __init__(self, opt):
            self.opt = opt

        def optimizer_state_dict(self):
            return {"buckets": [self.opt.state_dict()]}

        def load_optimizer_state_dict(self, sd):
            self.opt.load_state_dict(sd["buckets"][0])

    dk.save_state(Wrapper(adamw), tmp_path / "wrapped")
    assert json.loads((tmp_path / "wrapped" / "manifest.json").read_text())["topology"] == "ring"
    fresh = torch.optim.AdamW([p.detach().clone().requires_grad_(True) for p in params])
    dk.load_state(Wrapper(fresh), tmp_path / "wrapped")
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], adamw.state[params[0]]["exp_avg"])


# ----------------------------------------------------------------------------- agreement


def _corrupt_one_rank_worker(rank, n, directory):
    params = _model()
    opt = _opt(params)
    _train(opt, params, rank, 2, 0)
    dk.save_state(opt, directory)
    torch.distributed.barrier()
    if rank == 0:  # damage rank 1's file only
        manifest = json.load(open(os.path.join(directory, "manifest.json")))
        path = os.path.join(directory, manifest["files"][1]["file"])
        data = bytearray(open(path, "rb").read())
        data[-10] ^= 1
        open(path, "wb").write(bytes(data))
    torch.distributed.barrier()
    _train(opt, params, rank, 1, 2)  # state now differs from the checkpoint
    before = _fresh_state(opt)
    try:
        dk.load_state(opt, directory)
    except dk.CheckpointError as e:
        _unchanged(opt, before)
        return str(e)
    return None


def test_one_bad_file_stops_every_rank(tmp_path):
    """Rank 0's own file is intact, but rank 1's is not: no rank loads."""
    errors = run_workers(2, _corrupt_one_rank_worker, str(tmp_path))
    for e in errors:
        assert e is not None and "rank 1:" in e and "sha256" in e and "rank00001-of-00002" in e


def _failing_save_worker(rank, n, directory):
    params = _model()
    opt = _opt(params)
    _train(opt, params, rank, 2, 0)
    dk.save_state(opt, directory)
    good = _momenta(opt, params)
    _train(opt, params, rank, 1, 2)
    if rank == 1:  # this rank cannot write its file
        checkpoint._write_atomic = lambda path, data: (_ for _ in ()).throw(OSError("disk full"))
    try:
        dk.save_state(opt, directory)
        raised = None
    except dk.CheckpointError as e:
        raised = str(e)
    opt2 = _opt([p.detach().clone().requires_grad_(True) for p in params])
    dk.load_state(opt2, directory)  # the previous checkpoint, intact
    return raised, _state_equal(good, _momenta(opt2, [p for g in opt2.param_groups
                                                      for p in g["params"]]))


def test_failed_save_keeps_the_previous_checkpoint(tmp_path):
    results = run_workers(2, _failing_save_worker, str(tmp_path))
    for raised, previous_ok in results:
        assert raised is not None and "disk full" in raised and "rank 1" in raised
        assert previous_ok
    names = sorted(os.listdir(tmp_path))
    assert len([f for f in names if f.endswith(".pt")]) == 2, names  # no orphans left
    assert not [f for f in names if ".tmp-" in f], names


CRASH_SCRIPT = r"""
import os, signal, sys, torch
import dlion_kernels as dk
from dlion_kernels import checkpoint
torch.manual_seed(0)
params = [torch.randn(5, 3, requires_grad=True), torch.randn(31, requires_grad=True)]
opt = dk.DistributedLion(params, lr=1e-2)
def train(k):
    for p in params:
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(k))
    opt.step()
train(0)
dk.save_state(opt, sys.argv[1])
torch.save([opt.state[p]["exp_avg"] for p in params], sys.argv[2])
train(1)
where = sys.argv[3]
real = checkpoint._write_atomic
def crashing(path, data):
    if where == "rank-file" or path.endswith("manifest.json"):
        real(path + ".partial", data[: len(data) // 2])  # a half-written file is left behind
        os.kill(os.getpid(), signal.SIGKILL)
    real(path, data)
checkpoint._write_atomic = crashing
dk.save_state(opt, sys.argv[1])
"""


@pytest.mark.parametrize("where", ["rank-file", "manifest"])
def test_crash_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path, where):
    ckpt, expected = tmp_path / "ckpt", tmp_path / "expected.pt"
    proc = subprocess.run([sys.executable, "-c", CRASH_SCRIPT, str(ckpt), str(expected), where],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    torch.manual_seed(0)
    params = [torch.randn(5, 3, requires_grad=True), torch.randn(31, requires_grad=True)]
    opt = dk.DistributedLion(params, lr=1e-2)
    dk.load_state(opt, ckpt)
    assert _state_equal([opt.state[p]["exp_avg"] for p in params], torch.load(expected))


def _save_with_dead_peer(rank, n, group, directory):
    from dlion_kernels.exchange.collectives import DistributedStepError

    params = _model()
    opt = _opt(params, group)
    _train(opt, params, rank, 2, 0)
    dk.save_state(opt, directory, group=group)  # a complete checkpoint first
    _train(opt, params, rank, 1, 2)
    try:
        dk.save_state(opt, directory, group=group)  # rank 1 dies inside this one
    except DistributedStepError as e:
        return str(e)
    return None


@pytest.mark.parametrize("point", ["before:all_gather_object(file records)",
                                   "before:broadcast_object_list(status)"])
def test_dead_peer_in_save_is_named_and_keeps_the_previous_checkpoint(tmp_path, point):
    """A rank killed inside save_state: the others raise DistributedStepError naming the save and
    the collective within the group's timeout, and the previous checkpoint still loads."""
    from faults import Fault, run_with_fault

    directory = str(tmp_path / "ckpt")
    fault = Fault(rank=1, step=directory, point=point, occurrence=2)  # in the second save
    results = run_with_fault(3, _save_with_dead_peer, fault, directory, pg_timeout=5.0,
                             deadline=120.0)
    name = point.partition(":")[2]
    for r in (0, 2):
        assert results[r] is not None and f"checkpoint save of {directory}: collective {name}" \
            in results[r], (r, results[r])
    with open(os.path.join(directory, checkpoint.MANIFEST)) as f:
        manifest = json.load(f)
    assert manifest["world_size"] == 3
    for record in manifest["files"]:  # the first save, or the second if rank 0 got that far
        assert os.path.exists(os.path.join(directory, record["file"]))
    params = _model()
    dk.load_state(_opt(params), directory)  # loads (here as one process: the mean momentum)


# ----------------------------------------------------------------------------- what must match


def _hier_opt(params):
    return dk.DistributedLion([{"params": params[:2]}, {"params": params[2:], "lr": 3e-2}],
                              lr=1e-2, weight_decay=0.1, hierarchy=2)


def _hier_save_worker(rank, n, directory):
    """Save a 2 x 2 hierarchical optimizer; a fresh one on the same 4 ranks loads its shard back,
    a flat one is refused."""
    params = _model()
    opt = _hier_opt(params)
    _train(opt, params, rank, 3, 0)
    dk.save_state(opt, directory)
    saved = _fresh_state(opt)
    fresh = _hier_opt([p.detach().clone().requires_grad_(True) for p in params])
    dk.load_state(fresh, directory)
    _unchanged(fresh, saved)
    flat = _opt(params)
    _train(flat, params, rank, 1, 0)
    before = _fresh_state(flat)
    try:
        dk.load_state(flat, directory)
        refused = None
    except dk.CheckpointError as e:
        refused = str(e)
    _unchanged(flat, before)
    return refused, saved[0][0]["exp_avg_range"]


def _hier_load_worker(rank, n, directory):
    params = _model()
    opt = _hier_opt(params)
    _train(opt, params, rank, 1, 0)
    before = _fresh_state(opt)
    try:
        dk.load_state(opt, directory)
        refused = None
    except dk.CheckpointError as e:
        refused = str(e)
    _unchanged(opt, before)
    return refused


def test_hierarchical_checkpoint_loads_on_its_world_size_only(tmp_path):
    """A 2 x 2 hierarchical checkpoint (each rank holds its shard of its node's momentum) loads
    on 4 ranks with hierarchy 2 only; on 2 or 8 ranks every rank raises the guard's message and
    changes nothing."""
    saved = run_workers(4, _hier_save_worker, str(tmp_path))
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["hierarchy"] == 2 and manifest["world_size"] == 4
    assert len({tuple(rng) for _, rng in saved}) == 2  # two shards per node: the state differs
    for refused, _ in saved:
        assert "saved with hierarchy 2, loading into hierarchy None" in refused
    for n in (2, 8):
        for refused in run_workers(n, _hier_load_worker, str(tmp_path)):
            assert refused is not None and (
                f"manifest.json: saved with hierarchy 2 on 4 ranks (sharded momentum); it loads "
                f"on 4 ranks only, not {n}") in refused, refused
            assert "exp_avg_range" not in refused


def _ring(rank):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    return dk.DecentralizedDataParallel(model, lambda ps: dk.AccumAdamW(ps, lr=1e-2),
                                        topology="ring", bucket_mb=0.0001)


def _ring_save_worker(rank, n, directory):
    ddp = _ring(rank)
    for it in range(3):
        gen = torch.Generator().manual_seed(100 * rank + it)
        ddp(torch.randn(4, 7, generator=gen)).square().mean().backward()
    ddp.synchronize()
    dk.save_state(ddp, directory)
    return ddp.optimizer_state_dict()


def _ring_load_worker(rank, n, directory):
    ddp = _ring(rank)
    given = []
    load = ddp.load_optimizer_state_dict
    ddp.load_optimizer_state_dict = lambda sd: (given.append(sd), load(sd))
    dk.load_state(ddp, directory)
    return given[0]


def test_decentralized_checkpoint_records_the_topology_name_and_resizes(tmp_path):
    """The manifest keeps the topology's name (not its world size), so a ring checkpoint of 2
    ranks loads on 4 ranks with the mean momentum, like any other resize."""
    saved = run_workers(2, _ring_save_worker, str(tmp_path))
    assert json.loads((tmp_path / "manifest.json").read_text())["topology"] == "ring"
    loaded = run_workers(4, _ring_load_worker, str(tmp_path))
    buckets = saved[0]["buckets"]
    assert buckets and all(b["optimizer"]["state"] for b in buckets)
    for got in loaded:
        assert got["iteration"] == 3
        for b, bucket in enumerate(buckets):
            assert got["buckets"][b]["names"] == bucket["names"]
            for pid, state in bucket["optimizer"]["state"].items():
                mean = sum(s["buckets"][b]["optimizer"]["state"][pid]["exp_avg"].double()
                           for s in saved) / 2
                assert torch.equal(got["buckets"][b]["optimizer"]["state"][pid]["exp_avg"],
                                   mean.float())


# ----------------------------------------------------------------------------- load_state


def _small_opt():
    torch.manual_seed(0)
    params = [torch.randn(4, 3, requires_grad=True), torch.randn(9, requires_grad=True)]
    opt = dk.DistributedLion(params, lr=1e-2)
    for k in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(k))
        opt.step()
    return params, opt


@functools.lru_cache(maxsize=None)
def _saved():
    """One saved checkpoint (its files' bytes), made once for every example."""
    params, opt = _small_opt()
    with tempfile.TemporaryDirectory() as tmp:
        dk.save_state(opt, tmp)
        files = {name: open(os.path.join(tmp, name), "rb").read() for name in os.listdir(tmp)}
    return params, opt, files


@fz.FUZZ
@given(st.data())
def test_fuzz_load_state(data):
    """Damaged checkpoints: random byte flips, truncation, appended bytes, manifest fields set to
    random JSON values. load_state loads exactly what was saved or raises CheckpointError
    (a ValueError) with the optimizer unchanged."""
    params, opt, files = _saved()
    with tempfile.TemporaryDirectory() as tmp:
        for name, raw in files.items():
            open(os.path.join(tmp, name), "wb").write(raw)
        manifest_path = os.path.join(tmp, "manifest.json")
        manifest = json.load(open(manifest_path))
        target = data.draw(st.sampled_from(["rank-file", "manifest-bytes", "manifest-field"]))
        path = manifest_path if target != "rank-file" else os.path.join(
            tmp, manifest["files"][0]["file"])
        if target == "manifest-field":
            key = data.draw(st.sampled_from(sorted(manifest)))
            value = data.draw(st.recursive(
                st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=5),
                lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3),
                                                                            inner, max_size=3),
                max_leaves=5))
            manifest[key] = value
            open(path, "w").write(json.dumps(manifest))
        else:
            raw = bytearray(open(path, "rb").read())
            how = data.draw(st.sampled_from(["flip", "truncate", "append"]))
            pos = data.draw(st.integers(0, len(raw) - 1))
            if how == "flip":
                raw[pos] ^= 1 << data.draw(st.integers(0, 7))
            elif how == "truncate":
                raw = raw[:pos]
            else:
                raw += b"\x00"
            open(path, "wb").write(bytes(raw))

        fresh_params = [p.detach().clone().requires_grad_(True) for p in params]
        fresh = dk.DistributedLion(fresh_params, lr=0.5)
        before = copy.deepcopy(fresh.state_dict())
        try:
            dk.load_state(fresh, tmp)
        except ValueError as e:
            assert isinstance(e, dk.CheckpointError)
            after = fresh.state_dict()
            assert after["param_groups"] == before["param_groups"] and not after["state"]
            return
    # Loaded: exactly what was saved.
    for p, q in zip(params, fresh_params):
        fz.same(fresh.state[q]["exp_avg"], opt.state[p]["exp_avg"])
        assert fresh.state[q]["step"] == opt.state[p]["step"]
    assert fresh.param_groups[0]["lr"] == 1e-2
