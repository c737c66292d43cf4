"""The training demos: ``python -m dlion_kernels.demo`` (digits on N gloo workers)."""
