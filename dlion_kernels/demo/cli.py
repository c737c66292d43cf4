"""``python -m dlion_kernels.demo``: the one entry point of the demo. ``--task`` picks the task
(``digits``, the default, or ``chars``); the task parses the rest of the command line (so
``--task chars --help`` lists the chars options). The tasks share ``common.py`` and never import
each other. ``--task chars --elastic`` runs the chars task on torchft's quorum
(``elastic.py``), ``--task chars --sites`` across sites, the whole stack (``sites.py``)."""

from __future__ import annotations

import argparse

from . import chars, digits
from .common import task_of

MAINS = {"digits": digits.main, "chars": chars.main}


def main(argv=None):
    """Run the task that ``--task`` names on argv; returns its rows (None on ranks > 0 under
    torchrun)."""
    task = task_of(argv) or "digits"
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--elastic", action="store_true")
    pre.add_argument("--sites", action="store_true")
    known = pre.parse_known_args(argv)[0]
    if task == "chars" and known.sites:
        from . import sites  # imports torchft when it runs

        return sites.main(argv)
    if task == "chars" and known.elastic:
        from . import elastic  # imports torchft when it runs

        return elastic.main(argv)
    return MAINS[task](argv)
