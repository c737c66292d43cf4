"""The runtime model: predicted step time of every strategy, and the fastest.

``predict`` needs numbers only; nothing here imports torch. ``python -m dlion_kernels.plan
--measure`` (``measure.py``) alone imports torch and the exchange to calibrate on a real group.
"""

from .model import (
    Calibration,
    Row,
    best,
    choose_hierarchy,
    choose_strategy,
    expected_max,
    inputs_from_json,
    parse_size,
    predict,
    rank_strategies,
)

__all__ = [
    "Calibration",
    "Row",
    "best",
    "choose_hierarchy",
    "choose_strategy",
    "expected_max",
    "inputs_from_json",
    "parse_size",
    "predict",
    "rank_strategies",
]
