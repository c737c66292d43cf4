"""Steps captured in a CUDA graph (one rank, nonfinite="skip"): the step counter lives on the
device, the header's step word and the tie rule read it there, and each step advances it there
unless the step is skipped, so every replay is the next step. On the CPU: the counter, the
header and the bookkeeping around a capture (the capture itself faked); on a GPU: real captures
replayed against uncaptured steps, bit for bit."""

import copy

import pytest
import torch

import dlion_kernels as dk
from dlion_kernels.exchange import pipeline
from dlion_kernels.exchange.header import make_header
from dlion_kernels.kernels import backends
from dlion_kernels.optim import paths

SIZES = [1, 31, 33, 4097]


def _tensors(dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=gen).to(dtype).to(device) for n in SIZES]
    grads = [torch.randn(n, generator=gen).to(dtype).to(device) for n in SIZES]
    moms = [(torch.randn(n, generator=gen) * 0.01).to(device) for n in SIZES]
    return params, grads, moms


def _bits(ts):
    return [t.detach().cpu().view(torch.int16 if t.element_size() == 2 else torch.int32).clone()
            for t in ts]


def _same(xs, ys) -> bool:
    """Bit for bit."""
    xs, ys = _bits(xs), _bits(ys)
    return len(xs) == len(ys) and all(torch.equal(x, y) for x, y in zip(xs, ys))


def test_header_step_word_is_copied_from_the_counter():
    flag = torch.zeros(1, dtype=torch.int32)
    header = make_header(flag, 5, 0, counter=torch.tensor([2**31 + 7]))
    assert header.tolist() == [0, 7]
    assert make_header(flag, 5, 0).tolist() == [0, 5]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_functional_step_with_a_device_counter(backend, dtype):
    """step= an int64 [1] counter: the same results as int steps, the counter advanced by one
    per step and not at all by a skipped step."""
    if backends._problem(backend, "cpu"):
        pytest.skip(backends._problem(backend, "cpu"))
    a, ga, ma = _tensors(dtype, "cpu", 1)
    b, gb, mb = _tensors(dtype, "cpu", 1)
    counter = torch.zeros(1, dtype=torch.int64)
    for step in range(3):
        dk.fused_dlion_step(a, ga, ma, lr=1e-2, weight_decay=0.1, backend=backend, step=step,
                            nonfinite="skip")
        dk.fused_dlion_step(b, gb, mb, lr=1e-2, weight_decay=0.1, backend=backend,
                            step=counter, nonfinite="skip")
    assert _same(a + ma, b + mb)
    assert counter.item() == 3
    gb[2][0] = float("inf")
    before = [t.clone() for t in b + mb]
    dk.fused_dlion_step(b, gb, mb, lr=1e-2, backend=backend, step=counter, nonfinite="skip")
    assert _same(b + mb, before) and counter.item() == 3, "a skipped step counted"
    with pytest.raises(ValueError, match="int64 counter"):
        dk.fused_dlion_step(b, gb, mb, lr=1e-2, step=counter.to(torch.int32))


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def _train_step(model, opt, x):
    opt.zero_grad(set_to_none=False)
    model(x).square().mean().backward()
    opt.step()


def test_optimizer_counts_on_the_device_and_after_a_capture(monkeypatch):
    """The optimizer's step count lives on the device as well (advanced there, not by a skipped
    step). A captured step (faked here: the capture check says yes) writes nothing to the
    counter at its start and drops a step left to settle; afterwards the state's step counts
    come from the device counter, which replays advanced (faked: +4), and a loaded state resets
    it."""
    created = []

    class Recorded(pipeline.StepCounter):  # the optimizer's counter, seen from outside
        def __init__(self, device):
            super().__init__(device)
            created.append(self)

    monkeypatch.setattr(paths, "StepCounter", Recorded)
    model = _model()
    opt = dk.DistributedLion(model.parameters(), lr=1e-2, nonfinite="skip", capturable=True)
    x = torch.randn(4, 8)
    for _ in range(2):
        _train_step(model, opt, x)
    (counter,) = created
    assert counter.value.item() == 2 and not counter.captured
    model[0].weight.grad[0, 0] = float("nan")  # a skipped step does not count
    opt.step()
    assert counter.value.item() == 2 and opt.state_dict()["state"][0]["step"] == 2

    # the capture checks of the exchange (CUDA only in reality)
    for module in (pipeline, paths):
        monkeypatch.setattr(module, "capturing", lambda device: True)
    _train_step(model, opt, x)
    assert counter.captured and counter.value.item() == 3  # not filled, advanced once
    strict = dk.DistributedLion(_model().parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="nonfinite='skip'"):
        strict.step()
    params, grads, moms = _tensors(torch.float32, "cpu", 2)
    with pytest.raises(ValueError, match="step counter on the device"):
        dk.fused_dlion_step(params, grads, moms, lr=1e-2, nonfinite="skip", step=4)
    monkeypatch.undo()

    counter.value += 4  # four replays
    state = copy.deepcopy(opt.state_dict())
    assert {s["step"] for s in state["state"].values()} == {7}
    _train_step(model, opt, x)  # an uncaptured step goes on from the device's count
    assert counter.value.item() == 8
    assert {s["step"] for s in opt.state_dict()["state"].values()} == {8}
    opt.load_state_dict(state)
    assert counter.value.item() == 7


def _cuda_backends():
    out = []
    for name in ("cuda", "triton"):
        problem = backends._problem(name, "cuda") if torch.cuda.is_available() else "no GPU"
        out.append(pytest.param(name, marks=[pytest.mark.skip(reason=problem)] if problem
                                else []))
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device is visible to torch")
@pytest.mark.parametrize("backend", _cuda_backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_captured_optimizer_step_replays_as_uncaptured_steps(backend, dtype):
    """DistributedLion(capturable=True) on one GPU: forward, backward and step captured in one
    graph after two warm-up steps, replayed four times, equal an optimizer stepped six times
    without capture, bit for bit (parameters, momenta, step counts)."""
    models = [_model().to("cuda", dtype) for _ in range(2)]
    opts = [dk.DistributedLion(m.parameters(), lr=1e-2, weight_decay=0.1, nonfinite="skip",
                               capturable=True, backend=backend) for m in models]
    x = torch.randn(4, 8, device="cuda", dtype=dtype)
    for _ in range(6):
        _train_step(models[1], opts[1], x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            _train_step(models[0], opts[0], x)
    torch.cuda.current_stream().wait_stream(side)
    assert opts[0].last_stats is not None  # settles the warm-up (nothing is read in capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _train_step(models[0], opts[0], x)
    for _ in range(4):
        graph.replay()
    torch.cuda.synchronize()
    assert _same(models[0].parameters(), models[1].parameters())
    states = [o.state_dict()["state"] for o in opts]
    assert _same([s["exp_avg"] for s in states[0].values()],
                 [s["exp_avg"] for s in states[1].values()])
    assert {s["step"] for s in states[0].values()} == {s["step"] for s in states[1].values()} \
        == {6}
    assert opts[0].last_stats.skipped is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device is visible to torch")
@pytest.mark.parametrize("backend", _cuda_backends())
def test_captured_functional_step_follows_its_counter(backend):
    """fused_dlion_step(step=counter) captured once and replayed three times equals three
    uncaptured steps; the counter, read and advanced on the device, counts every replay."""
    a, ga, ma = _tensors(torch.bfloat16, "cuda", 3)
    b, gb, mb = _tensors(torch.bfloat16, "cuda", 3)
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")
    kw = {"lr": 1e-2, "weight_decay": 0.1, "mode": "average", "votes": "ternary",
          "backend": backend, "nonfinite": "skip"}
    for step in range(4):
        dk.fused_dlion_step(a, ga, ma, step=step, **kw)
    dk.fused_dlion_step(b, gb, mb, step=counter, **kw)  # warm-up: builds the launch tables
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dk.fused_dlion_step(b, gb, mb, step=counter, **kw)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert counter.item() == 4
    assert _same(a + ma, b + mb)
