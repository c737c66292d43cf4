"""``python -m dlion_kernels.demo``: the one entry point of the demo. ``--task`` picks the task
(``digits``, the default, or ``chars``); the task parses the rest of the command line (so
``--task chars --help`` lists the chars options). The tasks share ``common.py`` and never import
each other."""

from __future__ import annotations

from . import chars, digits
from .common import task_of

MAINS = {"digits": digits.main, "chars": chars.main}


def main(argv=None):
    """Run the task that ``--task`` names on argv; returns its rows (None on ranks > 0 under
    torchrun)."""
    return MAINS[task_of(argv) or "digits"](argv)
