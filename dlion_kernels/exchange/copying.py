"""What survives ``copy.deepcopy``, ``pickle`` and ``torch.save`` / ``torch.load`` of the
library's optimizers and wrappers (shared by every front end of floor 3).

``torch.optim.Optimizer.__getstate__`` keeps only ``defaults``, ``state`` and ``param_groups``,
so options set in ``__init__`` (``mode``, ``votes``, ...) would be lost. ``Copyable`` keeps them:

- every *public* attribute (no leading underscore) is an option and travels with the copy,
  except one that shadows a class attribute (an LR scheduler patches ``opt.step`` with a wrapper
  bound to the original: a copy must keep its own method);
- *private* attributes are runtime state (hooks, buckets, streams, caches): an ``Optimizer``
  copy does not carry them, so the class must rebuild them lazily on first use;
- a process group cannot be pickled. ``copy.deepcopy`` keeps the same group object (a copy in
  the same process talks to the same ranks). ``pickle`` / ``torch.save`` store ``None`` for
  ``None`` and the default (WORLD) group, looked up again when the copy first steps; any other
  group becomes a ``DetachedGroup``, and ``attached_group`` raises a clear error on the copy's
  first use until the user assigns the group again (``opt.group = my_group``).

Use: ``class MyOptimizer(Copyable, torch.optim.Optimizer)`` (or an ``nn.Module`` wrapper), and
pass every group through ``attached_group(self.group, self)`` before using it.
"""

from __future__ import annotations

import torch.distributed as dist


class DetachedGroup:
    """Stands in for an explicit process group in a pickled copy; using it raises."""

    def __init__(self, description: str):
        self.description = description

    def __repr__(self) -> str:
        return f"DetachedGroup({self.description})"


def _describe(group) -> str:
    try:
        return f"ranks {dist.get_process_group_ranks(group)}"
    except Exception:  # not a member, or torch.distributed torn down: still pickle
        return "a process group that is not the default one"


def _detached(description: str):
    return DetachedGroup(description) if description is not None else None


class _GroupRef:
    """A process group inside a copied state: deepcopy keeps the object, pickle detaches it."""

    def __init__(self, group):
        self.group = group

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        if self.group is _world():
            return (_detached, (None,))  # the default group: looked up again on use
        return (_detached, (_describe(self.group),))


def _world():
    return dist.group.WORLD if dist.is_available() else None


def _is_group(value) -> bool:
    return dist.is_available() and isinstance(value, dist.ProcessGroup)


def export_state(state: dict) -> dict:
    """For ``__getstate__``: wrap the process groups among the top-level values."""
    return {k: _GroupRef(v) if _is_group(v) else v for k, v in state.items()}


def import_state(state: dict) -> dict:
    """For ``__setstate__``: unwrap what ``export_state`` wrapped (a deepcopy's groups)."""
    return {k: v.group if isinstance(v, _GroupRef) else v for k, v in state.items()}


def attached_group(group, owner):
    """``group`` itself, or a clear error when it is a ``DetachedGroup`` of a pickled copy."""
    if isinstance(group, DetachedGroup):
        raise RuntimeError(
            f"this {type(owner).__name__} was restored by pickle/torch.load with an explicit "
            f"process group ({group.description}); process groups cannot be pickled. Assign "
            "it again before the first step: `opt.group = my_group` (None and the default "
            "group are looked up again by themselves)"
        )
    return group


class Copyable:
    """Mixin: public attributes (the options) survive deepcopy, pickle and torch.save."""

    def __getstate__(self):
        parent = getattr(super(), "__getstate__", None)  # object has none before Python 3.11
        state = dict(parent() if parent is not None else vars(self))
        for name, value in vars(self).items():
            # A public instance attribute that shadows the class (an LR scheduler's or
            # Accelerate's wrapper around ``step``, bound to *this* object) is not an option.
            if not name.startswith("_") and name not in state and not hasattr(type(self), name):
                state[name] = value
        return export_state(state)

    def __setstate__(self, state):
        super().__setstate__(import_state(state))
