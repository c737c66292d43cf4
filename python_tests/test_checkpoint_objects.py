"""dk.save_state / dk.load_state on every object the library makes, on real gloo processes: flat
DistributedLion (on the whole job, and one on each pair of ranks), hierarchy=2, FSDP2 with
device_mesh= and with group= (the replicate group), the DDP comm hook's optimizer, DiLoCo plain
and on FSDP2, DecentralizedDataParallel.

One 4-rank launch runs every object in turn, each in its own directory: two saves (the second
replaces the first), then the state is changed by more training, then loaded back; every rank's
state must equal, bit for bit, what it held at the second save, and the directory must hold one
file per rank of the job plus the manifest. The same launch checks the refusals (a group without
every rank holding the state; a checkpoint of a 2 x 2 mesh on 1 x 4, 4 x 1 and a 2 x 2 mesh of
another rank layout), and a 2-rank launch loads the 4-rank checkpoints on another world size.
"""

import json
import os
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
from workers import run_workers

import dlion_kernels as dk
from dlion_kernels.exchange import sharded

HERE = os.path.dirname(os.path.abspath(__file__))
for _sub in ("optim", "local_steps"):  # the FSDP2 and DiLoCo tests' models and meshes, by import
    if os.path.join(HERE, _sub) not in sys.path:
        sys.path.insert(0, os.path.join(HERE, _sub))

import test_checkpoint as flat  # noqa: E402
import test_diloco as loco  # noqa: E402
import test_diloco_fsdp as loco_fsdp  # noqa: E402
import test_fsdp as fsdp  # noqa: E402

N_RANKS = 4
OBJECTS = ["flat", "flat-pairs", "hierarchy", "fsdp-mesh", "fsdp-group", "ddp-hook", "diloco",
           "diloco-fsdp", "decentralized"]


# ----------------------------------------------------------------------------- state, bit for bit


def _state(obj) -> dict:
    if hasattr(obj, "optimizer_state_dict"):
        obj.synchronize()
        return obj.optimizer_state_dict()
    return obj.state_dict()


def _leaves(x, path=""):
    """(path, value) of a state structure; tensors as copies of their bytes (a DTensor: its
    global shape and this rank's local piece)."""
    if isinstance(x, dict):
        for k in sorted(x, key=str):
            yield from _leaves(x[k], f"{path}/{k}")
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from _leaves(v, f"{path}/{i}")
    elif isinstance(x, torch.Tensor):
        shape = tuple(x.shape)
        t = sharded.own_shard(x).detach()
        yield path, (str(t.dtype), shape, tuple(t.shape),
                     t.reshape(-1).contiguous().view(torch.uint8).clone())
    else:
        yield path, x


def _snapshot(obj) -> list:
    return list(_leaves(_state(obj)))


def _same_bits(a: list, b: list) -> bool:
    if [p for p, _ in a] != [p for p, _ in b]:
        return False
    for (_, x), (_, y) in zip(a, b):
        if isinstance(x, tuple) and x and isinstance(x[-1], torch.Tensor):
            if not (isinstance(y, tuple) and x[:3] == y[:3] and torch.equal(x[3], y[3])):
                return False
        elif x != y:
            return False
    return True


def _has_tensors(snap: list) -> bool:
    return any(isinstance(v, tuple) and v and isinstance(v[-1], torch.Tensor) and v[-1].numel()
               for _, v in snap)


# ----------------------------------------------------------------------------- the objects


def _make(name, rank):
    """(object, train(k): k more steps, its mesh or None)."""
    if name in ("flat", "flat-pairs", "hierarchy"):
        params = flat._model()
        opt = (flat._opt(params) if name == "flat" else flat._hier_opt(params)
               if name == "hierarchy" else flat._opt(params, _pairs()))  # two optimizers
        count = [0]

        def train(k):
            flat._train(opt, params, rank, k, count[0])
            count[0] += k
        return opt, train, None
    if name in ("fsdp-mesh", "fsdp-group"):
        mesh = fsdp._mesh(2, 2)
        net = fsdp._fsdp(mesh)
        opt = (dk.DistributedLion(fsdp._groups(net), device_mesh=mesh) if name == "fsdp-mesh"
               else dk.DistributedLion(fsdp._groups(net),
                                       group=mesh["replicate"].get_group()))
        count = [0]

        def train(k):
            fsdp._train(net, opt, range(count[0], count[0] + k), rank)
            count[0] += k
        return opt, train, mesh
    if name == "ddp-hook":
        from torch.nn.parallel import DistributedDataParallel as DDP

        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(),
                                        torch.nn.Linear(5, 3)))
        opt = dk.DistributedLion(model.parameters(), lr=1e-2, weight_decay=0.1)
        dk.register_ddp_comm_hook(model, opt)
        count = [0]

        def train(k):
            for t in range(count[0], count[0] + k):
                gen = torch.Generator().manual_seed(1000 * rank + t)
                opt.zero_grad()
                model(torch.randn(4, 7, generator=gen)).square().mean().backward()
                opt.step()
            count[0] += k
        return opt, train, None
    if name in ("diloco", "diloco-fsdp"):
        mesh = loco_fsdp._mesh(2, 2) if name == "diloco-fsdp" else None
        model = loco._model() if mesh is None else loco_fsdp._fsdp(mesh)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        diloco = dk.DiLoCo(model, inner, sync_every=2, device_mesh=mesh)
        step = loco._inner_step if mesh is None else loco_fsdp._inner_step
        count = [0]

        def train(k):
            for t in range(count[0], count[0] + k):
                step(model, inner, rank, t)
                diloco.step()
            count[0] += k
        return diloco, train, mesh
    assert name == "decentralized"
    ddp = flat._ring(rank)
    count = [0]

    def train(k):
        for t in range(count[0], count[0] + k):
            gen = torch.Generator().manual_seed(100 * rank + t)
            ddp(torch.randn(4, 7, generator=gen)).square().mean().backward()
        ddp.synchronize()
        count[0] += k
    return ddp, train, None


def _listing(directory):
    if not os.path.isdir(directory):
        return None
    out = {}
    for f in sorted(os.listdir(directory)):
        with open(os.path.join(directory, f), "rb") as fh:
            out[f] = fh.read()
    return out


def _refused(fn) -> str | None:
    try:
        fn()
    except dk.CheckpointError as e:
        return str(e)
    return None


def _save_perturb_load(obj, directory, train, steps: int, group=None) -> dict:
    """Save ``obj`` into ``directory`` (``group=`` as save_state takes it), train ``steps``
    more steps, load it back: the files the save left, what the load returned, whether the
    training changed the state, whether the load restored it bit for bit, and whether there was
    tensor state to lose."""
    dk.save_state(obj, directory, group=group)
    saved = _snapshot(obj)
    files = sorted(os.listdir(directory))  # every rank has returned from the save: final
    dist.barrier(group=group)
    train(steps)
    changed = not _same_bits(saved, _snapshot(obj))
    returned = dk.load_state(obj, directory, group=group)
    return dict(files=files, returned=returned, changed=changed,
                restored=_same_bits(saved, _snapshot(obj)), tensors=_has_tensors(saved))


def _round_trip(name, rank, root):
    obj, train, mesh = _make(name, rank)
    directory = os.path.join(root, name)
    train(2)
    dk.save_state(obj, directory)  # a first save, replaced by the next one
    train(2)
    out = _save_perturb_load(obj, directory, train, 2)
    manifest = json.loads(open(os.path.join(directory, "manifest.json")).read())
    out.update(manifest=manifest, returned=out["returned"] == manifest)
    if name == "diloco":
        out["momenta"] = [m.clone() for m in obj.outer_momenta]
        out["theta_bar"] = [t.clone() for t in obj.theta_bar]
        out["inner_step"] = obj.inner_step
    # A group without every rank holding the state: refused on every rank, nothing written
    # (a fresh directory is not even made; the checkpoint above is not touched)
    if name == "flat-pairs":
        # its state lives on its pair: the pair alone may save it, into a directory of its own
        mine = os.path.join(root, f"{name}-pair{rank // 2}")
        pair = _save_perturb_load(obj, mine, train, 1, group=obj.group)
        out["pair"] = dict(files=pair["files"], restored=pair["restored"])
        return out, obj
    before = _listing(directory)
    groups = {"subgroup": _pairs()}
    if mesh is not None:
        groups["replicate"] = mesh["replicate"].get_group()
    if name == "fsdp-group":
        groups["replicate"] = obj.group
    out["refused"] = {}
    for what, group in groups.items():
        fresh = os.path.join(root, f"{name}-{what}")
        here = _snapshot(obj)
        out["refused"][what] = dict(
            save_fresh=_refused(lambda: dk.save_state(obj, fresh, group=group)),
            save_over=_refused(lambda: dk.save_state(obj, directory, group=group)),
            load=_refused(lambda: dk.load_state(obj, directory, group=group)),
            nothing_written=_listing(fresh) is None,
            untouched=_listing(directory) == before,
            unchanged=_same_bits(here, _snapshot(obj)))
        dist.barrier()
    return out, obj


_PAIRS = {}


def _pairs():
    """This rank's pair {0, 1} or {2, 3}: every rank makes both, in the same order."""
    if "pairs" not in _PAIRS:
        _PAIRS["pairs"] = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return _PAIRS["pairs"][dist.get_rank() // 2]


def _other_meshes(rank, root):
    """The 2 x 2 checkpoints on the same 4 ranks, other meshes: 1 x 4, 4 x 1, and 2 x 2 with the
    ranks placed otherwise (replica i holds ranks i and i + 2). Each refused, nothing changed."""
    from torch.distributed.device_mesh import DeviceMesh

    meshes = {"1x4": lambda: fsdp._mesh(None, 4), "4x1": lambda: fsdp._mesh(4, 1),
              "2x2 transposed": lambda: DeviceMesh("cpu", torch.tensor([[0, 2], [1, 3]]),
                                                   mesh_dim_names=("replicate", "shard"))}
    out = {}
    for label, make in meshes.items():
        mesh = make()
        net = fsdp._fsdp(mesh)
        opt = dk.DistributedLion(fsdp._groups(net), device_mesh=mesh)
        before = _snapshot(opt)
        out[("fsdp-mesh", label)] = (
            _refused(lambda: dk.load_state(opt, os.path.join(root, "fsdp-mesh"))),
            _same_bits(before, _snapshot(opt)))
        model = loco_fsdp._fsdp(mesh)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        diloco = dk.DiLoCo(model, inner, sync_every=2, device_mesh=mesh)
        before = _snapshot(diloco)
        out[("diloco-fsdp", label)] = (
            _refused(lambda: dk.load_state(diloco, os.path.join(root, "diloco-fsdp"))),
            _same_bits(before, _snapshot(diloco)))
    # plain parameters into a checkpoint of sharded ones, and the other way round
    params = flat._model()
    opt = flat._opt(params)
    out[("flat", "from fsdp-mesh")] = (
        _refused(lambda: dk.load_state(opt, os.path.join(root, "fsdp-mesh"))), True)
    mesh = fsdp._mesh(2, 2)
    net = fsdp._fsdp(mesh)
    shaped = dk.DistributedLion(fsdp._groups(net), device_mesh=mesh)
    out[("fsdp-mesh", "from flat")] = (
        _refused(lambda: dk.load_state(shaped, os.path.join(root, "flat"))), True)
    return out


def _objects_worker(rank, n, root):
    results = {}
    for name in OBJECTS:
        results[name], _ = _round_trip(name, rank, root)
    results["other meshes"] = _other_meshes(rank, root)
    return results


def _resized_worker(rank, n, root):
    """The 4-rank checkpoints on 2 ranks: DiLoCo takes the mean of the old outer momenta; the
    FSDP2 ones (any 2-rank mesh) are refused and nothing changes."""
    out = {}
    model = loco._model()
    diloco = dk.DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-2), sync_every=2)
    dk.load_state(diloco, os.path.join(root, "diloco"))
    out["diloco"] = ([m.clone() for m in diloco.outer_momenta],
                     [t.clone() for t in diloco.theta_bar], diloco.inner_step)
    for label, (N, L) in {"2x1": (2, 1), "1x2": (None, 2)}.items():
        mesh = fsdp._mesh(N, L)
        net = fsdp._fsdp(mesh)
        opt = dk.DistributedLion(fsdp._groups(net), device_mesh=mesh)
        before = _snapshot(opt)
        out[("fsdp-mesh", label)] = (
            _refused(lambda: dk.load_state(opt, os.path.join(root, "fsdp-mesh"))),
            _same_bits(before, _snapshot(opt)))
        mesh = loco_fsdp._mesh(N or 1, L)
        model = loco_fsdp._fsdp(mesh)
        diloco = dk.DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                           sync_every=2, device_mesh=mesh)
        before = _snapshot(diloco)
        out[("diloco-fsdp", label)] = (
            _refused(lambda: dk.load_state(diloco, os.path.join(root, "diloco-fsdp"))),
            _same_bits(before, _snapshot(diloco)))
    return out


@pytest.fixture(scope="module")
def saved():
    with tempfile.TemporaryDirectory() as root:
        yield root, run_workers(N_RANKS, _objects_worker, root)


# ----------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("name", OBJECTS)
def test_round_trip_restores_every_rank_bit_for_bit(saved, name):
    root, results = saved
    for rank, res in enumerate(results):
        got = res[name]
        assert got["tensors"], (name, rank)  # there is state to lose
        assert got["changed"], (name, rank)  # training after the save changed it
        assert got["restored"], (name, rank)  # and the load gave back exactly the saved state
        assert got["returned"], (name, rank)
        # one file per rank of the job, each named by the manifest, and the manifest
        manifest = got["manifest"]
        assert len(got["files"]) == N_RANKS + 1 and "manifest.json" in got["files"], got["files"]
        assert sorted(r["file"] for r in manifest["files"]) == \
            sorted(f for f in got["files"] if f != "manifest.json")
        assert [r["file"].split(".")[0] for r in manifest["files"]] == \
            [f"rank{i:05d}-of-{N_RANKS:05d}" for i in range(N_RANKS)]
        assert manifest["world_size"] == manifest["job_world_size"] == N_RANKS
        assert manifest["ranks"] == list(range(N_RANKS))
    manifest = results[0][name]["manifest"]
    sharded_state = name in ("fsdp-mesh", "fsdp-group", "diloco-fsdp")
    assert manifest["mesh"] == (dict(replicas=2, shards=2, ranks=[[0, 1], [2, 3]])
                                if sharded_state else None), manifest["mesh"]
    assert manifest["hierarchy"] == (2 if name == "hierarchy" else None)
    kinds = {"diloco": "DiLoCo", "diloco-fsdp": "DiLoCo",
             "decentralized": "DecentralizedDataParallel"}
    assert manifest["kind"].endswith("." + kinds.get(name, "DistributedLion")), manifest["kind"]


@pytest.mark.parametrize("name", OBJECTS)
def test_a_group_without_every_state_holder_is_refused_before_writing(saved, name):
    """group= a pair of ranks ({0, 1} or {2, 3}), and on a mesh its replicate group: save and
    load raise CheckpointError on every rank; nothing is written, the checkpoint already in the
    directory is untouched and the object unchanged. An optimizer whose state lives on a pair
    (flat-pairs) saves and loads with group= its pair, each pair into its own directory."""
    _, results = saved
    if name == "flat-pairs":  # on a pair, the pair is a complete group: saved and restored
        for rank, res in enumerate(results):
            got = res[name]["pair"]
            assert got["restored"] and len(got["files"]) == 3, (rank, got)
            assert [f.split(".")[0] for f in got["files"] if f != "manifest.json"] == \
                ["rank00000-of-00002", "rank00001-of-00002"], got["files"]
        return
    for rank, res in enumerate(results):
        refused = res[name]["refused"]
        expected = {"subgroup", "replicate"} if name in ("fsdp-mesh", "fsdp-group",
                                                         "diloco-fsdp") else {"subgroup"}
        assert set(refused) == expected
        for what, got in refused.items():
            for call in ("save_fresh", "save_over", "load"):
                message = got[call]
                assert message is not None, (name, rank, what, call)
                assert "would be left out of the checkpoint" in message, message
                assert "Pass group=None (the whole job)" in message, message
            assert "nothing written" in got["save_fresh"], got["save_fresh"]
            assert got["nothing_written"] and got["untouched"] and got["unchanged"], \
                (name, rank, what, got)


def test_another_mesh_of_the_same_ranks_is_refused(saved):
    """A 2 x 2 checkpoint of sharded state loads on that mesh only: on 1 x 4, 4 x 1 and a 2 x 2
    mesh with the ranks placed otherwise, every rank raises CheckpointError naming both meshes
    and nothing changes; plain and sharded parameters do not load into each other."""
    _, results = saved
    for rank, res in enumerate(results):
        other = res["other meshes"]
        for (name, label), (message, unchanged) in other.items():
            assert message is not None and unchanged, (rank, name, label, message)
            if label.startswith("from"):
                assert "plain (unsharded) parameters" in message and "FSDP2 mesh" in message, \
                    message
                continue
            assert "2 replicas x 2 shards (ranks [[0, 1], [2, 3]])" in message, message
            assert "loads on the same mesh only" in message, message
        transposed = other[("fsdp-mesh", "2x2 transposed")][0]
        assert "ranks [[0, 2], [1, 3]]" in transposed, transposed
        # the momentum's shape tells of another number of replicas too
        assert "this optimizer's is (4, 33, 6)" in other[("fsdp-mesh", "4x1")][0]


def test_another_world_size(saved):
    """On 2 ranks: DiLoCo (plain) takes the mean of the 4 old outer momenta, theta_bar and the
    step as saved (the same on every old rank); FSDP2-sharded state is refused on any mesh of
    2 ranks, nothing changed."""
    root, results = saved
    resized = run_workers(2, _resized_worker, root)
    old = [res["diloco"] for res in results]
    mean = [sum(r["momenta"][i].double() for r in old) / len(old)
            for i in range(len(old[0]["momenta"]))]
    for rank, res in enumerate(resized):
        momenta, theta_bar, step = res["diloco"]
        assert step == old[0]["inner_step"]
        assert all(torch.equal(a, b) for a, b in zip(theta_bar, old[0]["theta_bar"]))
        assert all(torch.equal(a, m.float()) for a, m in zip(momenta, mean))
        for key in (("fsdp-mesh", "2x1"), ("fsdp-mesh", "1x2"), ("diloco-fsdp", "2x1"),
                    ("diloco-fsdp", "1x2")):
            message, unchanged = res[key]
            assert message is not None and unchanged, (rank, key, message)
            assert "saved on 4 ranks with FSDP2 parameters" in message, message
