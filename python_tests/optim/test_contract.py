"""The torch.optim.Optimizer contract that frameworks rely on, over every optimizer class of the
library, adapting only construction (extend ``OPTIMIZERS``); then DistributedLion's own options:
copies with every option, process groups in copies, the cross-rank step check.

What torch's own generic optimizer tests check (test/test_optim.py, not shipped in the wheel)
is mirrored here: state_dict round trip into a fresh optimizer, load_state_dict leaving its
argument untouched, param groups added later, step hooks, closures, zero_grad(set_to_none=False),
named parameters, LR schedulers (ReduceLROnPlateau too), deepcopy / pickle / torch.save.
"""

import copy
import io
import pickle

import pytest
import torch
import torch.distributed as dist
from workers import run_workers

import dlion_kernels as dk
from dlion_kernels.exchange.copying import Copyable, attached_group

# name -> factory(params, lr) ; others append theirs (AccumAdamW, AccumLion, ...).
OPTIMIZERS = {
    "DistributedLion": lambda params, lr=1e-2: dk.DistributedLion(params, lr=lr,
                                                                  weight_decay=0.1),
    "DistributedLion-overlap": lambda params, lr=1e-2: dk.DistributedLion(
        params, lr=lr, weight_decay=0.1, overlap=True, bucket_mb=0.001),
    "AccumAdamW": lambda params, lr=1e-2: dk.AccumAdamW(params, lr=lr, accum_steps=2),
    "AccumLion": lambda params, lr=1e-2: dk.AccumLion(params, lr=lr, weight_decay=0.1,
                                                      accum_steps=2),
}
NAMES = list(OPTIMIZERS)


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(13, 31), torch.nn.Tanh(), torch.nn.Linear(31, 3))


def _loss(model, step, rank=0):
    gen = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(8, 13, generator=gen), torch.randint(0, 3, (8,), generator=gen)
    return torch.nn.functional.cross_entropy(model(x), y)


def _train(model, opt, steps, start=0, rank=0):
    for step in range(start, start + steps):
        opt.zero_grad()
        _loss(model, step, rank).backward()
        opt.step()


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _tensors(obj):
    """Every tensor inside a nested state dict, in a stable order, as clones."""
    if isinstance(obj, torch.Tensor):
        return [obj.clone()]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in _tensors(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


# ----------------------------------------------------------------------------- generic contract


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_into_fresh_optimizer_resumes_exactly(name):
    model = _model()
    opt = OPTIMIZERS[name](model.parameters())
    _train(model, opt, 3)
    saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
    _train(model, opt, 3, start=3)

    twin = _model(seed=9)
    twin.load_state_dict(saved[0])
    fresh = OPTIMIZERS[name](twin.parameters())
    fresh.load_state_dict(saved[1])
    _train(twin, fresh, 3, start=3)
    assert _same(_params(model), _params(twin))


@pytest.mark.parametrize("name", NAMES)
def test_load_state_dict_does_not_mutate_its_argument(name):
    model = _model()
    opt = OPTIMIZERS[name](model.parameters())
    _train(model, opt, 2)
    sd = opt.state_dict()
    before_tensors, before_repr = _tensors(sd), repr({k: v for k, v in sd.items() if k != "state"})
    ids_before = {k: id(v) for k, v in sd["state"].items()}
    other = _model(seed=3)
    fresh = OPTIMIZERS[name](other.parameters())
    fresh.load_state_dict(sd)
    _train(other, fresh, 2, start=2)  # stepping the loaded optimizer must not write into sd
    assert _same(_tensors(sd), before_tensors)
    assert repr({k: v for k, v in sd.items() if k != "state"}) == before_repr
    assert {k: id(v) for k, v in sd["state"].items()} == ids_before


@pytest.mark.parametrize("name", NAMES)
def test_add_param_group_after_construction(name):
    model = _model()
    opt = OPTIMIZERS[name](model[0].parameters())
    _train(model, opt, 2)
    late = list(model[2].parameters())
    assert all(p not in opt.state for p in late)
    opt.add_param_group({"params": late, "lr": 5e-3})
    assert all(p not in opt.state or not opt.state[p] for p in late)  # state comes lazily
    before = _params(model)
    _train(model, opt, 1, start=2)
    assert all(opt.state[p] for p in late)
    assert not torch.equal(before[2], model[2].weight)

    groups = len(opt.param_groups)
    extra = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="lr"):
        opt.add_param_group({"params": [extra], "lr": -1.0})
    with pytest.raises(ValueError, match="more than one"):
        opt.add_param_group({"params": late})
    assert len(opt.param_groups) == groups


@pytest.mark.parametrize("name", NAMES)
def test_step_hooks_and_closure(name):
    model = _model()
    opt = OPTIMIZERS[name](model.parameters())
    calls = []
    pre = opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(("pre", o)))
    post = opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("post", o)))

    def closure():
        calls.append(("closure", None))
        opt.zero_grad()
        loss = _loss(model, 0)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert torch.is_tensor(loss) and loss.ndim == 0
    assert calls == [("pre", opt), ("closure", None), ("post", opt)]
    pre.remove()
    post.remove()
    _train(model, opt, 1)
    assert len(calls) == 3


@pytest.mark.parametrize("name", NAMES)
def test_zero_grad_keeps_zero_tensors_when_asked(name):
    model = _model()
    opt = OPTIMIZERS[name](model.parameters())
    _loss(model, 0).backward()
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    opt.step()  # zero gradients are a valid step
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("name", NAMES)
def test_named_parameters_in_state_dict(name):
    model = _model()
    opt = OPTIMIZERS[name](model.named_parameters())
    _train(model, opt, 2)
    sd = opt.state_dict()
    assert sd["param_groups"][0]["param_names"] == [n for n, _ in model.named_parameters()]
    twin = copy.deepcopy(model)
    fresh = OPTIMIZERS[name](twin.named_parameters())
    fresh.load_state_dict(copy.deepcopy(sd))
    _train(model, opt, 2, start=2)
    _train(twin, fresh, 2, start=2)
    assert _same(_params(model), _params(twin))


@pytest.mark.parametrize("name", NAMES)
def test_lr_schedulers(name):
    model = _model()
    opt = OPTIMIZERS[name](model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=2),
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4),
    ], milestones=[2])
    lrs = []
    for step in range(5):
        _train(model, opt, 1, start=step)
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs[0] == pytest.approx(0.75e-2) and lrs[1] == pytest.approx(1e-2)
    assert lrs[2] < lrs[1]

    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=1)
    lr0 = opt.param_groups[0]["lr"]
    for step in range(4):
        _train(model, opt, 1, start=step)
        plateau.step(1.0)  # a metric that never improves
    assert opt.param_groups[0]["lr"] == pytest.approx(lr0 / 2)

    cycle = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=4)  # cycles betas
    _train(model, opt, 1)
    cycle.step()
    assert opt.param_groups[0]["betas"][0] < 0.95


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copies_of_model_and_optimizer_step_identically(name, how):
    model = _model()
    opt = OPTIMIZERS[name](model.parameters())
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # it wraps opt.step on the instance
    _train(model, opt, 2)
    twin, twin_opt = _copy((model, opt), how)
    _train(model, opt, 3, start=2)
    _train(twin, twin_opt, 3, start=2)
    assert _same(_params(model), _params(twin))


def _copy(obj, how):
    if how == "deepcopy":
        return copy.deepcopy(obj)
    if how == "pickle":
        return pickle.loads(pickle.dumps(obj))
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


# ----------------------------------------------------------------------------- DistributedLion

OPTIONS = [
    dict(mode="vote", votes="binary", backend="torch", nonfinite="raise"),
    dict(mode="average", votes="ternary", backend="cpu", nonfinite="skip"),
    dict(mode="vote", votes="ternary", backend=None, nonfinite="skip", group=None),
]


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(map(str, o.values())))
def test_copies_keep_every_option(options, how):
    if options["backend"] == "cpu" and "cpu" not in dk.available_backends("cpu"):
        pytest.skip("the native CPU backend is not built")
    model = _model()
    opt = dk.DistributedLion(model.parameters(), lr=1e-2, **options)
    _train(model, opt, 2)
    twin, twin_opt = _copy((model, opt), how)
    for key in ("mode", "votes", "backend", "nonfinite", "group"):
        assert getattr(twin_opt, key) == getattr(opt, key), key
    assert twin_opt.last_stats == opt.last_stats
    assert twin_opt.defaults == opt.defaults
    _train(model, opt, 2, start=2)
    _train(twin, twin_opt, 2, start=2)
    assert _same(_params(model), _params(twin))
    assert twin_opt.last_stats == opt.last_stats


def test_implementation_flags():
    params = _model().parameters
    for flag in ("foreach", "fused", "capturable"):
        for value in (None, True, False):
            dk.DistributedLion(params(), **{flag: value})
    dk.DistributedLion(params(), differentiable=False)
    with pytest.raises(ValueError, match="differentiable"):
        dk.DistributedLion(params(), differentiable=True)
    with pytest.raises(ValueError, match="foreach"):
        dk.DistributedLion(params(), foreach="yes")
    with pytest.raises(ValueError, match="capturable"):
        dk.DistributedLion(params(), capturable="yes")
    opt = dk.DistributedLion(_model().parameters())
    with pytest.raises(ValueError, match="differentiable"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))],
                             "differentiable": True})
    assert len(opt.param_groups) == 1


class _Wrapper(Copyable, torch.nn.Module):
    """A module wrapper (as DecentralizedDataParallel) holding a group and an option."""

    def __init__(self, group):
        super().__init__()
        self.inner = torch.nn.Linear(2, 2)
        self.group, self.topology = group, "ring"


def _distributed_worker(rank, n):
    out = {}
    sub = dist.new_group(list(range(n)))  # an explicit group that is not the default one
    wrapper = _Wrapper(sub)
    assert copy.deepcopy(wrapper).group is sub
    restored = _copy(wrapper, "pickle")
    assert restored.topology == "ring" and isinstance(restored.group, dk.DetachedGroup)
    assert torch.equal(restored.inner.weight, wrapper.inner.weight)
    with pytest.raises(RuntimeError, match="_Wrapper .*ranks \\[0, 1\\]"):
        attached_group(restored.group, restored)
    assert _copy(_Wrapper(dist.group.WORLD), "pickle").group is None
    for label, group in (("default", None), ("subgroup", sub)):
        model = _model()
        opt = dk.DistributedLion(model.parameters(), lr=1e-2, group=group, backend="torch")
        _train(model, opt, 2, rank=rank)
        deep_model, deep_opt = copy.deepcopy((model, opt))
        assert deep_opt.group is opt.group  # a copy in this process talks to the same ranks
        pickled_model, pickled_opt = _copy((model, opt), "torch.save")
        if group is None:
            assert pickled_opt.group is None
        else:
            assert isinstance(pickled_opt.group, dk.DetachedGroup)
            before = _params(pickled_model)
            with pytest.raises(RuntimeError, match="opt.group = "):
                _train(pickled_model, pickled_opt, 1, start=2, rank=rank)
            assert _same(before, _params(pickled_model))
            pickled_opt.group = sub  # re-attached
        for m, o in ((model, opt), (deep_model, deep_opt), (pickled_model, pickled_opt)):
            _train(m, o, 2, start=2, rank=rank)
        out[label] = [_params(m) for m in (model, deep_model, pickled_model)]

    # Ranks on different steps: every rank raises and names both steps; nothing changes.
    model = _model()
    opt = dk.DistributedLion(model.parameters(), lr=1e-2, backend="torch")
    _train(model, opt, 2, rank=rank)
    if rank == 1:  # a rank on another step (load_state_dict refuses such a state on every rank)
        for s in opt.state.values():
            s["step"] = 7
    before = _params(model), [s["exp_avg"].clone() for s in opt.state.values()]
    with pytest.raises(dk.StepMismatchError) as err:
        _train(model, opt, 1, start=2, rank=rank)
    out["mismatch"] = str(err.value)
    out["unchanged"] = _same(before[0], _params(model)) and _same(
        before[1], [s["exp_avg"] for s in opt.state.values()])
    return out


def test_distributed_copies_groups_and_step_check():
    ranks = run_workers(2, _distributed_worker)
    for out in ranks:
        for label in ("default", "subgroup"):
            original, deep, pickled = out[label]
            assert _same(original, deep) and _same(original, pickled), label
            assert _same(original, ranks[0][label][0]), f"ranks differ ({label})"
        assert "step 2" in out["mismatch"] and "step 7" in out["mismatch"]
        assert out["unchanged"]
