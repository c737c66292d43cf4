"""register_ddp_comm_hook with DDP options the other tests do not use (static_graph,
gradient_as_bucket_view), under Hugging Face Trainer and under Accelerate, on 2 real gloo
processes."""

import os
import socket
import tempfile

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from workers import run_workers

import dlion_kernels as dk

STEPS = 4


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 40), torch.nn.Tanh(), torch.nn.Linear(40, 33),
                               torch.nn.Tanh(), torch.nn.Linear(33, 2))


def _ddp_options_run(rank, wrap):
    net = _mlp()
    opt = dk.DistributedLion(net.parameters(), lr=1e-2, weight_decay=0.1, backend="cpu")
    model = net
    if wrap:
        model = DDP(net, static_graph=True, gradient_as_bucket_view=True,
                    bucket_cap_mb=1000 * 4 / 2**20)
        dk.register_ddp_comm_hook(model, opt)
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 * rank + step)
        opt.zero_grad()
        model(torch.randn(5, 8, generator=gen)).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in net.parameters()], [
        opt.state[p]["exp_avg"].clone() for p in net.parameters()]


def _trainer_run(rank, n, port):
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n),
                      LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.manual_seed(0)  # a tiny random model, built from a config: nothing is downloaded
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    gen = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids}
            for ids in torch.randint(0, 64, (32, 16), generator=gen)]
    opt = dk.DistributedLion(model.parameters(), lr=1e-3, weight_decay=0.01, backend="cpu")
    seen = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(
        sum(float(p.grad.double().sum()) for p in model.parameters() if p.grad is not None)))
    opt.register_step_post_hook(lambda o, args, kwargs: seen.append(o.last_stats))

    class RegisterHook(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            assert isinstance(trainer.model_wrapped, DDP), type(trainer.model_wrapped)
            dk.register_ddp_comm_hook(trainer.model_wrapped, opt)

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=4, max_steps=STEPS, use_cpu=True,
            ddp_backend="gloo", report_to=[], save_strategy="no", logging_strategy="no",
            disable_tqdm=True, dataloader_num_workers=0, seed=0,
            max_grad_norm=0.0)  # the votes are taken in backward: clip nothing afterwards
        trainer = Trainer(model=model, args=args, train_dataset=data,
                          optimizers=(opt, None), callbacks=[RegisterHook()])
        trainer.train()
    d = sum(p.numel() for p in model.parameters())
    return [p.detach().clone() for p in model.parameters()], seen, d


def _accelerate_run(rank):
    """Accelerate's prepare() wraps the model in DDP; the hook replaces DDP's all-reduce."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    net = _mlp()
    opt = dk.DistributedLion(net.parameters(), lr=1e-2, weight_decay=0.1, backend="cpu")
    ddp, aopt = accelerator.prepare(net, opt)
    assert isinstance(ddp, DDP)
    dk.register_ddp_comm_hook(ddp, opt)
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 * rank + step)
        aopt.zero_grad()
        accelerator.backward(ddp(torch.randn(5, 8, generator=gen)).square().mean())
        aopt.step()
    return [p.detach().clone() for p in net.parameters()], [
        opt.state[p]["exp_avg"].clone() for p in net.parameters()]


def _worker(rank, n, port):
    plain, hooked = _ddp_options_run(rank, False), _ddp_options_run(rank, True)
    trainer = _trainer_run(rank, n, port)
    return plain, hooked, trainer, _accelerate_run(rank)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_options_and_hugging_face_trainer():
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    n = 2
    ranks = run_workers(n, _worker, _free_port())
    for plain, hooked, _, accelerated in ranks:
        # static_graph + gradient_as_bucket_view, and Accelerate's DDP: the same parameters and
        # momenta as the bare model, bit for bit
        for a, b, c in zip(plain[0] + plain[1], hooked[0] + hooked[1],
                           accelerated[0] + accelerated[1]):
            assert torch.equal(a, b) and torch.equal(a, c)
    for a, b in zip(ranks[0][0][0], ranks[1][0][0]):
        assert torch.equal(a, b)

    params0, seen0, d = ranks[0][2]
    params1, seen1, _ = ranks[1][2]
    initial = dict(_gpt2_initial())
    # the same parameters on both ranks, and they moved
    assert all(torch.equal(a, b) for a, b in zip(params0, params1))
    assert any(not torch.equal(a, b) for a, b in zip(params0, initial.values()))
    grads0, stats0 = seen0[0::2], seen0[1::2]
    grads1 = seen1[0::2]
    assert len(stats0) == STEPS
    # the gradients seen by step() are each rank's own: no all-reduce averaged them
    assert all(g0 != g1 for g0, g1 in zip(grads0, grads1))
    for s in stats0:
        assert s.world_size == n and s.numel == d and not s.skipped
        # D-Lion's bytes: about 2 (n-1)/n * d/8 plus a few words per bucket, 1/32 of fp32
        assert s.bytes_sent <= (n - 1) / n * 2 * d / 8 + 64 * s.buckets + 8 * len(params0)
        assert s.bytes_sent < s.allreduce_fp32_bytes / 25


def _gpt2_initial():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    return GPT2LMHeadModel(config).named_parameters()
