"""``register_ddp_comm_hook``: D-Lion for models wrapped in DistributedDataParallel.

Hugging Face Trainer, Accelerate and Lightning wrap the model in DDP themselves. With this hook
DDP's own buckets run the D-Lion exchange instead of the gradient all-reduce: when DDP has a
bucket's gradients (in its flat buffer, during backward, in the same bucket order on every rank),
the hook starts that bucket's check, local step and ``all_to_all`` (``DistributedLion``'s
bucket path, ``exchange/pipeline.py``; on gloo the tally and gather of every earlier bucket whose
``all_to_all`` is complete follow, without waiting for any), and ``opt.step()`` finishes the
exchanges and applies.

The hook returns a completed future holding DDP's own buffer, untouched: DDP copies it back into
``.grad``, so every rank keeps its *local* gradient (its momentum needs exactly that), and no
all-reduce runs. DDP's ``no_sync()``, ``find_unused_parameters`` (an unused parameter's gradient
is zero in the buffer, which D-Lion counts like ``None``) and ``static_graph`` work as usual.
Parameters of the optimizer that no DDP bucket carried this step are exchanged by ``step()``.

A mistake found by the hook on one rank only (an invalid lr or betas set there before backward)
never raises inside DDP's backward: that rank sends this and every later bucket flagged "gave
up", and ``step()`` raises the same error on every rank, naming it, with nothing applied.
"""

import torch
import torch.distributed as dist

from .dlion import DistributedLion


# DDP checks these annotations (so no ``from __future__ import annotations`` here).
def _dlion_hook(
    opt: DistributedLion, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    try:
        opt.exchange_bucket(bucket.parameters(), bucket.gradients())
    except (TypeError, ValueError):
        # Bad input or a wrong setting found on this rank only: the bucket went out flagged
        # "gave up", and so do the step's later buckets. Raising here would stop this rank's
        # backward, with DDP's reducer mid-iteration, while the others wait for the buckets it
        # never sends: step() raises instead, the same error on every rank.
        pass
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def register_ddp_comm_hook(ddp_model, opt) -> None:
    """Make ``ddp_model``'s gradient buckets run ``opt``'s D-Lion exchange instead of the
    all-reduce; call ``opt.step()`` after ``backward()`` as usual.

    ddp_model: a ``torch.nn.parallel.DistributedDataParallel``.
    opt: a ``DistributedLion`` over exactly the wrapped model's trainable parameters, on DDP's
        process group. Its mode, votes, lr, betas and weight decay apply; its ``overlap``
        setting does not matter (DDP's buckets decide; its own hooks are removed).
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError("ddp_model must be a torch.nn.parallel.DistributedDataParallel, got "
                        f"{type(ddp_model).__name__}")
    if not isinstance(opt, DistributedLion):
        raise TypeError(f"opt must be a dlion_kernels.DistributedLion, got {type(opt).__name__}")
    if opt.elastic is not None:
        raise ValueError("a DistributedLion with manager= cannot run in DDP's comm hook: its "
                         "vote runs between torchft's replicas, over the group of each quorum, "
                         "while DDP's buckets belong to DDP's process group; use it without DDP "
                         "(a replica of several ranks: FSDP2 or hierarchy=L)")
    if opt.sharded:
        raise ValueError("a DistributedLion over FSDP2 parameters (device_mesh) cannot run in "
                         "DDP's comm hook: FSDP2 reduces the gradients itself; call opt.step() "
                         "after backward, without DDP")
    if opt.ddp_hooked:
        raise RuntimeError("opt already runs the D-Lion exchange of a DDP model")
    if opt.ranks_per_node > 1:
        raise ValueError("a DistributedLion with hierarchy (L > 1) cannot run in DDP's comm "
                         "hook yet: use it without DDP's gradient sync")
    group = opt.group if opt.group is not None else dist.group.WORLD
    if group is not ddp_model.process_group and not (
        dist.get_world_size(group) == dist.get_world_size(ddp_model.process_group)
        and dist.get_process_group_ranks(group)
        == dist.get_process_group_ranks(ddp_model.process_group)
    ):
        raise ValueError("opt.group must be the DDP model's process group "
                         "(DistributedLion(..., group=ddp_model.process_group))")
    mine = {id(p) for g in opt.param_groups for p in g["params"] if p.requires_grad}
    theirs = {id(p) for p in ddp_model.parameters() if p.requires_grad}
    if mine != theirs:
        raise ValueError(
            f"opt must hold exactly the DDP model's trainable parameters: {len(mine - theirs)} "
            f"of opt's are not in the model and {len(theirs - mine)} of the model's are not in "
            "opt")
    ddp_model.register_comm_hook(opt, _dlion_hook)  # DDP raises if a hook is already set
    opt.attach_ddp_hook()
