"""``Settings``: what every strategy of a comparison shares (hyper-parameters, the job's
layout), checked when made."""

from __future__ import annotations

from dataclasses import dataclass

from ..accounting import BUCKET_MB


@dataclass(frozen=True)
class Settings:
    """What every strategy of a comparison shares: hyper-parameters and the job's layout."""

    lion_lr: float = 1e-4  # Lion, D-Lion, AccumLion
    adamw_lr: float = 1e-3  # AdamW, AccumAdamW
    weight_decay: float = 0.0
    backend: str | None = None  # dlion_kernels backend (None: the fastest available)
    accum_steps: int | None = None  # K of AccumAdamW / AccumLion; None: the number of ranks
    bucket_mb: float = BUCKET_MB  # DDP's buckets, D-Lion's overlap buckets, the gossip buckets
    ranks_per_node: int = 1  # L: the nodes of hierarchies and alternating-exp-ring
    sync_every: int = 8  # DiLoCo's H: inner steps between two syncs of a fragment
    fragments: int = 1  # DiLoCo's P (Streaming DiLoCo's fragments; H a multiple of P)
    # diloco-dlion's outer lr, also diloco-dlion-ef's and -ef-decay's (None: DiLoCo's default)
    diloco_dlion_lr: float | None = None
    diloco_nesterov_lr: float | None = None  # diloco-nesterov's outer lr (None: DiLoCo's)
    # diloco-dlion-ef-scale's outer lr (a scaled step: a fraction of 1) and diloco-sparseloco's
    diloco_scaled_lr: float = 1.0
    diloco_sparseloco_lr: float | None = None  # None: DiLoCo's default for SparseLoCo (1.0)

    def __post_init__(self):
        # the rest is checked by the optimizers and wrappers that take it
        _check_count("ranks_per_node", self.ranks_per_node)
        _check_count("sync_every", self.sync_every)
        _check_count("fragments", self.fragments)
        if self.sync_every % self.fragments:
            raise ValueError(f"Settings.sync_every ({self.sync_every}) must be a multiple of "
                             f"Settings.fragments ({self.fragments})")
        if self.accum_steps is not None:
            _check_count("accum_steps", self.accum_steps)


def _check_count(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"Settings.{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"Settings.{name} must be >= 1, got {value}")
