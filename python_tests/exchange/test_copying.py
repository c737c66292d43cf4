"""exchange/copying.py: what survives copy.deepcopy, pickle and torch.save: public attributes (the
options) travel, private ones (runtime state) do not, nor a public one that shadows the class;
process groups stay the same object in a deepcopy and become None (the default group) or a
DetachedGroup (any other) in a pickle, which attached_group refuses with a clear error."""

import copy
import io
import pickle

import pytest
import torch
import torch.distributed as dist
from workers import run_workers

import dlion_kernels as dk
from dlion_kernels.exchange.copying import (
    Copyable,
    DetachedGroup,
    attached_group,
    export_state,
    import_state,
)


class _Opt(Copyable, torch.optim.SGD):
    """An optimizer with options (public), runtime state (private) and a group."""

    def __init__(self, params, group=None):
        super().__init__(params, lr=0.1, momentum=0.9)
        self.mode, self.bucket_mb, self.group = "vote", 2.5, group
        self._hooks = ["runtime"]


def _pickled(obj):
    return pickle.loads(pickle.dumps(obj))


def _torch_saved(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


COPIES = {"deepcopy": copy.deepcopy, "pickle": _pickled, "torch.save": _torch_saved}


def _stepped_opt():
    p = torch.nn.Parameter(torch.ones(3))
    opt = _Opt([p])
    p.grad = torch.full((3,), 0.5)
    opt.step()
    return opt


@pytest.mark.parametrize("how", list(COPIES))
def test_options_travel_runtime_state_does_not(how):
    opt = _stepped_opt()
    twin = COPIES[how](opt)
    assert (twin.mode, twin.bucket_mb, twin.group) == ("vote", 2.5, None)
    assert "_hooks" not in vars(twin)  # the class rebuilds its runtime state lazily
    (p,), (q,) = opt.param_groups[0]["params"], twin.param_groups[0]["params"]
    assert torch.equal(twin.state[q]["momentum_buffer"], opt.state[p]["momentum_buffer"])
    assert twin.param_groups[0]["lr"] == 0.1
    q.grad = torch.full((3,), 0.5)
    twin.step()  # the copy steps on its own parameters
    assert not torch.equal(p, q)


@pytest.mark.parametrize("how", list(COPIES))
def test_a_public_attribute_shadowing_the_class_stays_behind(how):
    """An LR scheduler or Accelerate wraps ``opt.step`` with a function bound to the original:
    the copy keeps its own method."""
    opt = _stepped_opt()
    opt.step = lambda closure=None: "the original's wrapper"
    twin = COPIES[how](opt)
    assert "step" not in vars(twin)
    assert twin.step.__func__ is _Opt.step and twin.step.__self__ is twin


def test_detached_group():
    detached = DetachedGroup("ranks [0, 2]")
    assert repr(detached) == "DetachedGroup(ranks [0, 2])"
    assert dk.DetachedGroup is DetachedGroup


def test_attached_group_passes_groups_through():
    marker = object()
    assert attached_group(None, object()) is None
    assert attached_group(marker, object()) is marker


def test_attached_group_refuses_a_detached_group():
    opt = _stepped_opt()
    with pytest.raises(RuntimeError) as info:
        attached_group(DetachedGroup("ranks [1, 3]"), opt)
    message = str(info.value)
    assert message.startswith("this _Opt was restored by pickle/torch.load with an explicit "
                              "process group (ranks [1, 3]); process groups cannot be pickled.")
    assert "`opt.group = my_group`" in message


def test_state_without_groups_is_unchanged():
    state = {"mode": "vote", "n": 3, "nested": {"group": None}}
    exported = export_state(state)
    assert exported == state and exported is not state
    assert import_state(_pickled(exported)) == state


def _groups_worker(rank, n):
    sub = dist.new_group([1, 0])
    state = {"group": sub, "world": dist.group.WORLD, "lr": 0.5, "none": None}
    exported = export_state(state)
    assert not any(isinstance(v, dist.ProcessGroup) for v in exported.values())
    deep = import_state(copy.deepcopy(exported))
    assert deep["group"] is sub and deep["world"] is dist.group.WORLD  # same ranks, same objects
    pickled = import_state(_pickled(exported))
    opt = _Opt([torch.nn.Parameter(torch.ones(2))], group=sub)
    saved = _torch_saved(opt)
    opt.group = dist.group.WORLD
    return dict(pickled={k: repr(v) for k, v in pickled.items()},
                saved=repr(saved.group), world=_torch_saved(opt).group,
                deep=copy.deepcopy(opt).group is dist.group.WORLD)


def test_process_groups_in_copies():
    for out in run_workers(2, _groups_worker):
        assert out["pickled"] == {"group": "DetachedGroup(ranks [0, 1])", "world": "None",
                                  "lr": "0.5", "none": "None"}
        assert out["saved"] == "DetachedGroup(ranks [0, 1])"
        assert out["world"] is None and out["deep"]
