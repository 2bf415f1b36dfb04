"""`RepoConfig`: the repository's settings."""

from __future__ import annotations

from dataclasses import dataclass

from hapi.errors import InvalidRequest

__all__ = ["RepoConfig"]


@dataclass(frozen=True, kw_only=True)
class RepoConfig:
    """How a `ModelRepo` talks to its store."""

    concurrency: int = 16
    """Blob reads and writes in flight at once."""
    lock_ttl_s: float = 600.0
    """A push or gc lock not refreshed for this long is stale (its process died). Must
    exceed the clock skew between machines sharing the repository plus the longest pause
    of a live process; pushes refresh their lock four times per period. A lock whose
    process is seen to be gone (same machine, pid not running) is stale at once."""
    lock_wait_s: float = 60.0
    """How long a push waits for a running gc to finish before giving up."""
    verify: bool = True
    """Re-hash every tensor read from the store (detects corrupt and truncated blobs)."""

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise InvalidRequest(
                f"concurrency must be >= 1 (blob transfers in flight), got {self.concurrency}"
            )
        if self.lock_ttl_s <= 0:
            raise InvalidRequest(f"lock_ttl_s must be > 0 seconds, got {self.lock_ttl_s}")
        if self.lock_wait_s < 0:
            raise InvalidRequest(f"lock_wait_s must be >= 0 seconds, got {self.lock_wait_s}")
