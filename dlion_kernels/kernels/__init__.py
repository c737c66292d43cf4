"""Floor 1: the fused stages on every backend (see ``backends.py``)."""
