"""The one exception the kernel floor raises about availability (shared by backends and native)."""


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run here; the message says why and how to get it."""
