"""Where hapi keeps what it can rebuild - features, shard indexes, profiles, repository
catalogs: `$HAPI_CACHE_DIR`, else `~/.cache/hapi`. Worked out here, and only here."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_home"]


def cache_home(kind: str = "") -> Path:
    """`$HAPI_CACHE_DIR/<kind>` (read at each call: a test or a job may set it), or
    `~/.cache/hapi/<kind>`."""
    base = Path(os.environ.get("HAPI_CACHE_DIR") or Path.home() / ".cache" / "hapi")
    return base / kind if kind else base
