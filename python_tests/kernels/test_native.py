"""The native module: build facts, import safety, the 'cpu' backend against reference.py, and
the compute-capability check against the compiled archs (no GPU needed).

The full cross-backend suite is test_backends.py; this file pins the native module itself (and
runs the CUDA backend too where one is built and a device is visible).
"""

from __future__ import annotations

import pytest
import torch

from dlion_kernels.kernels import native, reference
from dlion_kernels.kernels.layout import aggregate_planes, block_offsets, vote_planes

# the tests that run the module (the build-info parsing and capability checks need none)
needs_native = pytest.mark.skipif(
    native.problem("cpu") is not None, reason=str(native.problem("cpu"))
)

SIZES = [1, 31, 32, 33, 4097]
MIXED = [33, 1, 4097, 32, 7, 100_000, 31]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _devices():
    out = ["cpu"]
    if native.problem("cuda") is None:
        out.append("cuda")
    return out


@needs_native
def test_build_info():
    C = native.load_module()
    info = C.build_info()
    assert "cpu:" in info and "cuda:" in info
    assert isinstance(C.has_cuda(), bool)
    assert C.cpu_isa() in ("avx2+f16c", "baseline")
    assert C.cpu_isa() in native.build_info()
    if not C.has_cuda():
        assert C.cuda_not_built_reason()
        assert "without CUDA" in native.problem("cuda")


def _case(sizes, dtype, seed, none_every=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    grads, moms, params = [], [], []
    for i, numel in enumerate(sizes):
        g = torch.randn(numel, generator=gen).to(dtype)
        if i % 7 == 3:  # exact zeros and signed zeros vote -1 / abstain
            g[::3] = 0.0
            g[1::5] = -0.0
        grads.append(None if none_every and i % none_every == 1 else g.to(device))
        m = torch.randn(numel, generator=gen) * 0.01
        if i % 7 == 3:
            m[::3] = 0.0
        moms.append(m.to(device))
        params.append(torch.randn(numel, generator=gen).to(dtype).to(device))
    return grads, moms, params


def _clone(ts):
    return [None if t is None else t.clone() for t in ts]


@needs_native
@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ternary", [False, True])
@pytest.mark.parametrize("sizes", [[s] for s in SIZES] + [MIXED, [1_000_000]],
                         ids=[str(s) for s in SIZES] + ["mixed", "1e6"])
def test_local_step_and_apply_match_reference(device, dtype, ternary, sizes):
    be = native.backend(device)
    grads, moms, params = _case(sizes, dtype, seed=len(sizes) * 31 + sizes[0], none_every=3,
                                device=device)
    offsets, total = block_offsets(len_ for len_ in sizes)
    planes = vote_planes("ternary" if ternary else "binary")
    votes_ref = torch.zeros(total * planes + 3, dtype=torch.int32, device=device)
    votes_nat = votes_ref.clone()
    m_before = _clone(moms)
    reference.local_step(grads, moms, votes_ref, offsets, 0.9, ternary)
    be.local_step(grads, moms, votes_nat, offsets, 0.9, ternary)
    assert torch.equal(votes_ref, votes_nat)
    for a, b in zip(moms, m_before):  # kernel stages v2: the local step only reads m
        assert torch.equal(a, b)

    # every voter count 1..9 on the small sizes; the million elements (many threads' chunks) check
    # the chunking with a few, as the pure-torch reference is slow there
    for n in range(1, 10) if sum(sizes) < 500_000 else (1, 2, 3, 9):
        for mode in ("vote", "average"):
            p_out = aggregate_planes(mode, "ternary" if ternary else "binary", n)
            gen = torch.Generator().manual_seed(n)
            stacked = torch.randint(-(2**31), 2**31, (n, total * planes), generator=gen,
                                    dtype=torch.int64).to(torch.int32)
            if ternary:  # both bits never set together
                s = stacked.view(n, total, 2)
                s[..., 1] &= ~s[..., 0]
            stacked = stacked.to(device)
            agg_ref = torch.empty(total * p_out, dtype=torch.int32, device=device)
            agg_nat = torch.full_like(agg_ref, 7)
            for step in (0, 1):
                reference.tally(stacked, agg_ref, n, mode, ternary, step)
                be.tally(stacked, agg_nat, n, mode, ternary, step)
                assert torch.equal(agg_ref, agg_nat), (n, mode, step)
            x_ref, x_nat = _clone(params), _clone(params)
            m_ref, m_nat = _clone(moms), _clone(moms)
            reference.apply(x_ref, grads, m_ref, agg_ref, offsets, 1e-2, 0.1, 0.99, n, mode,
                            ternary)
            be.apply(x_nat, grads, m_nat, agg_nat, offsets, 1e-2, 0.1, 0.99, n, mode, ternary)
            for a, b in zip(x_ref, x_nat):
                assert torch.equal(a, b), (n, mode)
            for a, b in zip(m_ref, m_nat):
                assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (n, mode)


@needs_native
@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("ternary", [False, True])
@pytest.mark.parametrize("n", [16, 17, 63, 64, 65, 200])
def test_tally_many_voters(device, ternary, n):
    be = native.backend(device)
    blocks = 300
    planes = 2 if ternary else 1
    gen = torch.Generator().manual_seed(n)
    stacked = torch.randint(-(2**31), 2**31, (n, blocks * planes), generator=gen,
                            dtype=torch.int64).to(torch.int32)
    if ternary:
        s = stacked.view(n, blocks, 2)
        s[..., 1] &= ~s[..., 0]
    stacked = stacked.to(device)
    for mode in ("vote", "average"):
        p_out = aggregate_planes(mode, "ternary" if ternary else "binary", n)
        ref = torch.empty(blocks * p_out, dtype=torch.int32, device=device)
        nat = torch.empty_like(ref)
        reference.tally(stacked, ref, n, mode, ternary, 3)
        be.tally(stacked, nat, n, mode, ternary, 3)
        assert torch.equal(ref, nat)


@needs_native
def test_unaligned_views_and_cache():
    """Tensors that start off a 16-byte boundary take the scalar path; a cached table is reused."""
    be = native.backend("cpu")
    base_g, base_m = torch.randn(1001), torch.randn(1001) * 0.01
    g, m = base_g[1:], base_m[1:]
    offsets, total = block_offsets([1000])
    v_ref = torch.zeros(total, dtype=torch.int32)
    v_nat = torch.zeros(total, dtype=torch.int32)
    reference.local_step([g], [m], v_ref, offsets, 0.95, False)
    be.local_step([g], [m], v_nat, offsets, 0.95, False)
    assert torch.equal(v_ref, v_nat)
    cached = len(be._tables)
    be.local_step([g], [m], v_nat, offsets, 0.95, False)
    assert len(be._tables) == cached
    x = torch.randn(1001)[1:]
    x_ref, m_ref = x.clone(), m.clone()
    reference.apply([x_ref], [g], [m_ref], v_ref, offsets, 0.1, 0.01, 0.98, 1, "vote", False)
    be.apply([x], [g], [m], v_nat, offsets, 0.1, 0.01, 0.98, 1, "vote", False)
    assert torch.equal(x_ref, x) and torch.equal(m_ref, m)


@needs_native
def test_bad_buffers_raise():
    be = native.backend("cpu")
    g, m = torch.randn(100), torch.randn(100)
    with pytest.raises(ValueError, match="votes"):
        be.local_step([g], [m], torch.zeros(2, dtype=torch.int32), [0], 0.9, False)
    with pytest.raises(TypeError):
        be.local_step([g], [m], torch.zeros(4, dtype=torch.int64), [0], 0.9, False)
    with pytest.raises(ValueError, match="out"):
        be.tally(torch.zeros(2, 4, dtype=torch.int32), torch.zeros(3, dtype=torch.int32), 2,
                 "vote", False, 0)


@needs_native
def test_baseline_isa_variant():
    """The CPU kernels' SSE2 variant (the AVX2 + F16C one runs everywhere else in this suite):
    the same reference checks in a process that has DLION_CPU_NO_AVX2=1 from the start."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    native_test = "test_native.py::test_local_step_and_apply_match_reference"
    # -n 0: in one process, as a test file of the outer run already is one worker's. The
    # million-element cases are left out: the sizes up to 100k reach every vector loop and tail,
    # and how a large tensor is split over threads does not depend on the instruction set.
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
           os.path.join(here, native_test), os.path.join(here, "test_backends.py"),
           "-k", "cpu and (every_half or nonfinite or apply) and not 1e6"]
    env = {**os.environ, "DLION_CPU_NO_AVX2": "1"}
    isa = subprocess.run([sys.executable, "-c", "import dlion_kernels.kernels.native as n; "
                          "print(n.load_module().cpu_isa())"],
                         capture_output=True, text=True, env=env)
    assert isa.stdout.strip() == "baseline", isa.stdout + isa.stderr
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=here)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout


# ----------------------------------------------------------------------------- GPU capability


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
