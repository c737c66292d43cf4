"""The runtime model on a running job: ``DistributedLion(hierarchy="auto")`` and the demo's
``--strategy auto``.

Both need predict()'s inputs for *this* job, and every rank must reach the same decision. So
rank 0 gets the inputs once and broadcasts them; every rank then calls the same pure function
of the same numbers (``choose_hierarchy``, ``rank_strategies``).

Where the inputs come from:

- ``$DLION_PLAN`` names the JSON that ``python -m dlion_kernels.plan --measure --json`` printed
  earlier on this cluster: read on rank 0, nothing is timed (start-up stays instant);
- otherwise the job calibrates now, on the default group (``measure``: links, collectives and
  compute; a few seconds, every rank takes part).
"""

from __future__ import annotations

import os

ENV = "DLION_PLAN"


def job_inputs(params: int, *, ranks_per_node: int | None = None, reps: int = 2) -> dict:
    """predict()'s keyword arguments for this job, identical on every rank, with ``ranks`` and
    ``ranks_per_node`` of the default group. Collective: every rank of the default group calls
    it. ``ranks_per_node``: L (None: from hostnames and $LOCAL_WORLD_SIZE)."""
    import torch.distributed as dist

    from . import measure, model

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("the runtime model needs an initialized default process group "
                           "(torch.distributed.init_process_group)")
    n, L = measure.layout(ranks_per_node)
    path = os.environ.get(ENV)
    if path:
        box = [None]
        if dist.get_rank() == 0:
            try:
                box[0] = model.inputs_from_json(path)
            except (OSError, ValueError) as e:  # every rank raises, none waits
                box[0] = f"${ENV}={path!r}: {e}"
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], str):
            raise ValueError(f"cannot read the runtime model's inputs from {box[0]}")
        inputs = box[0]
    else:
        box = [measure.measure(params, ranks_per_node=L, reps=reps)]  # None on ranks > 0
        dist.broadcast_object_list(box, src=0)
        inputs = {k: v for k, v in box[0].items() if k != "seconds"}
    inputs.update(ranks=n, ranks_per_node=L)
    return inputs


def hierarchy(params: int, *, mode: str, overlap: bool, group=None) -> int:
    """L for ``DistributedLion(hierarchy="auto")``: ranks per node when hierarchical D-Lion is
    predicted faster than flat D-Lion (same mode and overlap) on this job, else 1 (flat)."""
    import torch.distributed as dist

    from .model import choose_hierarchy

    if group is not None and group is not dist.group.WORLD:
        raise ValueError('hierarchy="auto" calibrates on the default process group: pass '
                         "group=None, or hierarchy=L / None with your own group")
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return 1  # one process: nothing to choose
    inputs = job_inputs(params)
    n, L = inputs.pop("ranks"), inputs.pop("ranks_per_node")
    return choose_hierarchy(n, L, params, mode=mode, overlap=overlap, **inputs)


def strategies(params: int, allowed=None, *, ranks_per_node: int | None = None, **overrides):
    """``rank_strategies`` on this job (the demo's ``--strategy auto``): (slug, predicted row) of
    the ``allowed`` strategies (slugs; None: every one the model predicts) that can run here,
    fastest first, the same on every rank. ``overrides`` replace calibrated inputs (e.g.
    ``bucket_mb``). Collective, as ``job_inputs``."""
    from .model import rank_strategies

    inputs = job_inputs(params, ranks_per_node=ranks_per_node)
    inputs.update(overrides)
    n, L = inputs.pop("ranks"), inputs.pop("ranks_per_node")
    return rank_strategies(params, n, L, allowed=allowed, **inputs)
