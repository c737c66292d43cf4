"""What D-Lion is compared with: plain Lion or AdamW on each rank alone (after DDP's
all-reduce), DDP's bf16 and hierarchical comm hooks (torch's own fp16 hook needs none), and Lion
on the shards of HSDP's parameters."""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from ..exchange.collectives import gather_into_tensor, reduce_scatter_into_tensor
from ..exchange.sharded import own_shard
from ..optim.dlion import DistributedLion
from .groups import solo_group
from .settings import Settings


def local_optimizer(name: str, params, s: Settings, group):
    """The optimizer ``name`` ("adamw" or "lion") on this rank alone."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=s.adamw_lr, weight_decay=s.weight_decay)
    # Plain Lion is D-Lion on a group of one with ternary votes (the exact sign).
    return DistributedLion(params, lr=s.lion_lr, votes="ternary", group=group,
                           weight_decay=s.weight_decay, backend=s.backend)


# ----------------------------------------------------------------------------- DDP's comm hooks


def bf16_hook(state, bucket):
    """DDP's all-reduce in bf16 (torch's bf16_compress_hook refuses gloo: "needs NCCL")."""
    buf = bucket.buffer()
    low = buf.to(torch.bfloat16).div_(dist.get_world_size())

    def back(fut):
        buf.copy_(fut.value()[0])
        return buf

    return dist.all_reduce(low, async_op=True).get_future().then(back)


@functools.cache
def _hier_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1)  # one thread: buckets in one order on every rank


def hier_hook(groups, bucket):
    """Reduce-scatter in the node, all-reduce of the shard across nodes, all-gather in the
    node, on one side thread (gloo's reduce-scatter work has no future to chain on)."""
    intra, inter = groups
    buf = bucket.buffer()
    fut = torch.futures.Future()
    gather = gather_into_tensor()
    scatter = reduce_scatter_into_tensor()

    def run():
        try:
            L = dist.get_world_size(intra)
            numel, pad = buf.numel(), (-buf.numel()) % L
            flat = torch.cat([buf, buf.new_zeros(pad)]) if pad else buf
            shard = flat.new_empty(flat.numel() // L)
            scatter(shard, flat, group=intra)
            dist.all_reduce(shard, group=inter)
            shard.div_(dist.get_world_size())
            gather(flat, shard, group=intra)
            if pad:
                buf.copy_(flat[:numel])
            fut.set_result(buf)
        except Exception as e:  # noqa: BLE001 - handed to DDP through the future
            fut.set_exception(e)

    _hier_pool().submit(run)
    return fut


# ----------------------------------------------------------------------------- HSDP


class ShardLion:
    """Plain Lion (``local_optimizer``, as lion-allreduce) on this rank's shards of HSDP's
    parameters, whose gradients FSDP2 has averaged over all n ranks: every replica of a shard
    takes the same step. DistributedLion refuses HSDP's (Replicate, Shard) DTensors (it would
    vote between the replicas itself), so it steps aliases of their local tensors (the same
    storage), made at the first step, after FSDP2's lazy initialization may have re-padded
    the shards."""

    def __init__(self, params, s: Settings):
        self.params, self.settings, self.inner = list(params), s, None

    @property
    def param_groups(self):
        return self.inner.param_groups if self.inner is not None else []

    @property
    def state(self):
        return self.inner.state if self.inner is not None else {}

    def step(self):
        if self.inner is None:
            aliases = [own_shard(p).detach().requires_grad_() for p in self.params]
            self.inner = local_optimizer("lion", aliases, self.settings, solo_group())
        for p, x in zip(self.params, self.inner.param_groups[0]["params"]):
            x.grad = own_shard(p.grad)
        self.inner.step()

    def zero_grad(self, set_to_none: bool = True):
        for p in self.params:
            p.grad = None
        if self.inner is not None:
            self.inner.zero_grad(set_to_none=True)
