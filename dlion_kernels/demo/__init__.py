"""The training demos: ``python -m dlion_kernels.demo`` (digits on N gloo workers) and
``python -m dlion_kernels.demo --task chars`` (a character-level transformer on the standard
library's source). ``cli.py`` picks the task, ``common.py`` holds what the tasks share; the
strategies come from ``dlion_kernels/strategies.py`` and are built by ``dlion_kernels/recipes/``."""
