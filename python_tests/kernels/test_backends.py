"""Every fast backend's three stages against the torch reference, stage by stage; the one voter
limit of every backend, views at odd offsets, and which backend is chosen on an old GPU."""

import os

import pytest
import torch
from conftest import DTYPES, assert_close_storage, backend_device, fast_backends

from dlion_kernels.kernels import backends, native, reference
from dlion_kernels.kernels.layout import (
    MAX_VOTERS,
    aggregate_planes,
    block_offsets,
    num_blocks,
    vote_planes,
)

SIZES = {
    "1": [1],
    "31": [31],
    "32": [32],
    "33": [33],
    "4097": [4097],
    "1e6": [1_000_003],
    "mixed": [7, 1, 64, 33, 4097, 31, 128, 100, 2, 300, 96, 5, 1025, 63, 17, 256, 3, 999],
}


def _grads(sizes, dtype, device, gen, none_at=()):
    return [
        None if i in none_at else torch.randn(s, generator=gen).to(dtype).to(device)
        for i, s in enumerate(sizes)
    ]


@pytest.mark.parametrize("backend", fast_backends())
@pytest.mark.parametrize("votes", ["binary", "ternary"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(SIZES))
def test_local_step(backend, votes, dtype, case):
    sizes = SIZES[case]
    device = backend_device(backend)
    gen = torch.Generator().manual_seed(hash((case, votes, str(dtype))) % 2**31)
    none_at = {1, 5} if len(sizes) > 2 else set()
    grads = _grads(sizes, dtype, "cpu", gen, none_at)
    moms = [torch.randn(s, generator=gen) for s in sizes]
    # Some exact zeros: c == 0 must vote -1 (binary) or abstain (ternary).
    for g, m in zip(grads, moms):
        if g is not None and g.numel() > 3:
            g[:3] = 0
            m[:3] = 0
    offsets, total = block_offsets(sizes)
    planes = vote_planes(votes)

    ref_v = torch.full((total * planes,), -1, dtype=torch.int32)
    reference.local_step(grads, moms, ref_v, offsets, 0.9, votes == "ternary")

    m_dev = [m.to(device) for m in moms]
    g_dev = [None if g is None else g.to(device) for g in grads]
    v_dev = torch.full((total * planes,), -1, dtype=torch.int32, device=device)
    backends.get(backend).local_step(g_dev, m_dev, v_dev, offsets, 0.9, votes == "ternary")

    assert torch.equal(v_dev.cpu(), ref_v), "votes differ from the reference"
    for a, e in zip(m_dev, moms):
        assert torch.equal(a.cpu(), e), "the local step must not write the momentum (v2)"


def _random_votes(n, blocks, votes, gen):
    """n valid packed vote vectors: binary random bits; ternary with plus & minus disjoint."""
    raw = torch.randint(0, 3, (n, blocks * 32), generator=gen)  # 0: minus, 1: abstain, 2: plus
    if votes == "binary":
        planes = [[(raw[i] == 2) | (raw[i] == 1) & (torch.arange(blocks * 32) % 3 == 0)]
                  for i in range(n)]
    else:
        planes = [[raw[i] == 2, raw[i] == 0] for i in range(n)]
    return torch.stack([reference.pack_bits(p, blocks * 32) for p in planes])


@pytest.mark.parametrize("backend", fast_backends())
@pytest.mark.parametrize("votes", ["binary", "ternary"])
@pytest.mark.parametrize("mode", ["vote", "average"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 33, 64])
def test_tally(backend, votes, mode, n):
    device = backend_device(backend)
    gen = torch.Generator().manual_seed(1000 * n + len(mode) + len(votes))
    blocks = 129
    stacked = _random_votes(n, blocks, votes, gen)
    planes_out = aggregate_planes(mode, votes, n)
    for step in (0, 1, 7):
        expected = torch.empty(blocks * planes_out, dtype=torch.int32)
        reference.tally(stacked, expected, n, mode, votes == "ternary", step)
        # the step as an int, and (where it matters: the binary tie rule) as the step counter
        # on the device (read there)
        givens = [step]
        if mode == "vote" and votes == "binary":
            givens.append(torch.tensor([step], dtype=torch.int64, device=device))
        for given in givens:
            out = torch.full((blocks * planes_out,), 12345, dtype=torch.int32, device=device)
            backends.get(backend).tally(stacked.to(device), out, n, mode, votes == "ternary",
                                        given)
            assert torch.equal(out.cpu(), expected), f"aggregate differs at step {given}"


def test_binary_tie_rule_is_balanced():
    """Even n, all tied: half the elements go each way, and each element alternates by step."""
    n, blocks = 4, 8
    ones = torch.ones(blocks * 32, dtype=torch.bool)
    stacked = torch.stack([reference.pack_bits([ones if i % 2 else ~ones], blocks * 32)
                           for i in range(n)])
    signs = []
    for step in (0, 1):
        out = torch.empty(blocks, dtype=torch.int32)
        reference.tally(stacked, out, n, "vote", False, step)
        signs.append(reference.decode(out, blocks * 32, n, "vote", False))
    assert signs[0].sum() == 0 and signs[1].sum() == 0
    assert torch.equal(signs[0], -signs[1])
    assert signs[0][0] == 1  # element 0 wins a tie at even steps


def _random_aggregate(sizes, mode, votes, n, gen):
    """A valid packed aggregate covering the tensors of ``sizes``."""
    _, total = block_offsets(sizes)
    if mode == "vote":
        return _random_votes(1, total, votes, gen)[0]
    top = n if votes == "binary" else 2 * n
    q = torch.randint(0, top + 1, (total * 32,), generator=gen)
    planes = aggregate_planes(mode, votes, n)
    return reference.pack_bits([(q >> p) & 1 == 1 for p in range(planes)], total * 32)


@pytest.mark.parametrize("backend", fast_backends())
@pytest.mark.parametrize("votes", ["binary", "ternary"])
@pytest.mark.parametrize("mode", ["vote", "average"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["1", "33", "4097", "1e6", "mixed"])
@pytest.mark.parametrize("n", [1, 3, 4])
def test_apply(backend, votes, mode, dtype, case, n):
    """x and m (kernel stages v2) against the reference; None gradients; with bf16/fp16
    parameters the gradients are fp32 for n = 3 (e.g. node means) and of the parameters' dtype
    otherwise."""
    if backend == "triton" and case == "1e6" and os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("Triton's interpreter runs a million elements program by program; the "
                    "sizes 4097 and mixed already span several programs")
    sizes = SIZES[case]
    device = backend_device(backend)
    gen = torch.Generator().manual_seed(hash((case, mode, votes, n)) % 2**31)
    offsets, _ = block_offsets(sizes)
    aggregate = _random_aggregate(sizes, mode, votes, n, gen)
    params = [torch.randn(s, generator=gen).to(dtype) for s in sizes]
    g_dtype = torch.float32 if n == 3 else dtype
    grads = _grads(sizes, g_dtype, "cpu", gen, {1, 5} if len(sizes) > 2 else set())
    moms = [torch.randn(s, generator=gen) for s in sizes]
    expected, ref_m = [p.clone() for p in params], [m.clone() for m in moms]
    reference.apply(expected, grads, ref_m, aggregate, offsets, 3e-3, 0.1, 0.99, n, mode,
                    votes == "ternary")
    actual, dev_m = [p.to(device) for p in params], [m.to(device) for m in moms]
    g_dev = [None if g is None else g.to(device) for g in grads]
    backends.get(backend).apply(actual, g_dev, dev_m, aggregate.to(device), offsets, 3e-3, 0.1,
                                0.99, n, mode, votes == "ternary")
    for a, e in zip(actual, expected):
        assert_close_storage(a, e)
    for a, e in zip(dev_m, ref_m):
        assert torch.equal(a.cpu(), e), "momentum differs from the reference"


@pytest.mark.parametrize("backend", fast_backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode, votes", [("vote", "binary"), ("average", "ternary")])
def test_stages_on_whole_chunks(backend, dtype, mode, votes):
    """Tensors of whole chunks (2048 elements: the Triton interpreter's chunk for these sizes,
    so its unmasked vector path runs on the CPU too) beside a tail, separate (aligned) and as
    views at an odd offset of one buffer (unaligned): the local step and the apply (x and m)
    equal the reference."""
    device = backend_device(backend)
    gen = torch.Generator().manual_seed(29)
    sizes, n, ternary = [2048, 33, 2048, 2048], 3, votes == "ternary"
    offsets, total = block_offsets(sizes)
    flat_g = torch.randn(1 + 2 * 2048, generator=gen).to(dtype)
    flat_x = torch.randn(1 + 2 * 2048, generator=gen).to(dtype)
    grads = [torch.randn(s, generator=gen).to(dtype) for s in sizes[:2]] + \
        [flat_g[1:2049], flat_g[2049:]]
    params = [torch.randn(s, generator=gen).to(dtype) for s in sizes[:2]] + \
        [flat_x[1:2049], flat_x[2049:]]
    moms = [torch.randn(s, generator=gen) for s in sizes]
    planes = vote_planes(votes)
    ref_v = torch.zeros(total * planes, dtype=torch.int32)
    reference.local_step(grads, moms, ref_v, offsets, 0.9, ternary)
    dev = backends.get(backend)
    flat_g_dev, flat_x_dev = flat_g.to(device), flat_x.to(device)
    g_dev = [g.to(device) for g in grads[:2]] + [flat_g_dev[1:2049], flat_g_dev[2049:]]
    m_dev = [m.clone().to(device) for m in moms]
    v_dev = torch.zeros(total * planes, dtype=torch.int32, device=device)
    dev.local_step(g_dev, m_dev, v_dev, offsets, 0.9, ternary)
    assert torch.equal(v_dev.cpu(), ref_v), "votes differ from the reference"
    aggregate = _random_aggregate(sizes, mode, votes, n, gen)
    expected, ref_m = [p.clone() for p in params], [m.clone() for m in moms]
    reference.apply(expected, grads, ref_m, aggregate, offsets, 3e-3, 0.1, 0.99, n, mode, ternary)
    x_dev = [p.to(device) for p in params[:2]] + [flat_x_dev[1:2049], flat_x_dev[2049:]]
    dev.apply(x_dev, g_dev, m_dev, aggregate.to(device), offsets, 3e-3, 0.1, 0.99, n, mode,
              ternary)
    for a, e in zip(x_dev, expected):
        assert_close_storage(a, e)
    for a, e in zip(m_dev, ref_m):
        assert torch.equal(a.cpu(), e), "momentum differs from the reference"


@pytest.mark.parametrize("backend", fast_backends())
@pytest.mark.parametrize("votes, ns", [("binary", (255, 256)), ("ternary", (127, 128))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_apply_average_on_both_sides_of_the_table(backend, votes, ns, dtype):
    """The average apply reads D from a table up to 8 bit planes and divides per element above
    (n = 255 / 256 binary, 127 / 128 ternary: 8 and 9 planes); both equal the reference."""
    sizes = SIZES["mixed"]
    device = backend_device(backend)
    for n in ns:
        gen = torch.Generator().manual_seed(n)
        offsets, _ = block_offsets(sizes)
        aggregate = _random_aggregate(sizes, "average", votes, n, gen)
        params = [torch.randn(s, generator=gen).to(dtype) for s in sizes]
        grads = _grads(sizes, dtype, "cpu", gen, {1})
        moms = [torch.randn(s, generator=gen) for s in sizes]
        expected, ref_m = [p.clone() for p in params], [m.clone() for m in moms]
        reference.apply(expected, grads, ref_m, aggregate, offsets, 3e-3, 0.1, 0.99, n,
                        "average", votes == "ternary")
        actual, dev_m = [p.to(device) for p in params], [m.to(device) for m in moms]
        g_dev = [None if g is None else g.to(device) for g in grads]
        backends.get(backend).apply(actual, g_dev, dev_m, aggregate.to(device), offsets, 3e-3,
                                    0.1, 0.99, n, "average", votes == "ternary")
        for a, e in zip(actual, expected):
            assert_close_storage(a, e)
        for a, e in zip(dev_m, ref_m):
            assert torch.equal(a.cpu(), e), f"n={n}: momentum differs from the reference"


@pytest.mark.parametrize("backend", ["torch", *fast_backends()])
@pytest.mark.parametrize("votes", ["binary", "ternary"])
@pytest.mark.parametrize("mode", ["vote", "average"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["1", "31", "33", "4097", "mixed"])
def test_apply_without_momentum(backend, votes, mode, dtype, case):
    """exp_avgs=None: x exactly as the reference's apply with momentum, and neither a momentum
    nor the gradients are touched; exp_avgs with None entries: x everywhere, m only where given
    (the others' gradients not read). n = 3: average mode has 2-3 planes."""
    sizes = SIZES[case]
    n = 3
    device = backend_device(backend) if backend != "torch" else torch.device("cpu")
    gen = torch.Generator().manual_seed(hash((case, mode, votes, "no-m")) % 2**31)
    offsets, _ = block_offsets(sizes)
    aggregate = _random_aggregate(sizes, mode, votes, n, gen).to(device)
    params = [torch.randn(s, generator=gen).to(dtype) for s in sizes]
    grads = [torch.randn(s, generator=gen).to(dtype) for s in sizes]
    moms = [torch.randn(s, generator=gen) for s in sizes]
    ternary = votes == "ternary"
    expected, ref_m = [p.clone() for p in params], [m.clone() for m in moms]
    reference.apply(expected, grads, ref_m, aggregate.cpu(), offsets, 3e-3, 0.1, 0.99, n, mode,
                    ternary)
    kernels = backends.get(backend)
    actual = [p.clone().to(device) for p in params]
    kernels.apply(actual, None, None, aggregate, offsets, 3e-3, 0.1, 0.99, n, mode, ternary)
    for a, e in zip(actual, expected):
        assert_close_storage(a.cpu(), e)
    # Some tensors with momentum, some without (their NaN gradients must not reach anything).
    keep = [i % 2 == 0 for i in range(len(sizes))]
    actual = [p.clone().to(device) for p in params]
    dev_m = [m.clone().to(device) if k else None for m, k in zip(moms, keep)]
    dev_g = [g.to(device) if k else torch.full_like(g, float("nan")).to(device)
             for g, k in zip(grads, keep)]
    kernels.apply(actual, dev_g, dev_m, aggregate, offsets, 3e-3, 0.1, 0.99, n, mode, ternary)
    for a, e in zip(actual, expected):
        assert_close_storage(a.cpu(), e)
    for m, e, k in zip(dev_m, ref_m, keep):
        if k:
            assert torch.equal(m.cpu(), e), "momentum differs from the reference"


@pytest.mark.parametrize("backend", ["torch", *fast_backends()])
def test_apply_skip_flag(backend):
    """A non-zero skip flag (int32 [1] on the device) leaves x and m untouched; zero applies."""
    device = backend_device(backend) if backend != "torch" else torch.device("cpu")
    gen = torch.Generator().manual_seed(5)
    sizes = SIZES["mixed"]
    offsets, _ = block_offsets(sizes)
    aggregate = _random_aggregate(sizes, "vote", "binary", 1, gen).to(device)
    params = [torch.randn(s, generator=gen).to(device) for s in sizes]
    grads = [torch.randn(s, generator=gen).to(device) for s in sizes]
    moms = [torch.randn(s, generator=gen).to(device) for s in sizes]
    kernels = backends.get(backend)
    x, m = [p.clone() for p in params], [t.clone() for t in moms]
    skip = torch.ones(1, dtype=torch.int32, device=device)
    kernels.apply(x, grads, m, aggregate, offsets, 0.1, 0.1, 0.9, 1, "vote", False, skip)
    assert all(torch.equal(a, b) for a, b in zip(x + m, params + moms))
    kernels.apply(x, grads, m, aggregate, offsets, 0.1, 0.1, 0.9, 1, "vote", False, skip - 1)
    ex, em = [p.clone().cpu() for p in params], [t.clone().cpu() for t in moms]
    reference.apply(ex, [g.cpu() for g in grads], em, aggregate.cpu(), offsets, 0.1, 0.1, 0.9, 1,
                    "vote", False)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(x + m, ex + em))


@pytest.mark.parametrize("backend", fast_backends())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bad", [None, float("inf"), -float("inf"), float("nan")], ids=str)
def test_nonfinite(backend, dtype, bad):
    """The gradient check finds one bad element wherever it sits, and nothing in finite data."""
    device = backend_device(backend)
    gen = torch.Generator().manual_seed(11)
    sizes = SIZES["mixed"] + [1_000_003]
    grads = [(1e3 * torch.randn(s, generator=gen)).to(dtype).to(device) for s in sizes]
    kernels = backends.get(backend)
    places = [(0, 0), (4, 4096), (len(sizes) - 1, 0), (len(sizes) - 1, 999_999), (6, 127)]
    for t, i in places if bad is not None else [(None, None)]:
        case = [g.clone() for g in grads]
        if t is not None:
            case[t].view(-1)[i] = bad
        expected = reference.nonfinite([g.cpu() for g in case])
        found = kernels.nonfinite(case)
        assert found.dtype == torch.int32 and found.shape == (1,)
        assert found.item() == expected.item() == int(bad is not None), (t, i)


def _same_values(actual, expected):
    """Bit-identical, except that any NaN matches any NaN (payloads may differ)."""
    a, e = actual.cpu(), expected.cpu()
    nan = e.isnan()
    assert torch.equal(a.isnan(), nan)
    assert torch.equal(a[~nan].view(torch.int16 if a.element_size() == 2 else torch.int32),
                       e[~nan].view(torch.int16 if e.element_size() == 2 else torch.int32))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy: inf - inf
@pytest.mark.parametrize("backend", fast_backends())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_every_half_precision_value(backend, dtype):
    """All 65536 bit patterns (subnormals, the largest values, inf, NaN) as parameters and as
    gradients: conversions and the final rounding, vectorized or not, equal the reference."""
    device = backend_device(backend)
    values = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    values = torch.cat([values, values[:17]])  # and a partial last block
    offsets, total = block_offsets([values.numel()])
    kernels = backends.get(backend)
    for lr, wd in ((0.0, 0.0), (0.3, 0.7), (1.0, 0.0), (2.0**-20, 3.0)):
        gen = torch.Generator().manual_seed(int(lr * 1000))
        aggregate = _random_votes(1, total, "binary", gen)[0]
        moms = torch.randn(values.numel(), generator=gen)
        expected, ref_m = [values.clone()], [moms.clone()]
        reference.apply(expected, [values], ref_m, aggregate, offsets, lr, wd, 0.99, 1, "vote",
                        False)
        actual, dev_m = [values.clone().to(device)], [moms.to(device)]
        kernels.apply(actual, [values.to(device)], dev_m, aggregate.to(device), offsets, lr, wd,
                      0.99, 1, "vote", False)
        _same_values(actual[0], expected[0])
        _same_values(dev_m[0], ref_m[0])
    moms = torch.randn(values.numel(), generator=torch.Generator().manual_seed(3))
    ref_v = torch.zeros(total, dtype=torch.int32)
    reference.local_step([values], [moms], ref_v, offsets, 0.9, False)
    dev_v = torch.zeros(total, dtype=torch.int32, device=device)
    kernels.local_step([values.to(device)], [moms.to(device)], dev_v, offsets, 0.9, False)
    assert torch.equal(dev_v.cpu(), ref_v)


def test_num_blocks_and_offsets():
    assert [num_blocks(s) for s in (0, 1, 31, 32, 33, 4097)] == [0, 1, 1, 1, 2, 129]
    assert block_offsets([1, 33, 32]) == ([0, 1, 3], 4)


def test_auto_falls_back_to_triton_on_an_old_gpu(monkeypatch):
    """native.problem('cuda') on a fake 7.5 device with a CUDA build: refused, so auto picks the
    next backend (triton) and naming 'cuda' raises with the reason."""

    class FakeC:
        def has_cuda(self):
            return True

        def build_info(self):
            return "cpu: GNU; cuda: nvcc 13.0, archs 80;90"

    monkeypatch.setattr(native, "load_module", lambda: FakeC())
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
    # on a GPU the views are taken again from device copies of the flat buffers (a copy of a
    # view alone would be aligned)
    dev_x, dev_g = to(flat_x.clone()), to(flat_g)
    x, g, at = [], [], 0
    for i, s in enumerate(sizes):
        if i % 2 == 0:
            x.append(to(params[i].clone()) if device.type != "cpu" else params[i])
            g.append(to(grads[i]))
        else:
            x.append(dev_x[at + 1 : at + 1 + s] if device.type != "cpu" else params[i])
            g.append(dev_g[at + 1 : at + 1 + s])
            at += s + 1
    m = [to(t.clone()) for t in moms]
    votes = torch.zeros(total, dtype=torch.int32, device=device)
    kernels.local_step(g, m, votes, offsets, 0.9, False)
    assert torch.equal(votes.cpu(), votes_ref)
    kernels.apply(x, g, m, to(agg), offsets, 1e-2, 0.1, 0.99, 1, "vote", False)
    for a, e in zip(x + m, ex + em):
        assert torch.equal(a.cpu(), e)
    if backend == "triton":
        from dlion_kernels.kernels import triton as tk

        launches = tk.launch_tables("apply", device, (x, g, m), tuple(sizes), tuple(offsets), 4096)
        assert sorted(launch[3] for launch in launches) == [False, True]
