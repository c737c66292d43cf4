"""The training demos: ``python -m dlion_kernels.demo`` (digits on N gloo workers) and
``python -m dlion_kernels.demo --task chars`` (a character-level transformer on the standard
library's source); ``common.py`` holds what they share (strategies, launcher)."""
