"""Issue 12's findings that can be checked without a GPU: the compute-capability check (1), the
equal n limit of every backend (5), and per-tensor alignment in the Triton launches (3)."""

import pytest
import torch
from conftest import backend_device, fast_backends

from dlion_kernels.kernels import backends, native, reference
from dlion_kernels.kernels.layout import MAX_VOTERS, block_offsets


def test_compiled_archs_parsed_from_build_info():
    info = "cpu: GNU 12 (Release); cuda: nvcc 13.0, archs 80;90"
    assert native.compiled_archs(info) == [80, 90]
    assert native.compiled_archs("cpu: GNU; cuda: not built (DLION_BUILD_CUDA=0)") == []


@pytest.mark.parametrize("capability, ok", [((7, 0), False), ((7, 5), False), ((8, 0), True),
                                            ((8, 6), True), ((9, 0), True), ((12, 0), True)])
def test_fake_capability_against_compiled_archs(capability, ok):
    """A V100 (7.0) or T4 (7.5) with a module built for sm_80;90 is refused with a reason that
    names the archs and the way out; 8.x, 9.0 and newer (PTX) run."""
    problem = native.arch_problem(capability, [80, 90])
    assert (problem is None) == ok
    if not ok:
        assert "sm_80, sm_90" in problem and "triton" in problem and "DLION_CUDA_ARCHS" in problem


def test_auto_falls_back_to_triton_on_an_old_gpu(monkeypatch):
    """native.problem('cuda') on a fake 7.5 device with a CUDA build: refused, so auto picks the
    next backend (triton) and naming 'cuda' raises with the reason."""

    class FakeC:
        def has_cuda(self):
            return True

        def build_info(self):
            return "cpu: GNU; cuda: nvcc 13.0, archs 80;90"

    monkeypatch.setattr(native, "_load", lambda: FakeC())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    assert "sm_75" in native.problem("cuda")
    monkeypatch.setattr(backends, "_triton_problem", lambda device_type: None)
    assert backends.available_backends("cuda")[0] == "triton"
    with pytest.raises(backends.BackendUnavailable, match="sm_75"):
        backends.resolve("cuda", torch.device("cuda"))


@pytest.mark.parametrize("backend", fast_backends())
@pytest.mark.parametrize("ternary", [False, True])
def test_n_limit_is_the_same_everywhere(backend, ternary):
    device = backend_device(backend)
    kernels = backends.get(backend)
    for n, ok in ((MAX_VOTERS, True), (MAX_VOTERS + 1, False)):
        stacked = torch.zeros(n, 2 if ternary else 1, dtype=torch.int32, device=device)
        planes = 2 if ternary else 1  # vote mode
        out = torch.empty(planes, dtype=torch.int32, device=device)
        if ok:
            if backend == "triton":
                continue  # the interpreter would take minutes over 32767 rows
            kernels.tally(stacked, out, n, "vote", ternary, 0)
        else:
            with pytest.raises(ValueError, match="32767"):
                kernels.tally(stacked, out, n, "vote", ternary, 0)


@pytest.mark.parametrize("backend", fast_backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_alignment(backend, dtype):
    """Views at odd element offsets of one flat buffer (a flat parameter buffer, a DDP bucket)
    next to aligned tensors: results equal the reference; Triton splits the launch in two."""
    device = backend_device(backend)
    gen = torch.Generator().manual_seed(17)
    sizes = [4097, 33, 1000, 64, 5]
    flat_x = torch.randn(sum(sizes) + 8, generator=gen).to(dtype)
    flat_g = torch.randn(sum(sizes) + 8, generator=gen).to(dtype)
    params, grads, at = [], [], 0
    for i, s in enumerate(sizes):
        if i % 2 == 0:  # aligned, separate storage
            params.append(torch.randn(s, generator=gen).to(dtype))
            grads.append(torch.randn(s, generator=gen).to(dtype))
        else:  # misaligned views
            params.append(flat_x[at + 1 : at + 1 + s])
            grads.append(flat_g[at + 1 : at + 1 + s])
            at += s + 1
    moms = [torch.randn(s, generator=gen) for s in sizes]
    offsets, total = block_offsets(sizes)
    agg = torch.randint(-(2**31), 2**31, (total,), generator=gen, dtype=torch.int64).to(
        torch.int32)
    votes_ref = torch.zeros(total, dtype=torch.int32)
    reference.local_step(grads, moms, votes_ref, offsets, 0.9, False)
    ex, em = [p.clone() for p in params], [m.clone() for m in moms]
    reference.apply(ex, grads, em, agg, offsets, 1e-2, 0.1, 0.99, 1, "vote", False)

    kernels = backends.get(backend)
    to = (lambda t: t.to(device)) if device.type != "cpu" else (lambda t: t)
    x = [to(p.clone()) if device.type != "cpu" else p for p in params]
    g = [to(t) for t in grads]
    m = [to(t.clone()) for t in moms]
    votes = torch.zeros(total, dtype=torch.int32, device=device)
    kernels.local_step(g, m, votes, offsets, 0.9, False)
    assert torch.equal(votes.cpu(), votes_ref)
    kernels.apply(x, g, m, to(agg), offsets, 1e-2, 0.1, 0.99, 1, "vote", False)
    for a, e in zip(x + m, ex + em):
        assert torch.equal(a.cpu(), e)
    if backend == "triton":
        from dlion_kernels.kernels import triton as tk

        launches = tk._tables("apply", device, (x, g, m), tuple(sizes), tuple(offsets), 4096)
        assert sorted(launch[3] for launch in launches) == [False, True]
