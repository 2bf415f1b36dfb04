"""Store keys and prefixes: which keys a prefix holds."""

from __future__ import annotations

__all__ = ["key_under"]


def key_under(key: str, prefix: str) -> bool:
    """Whether `key` lies under `prefix` segment-wise: `a/b` holds `a/b` and `a/b/c`, not
    `a/bc`; the empty prefix holds every key. `prefix` has no leading or trailing `/`."""
    return prefix == "" or key == prefix or key.startswith(prefix + "/")
