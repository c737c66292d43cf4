"""A named strategy (``strategies.py``) built on one rank: the one place that turns a slug into
optimizers, wrappers and hooks, for the demo and ``bench/bench_training.py`` alike.

    built = build("dlion-vote-overlap", model, Settings(lion_lr=3e-4, bucket_mb=0.25))
    for x, y in data:
        built.zero_grad()
        loss = loss_fn(built(x), y)    # through the wrapper (DDP, gossip) if the strategy has one
        loss.backward()
        sent = built.step()            # the exchange and the update; the bytes this rank sent
    built.finish()                     # outstanding gossip

Every rank builds the same strategies in the same order (building is collective: DDP broadcasts
the parameters, topologies and hierarchies create process groups).

The package, one job per module:

- ``settings.py``: ``Settings``, what every strategy of a comparison shares;
- ``built.py``: ``Built``, one strategy on one rank (step, bytes, memory, evaluation);
- ``groups.py``: the process groups and the device mesh the builders create, once each;
- ``wrapping.py``: how a model is wrapped (DDP; FSDP2 and HSDP on the N x L mesh);
- ``baselines.py``: what D-Lion is compared with (plain Lion / AdamW on one rank, DDP's
  compressing and hierarchical comm hooks, Lion on HSDP's shards);
- ``builders.py``: ``build`` and one builder per family (``BUILDERS``: allreduce, local, dlion,
  fsdp, decentralized, diloco); a new family adds its builder there and its entries to
  ``strategies.py``.

The bytes of the collectives torch runs (DDP's all-reduce, FSDP2's) come from
``accounting.py``.
"""

from .builders import BUILDERS, build
from .built import Built
from .settings import Settings

__all__ = ["BUILDERS", "Built", "Settings", "build"]
