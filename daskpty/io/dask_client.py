"""The distributed client the io layer may use for its own chunked work (validation, writing)."""
from __future__ import annotations


def current_client():
    """The active ``distributed.Client`` or None (distributed is imported only when asked)."""
    try:
        from distributed import get_client  # lazy: io imports distributed only when asked

        return get_client()
    except ValueError:
        return None
