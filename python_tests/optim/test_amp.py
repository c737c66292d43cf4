"""fp16 AMP with torch.amp.GradScaler: an overflow on one rank only skips the step on every rank,
the scales stay identical, and the trajectory is the unscaled one minus the skipped step."""

import pytest
import torch
from workers import run_workers

import dlion_kernels as dk

INF_STEP, STEPS = 2, 6


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(13, 31), torch.nn.Tanh(), torch.nn.Linear(31, 3))


def _loss(model, step, rank, autocast=False):
    gen = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(8, 13, generator=gen), torch.randint(0, 3, (8,), generator=gen)
    with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
        logits = model(x)
    return torch.nn.functional.cross_entropy(logits.float(), y)


def _scaled_run(rank, inf_rank, autocast=False, clip=False, hierarchy=None, clean=False):
    """GradScaler training; rank ``inf_rank`` gets an inf gradient at INF_STEP. ``clean``: after
    the user's ``unscale_`` the inf is zeroed, so only the scaler's own flag knows of it."""
    model = _model()
    opt = dk.DistributedLion(model.parameters(), lr=1e-2, weight_decay=0.1, hierarchy=hierarchy)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    scales, skipped = [], []
    for step in range(STEPS):
        opt.zero_grad()
        scaler.scale(_loss(model, step, rank, autocast)).backward()
        if step == INF_STEP and rank == inf_rank:
            model[0].weight.grad[3, 4] = float("inf")
        if clip:  # the user unscales first (to clip); the optimizer must not unscale again
            scaler.unscale_(opt)
            if clean:
                for p in model.parameters():
                    p.grad.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        skipped.append(opt.last_stats.skipped)
    return [p.detach().clone() for p in model.parameters()], scales, skipped, opt.state_dict()


def _unscaled_run(rank, hierarchy=None):
    """The same batches without a scaler, INF_STEP left out on every rank."""
    model = _model()
    opt = dk.DistributedLion(model.parameters(), lr=1e-2, weight_decay=0.1, hierarchy=hierarchy)
    for step in range(STEPS):
        opt.zero_grad()
        _loss(model, step, rank).backward()
        if step != INF_STEP:
            opt.step()
    return [p.detach().clone() for p in model.parameters()], opt.state_dict()


def _amp_worker(rank, n):
    return {
        "fp32": _scaled_run(rank, inf_rank=1),
        "fp32_unscale_first": _scaled_run(rank, inf_rank=1, clip=True),
        "fp16_autocast": _scaled_run(rank, inf_rank=1, autocast=True),
        "reference": _unscaled_run(rank),
    }


def _expected_scales():
    # init 2^10, growth every 2 clean steps, halved at the overflow step (on every rank)
    scale, clean, out = 2.0**10, 0, []
    for step in range(STEPS):
        if step == INF_STEP:
            scale, clean = scale / 2, 0
        else:
            clean += 1
            if clean == 2:
                scale, clean = scale * 2, 0
        out.append(scale)
    return out


def test_overflow_on_one_rank_skips_everywhere_and_scales_agree():
    ranks = run_workers(2, _amp_worker)
    for key in ("fp32", "fp32_unscale_first", "fp16_autocast"):
        for rank, out in enumerate(ranks):
            params, scales, skipped, state = out[key]
            assert skipped == [s == INF_STEP for s in range(STEPS)], (key, rank)
            assert scales == _expected_scales(), (key, rank)
            assert all(torch.equal(a, b) for a, b in zip(params, ranks[0][key][0])), key
            assert all(s["step"] == STEPS - 1 for s in state["state"].values())
    for key in ("fp32", "fp32_unscale_first"):
        # power-of-two scales unscale exactly: the unscaled trajectory, bit for bit
        for out in ranks:
            assert all(torch.equal(a, b) for a, b in zip(out[key][0], out["reference"][0]))


def _amp_hierarchy_worker(rank, n, L):
    # the inf lands on the last rank: another node than rank 0's when there are two
    return {
        "fp32": _scaled_run(rank, inf_rank=n - 1, hierarchy=L),
        "fp32_unscale_first": _scaled_run(rank, inf_rank=n - 1, clip=True, hierarchy=L),
        # the overflow reaches the step only through the scaler's found_inf (the OR of the flags)
        "scaler_flag_only": _scaled_run(rank, inf_rank=n - 1, clip=True, hierarchy=L,
                                        clean=True),
        "reference": _unscaled_run(rank, hierarchy=L),
    }


@pytest.mark.parametrize("n, L", [(4, 2), (2, 2)], ids=["2x2", "1x2"])
def test_hierarchy_overflow_on_one_rank_skips_everywhere_and_scales_agree(n, L):
    """fp16 GradScaler with hierarchical D-Lion: the overflow of one rank skips the step on every
    rank of every node, the scales stay identical, and (power-of-two scales unscale exactly) the
    parameters and momentum shards are the unscaled hierarchical run's, bit for bit."""
    ranks = run_workers(n, _amp_hierarchy_worker, L)
    for key in ("fp32", "fp32_unscale_first", "scaler_flag_only"):
        for rank, out in enumerate(ranks):
            params, scales, skipped, state = out[key]
            assert skipped == [s == INF_STEP for s in range(STEPS)], (key, rank)
            assert scales == _expected_scales(), (key, rank)
            assert all(torch.equal(a, b) for a, b in zip(params, ranks[0][key][0])), (key, rank)
            ref_params, ref_state = out["reference"]
            assert all(torch.equal(a, b) for a, b in zip(params, ref_params)), (key, rank)
            assert state["state"].keys() == ref_state["state"].keys()
            for i, s in state["state"].items():
                assert s["step"] == STEPS - 1
                assert torch.equal(s["exp_avg"], ref_state["state"][i]["exp_avg"]), (key, i)
                assert s["exp_avg_range"] == ref_state["state"][i]["exp_avg_range"]


def test_single_process_overflow_skips_and_backs_off():
    model = _model()
    opt = dk.DistributedLion(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    scaler.scale(_loss(model, 0, 0)).backward()
    model[2].bias.grad[0] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)  # nonfinite="raise" does not apply: under a scaler an overflow skips
    scaler.update()
    assert opt.last_stats.skipped and scaler.get_scale() == 2.0**7
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(not s for s in opt.state.values()) or all(
        not s["exp_avg"].any() for s in opt.state.values())
    opt.zero_grad()
    scaler.scale(_loss(model, 1, 0)).backward()
    scaler.step(opt)
    scaler.update()
    assert not opt.last_stats.skipped and scaler.get_scale() == 2.0**7
    assert model[2].bias.grad.abs().max() < 10  # unscaled in place, as GradScaler does


def test_attribute_protocol_without_scaler_keyword():
    """torch's announced form (opt.grad_scale / opt.found_inf set around step) also unscales
    and skips; used if torch stops passing grad_scaler."""
    model = _model()
    opt = dk.DistributedLion(model.parameters(), lr=1e-2)
    twin = _model()
    twin_opt = dk.DistributedLion(twin.parameters(), lr=1e-2)
    (_loss(model, 0, 0) * 64).backward()
    _loss(twin, 0, 0).backward()
    opt.grad_scale, opt.found_inf = torch.tensor(64.0), torch.zeros(())
    opt.step()
    twin_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    opt.found_inf = torch.ones(())
    opt.step()
    assert opt.last_stats.skipped
    del opt.grad_scale, opt.found_inf


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_without_scaler_nonfinite_policy_still_applies(policy):
    model = _model()
    opt = dk.DistributedLion(model.parameters(), nonfinite=policy)
    _loss(model, 0, 0).backward()
    model[0].bias.grad[0] = float("inf")
    if policy == "raise":
        with pytest.raises(dk.NonFiniteGradientError):
            opt.step()
    else:
        opt.step()
        assert opt.last_stats.skipped
