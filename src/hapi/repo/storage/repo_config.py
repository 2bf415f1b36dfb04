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
    partial_age_s: float | None = None
    """On a local directory store, gc removes the staging file a killed write left
    (`<key>#<n>`) once unwritten for this long; None: `lock_ttl_s`. Lower only when no
    push can be paused that long."""
    verify: bool = True
    """Re-hash every tensor read from the store (detects corrupt and truncated blobs)."""
    relist_s: float = 30.0
    """Queries (`ls`, `find`, lineage) skip listing the store while its change token says
    nothing changed since the catalog's last listing, but list at least this often: it
    bounds how long a version stays unseen whose push died between its ref and the token,
    or was written by a hapi older than change tokens. 0 lists on every query."""
    compress: bool = False
    """Write tensors byte-grouped and zstd-compressed when that saves `min_saving` of
    their size. Off by default: a compressed blob needs hapi to decode it (a plain
    safetensors reader sees its packed bytes), and decoding costs CPU on a fast store.
    Readers decode every blob whatever this is set to."""
    deltas: bool = False
    """With `compress`: write a tensor that changed from the parent's tensor of the same
    name, dtype and shape as the compressed XOR of the two, when that is smaller."""
    compress_whole: bool = True
    """With `compress`: compress tensors stored whole too, not only deltas. False keeps
    them plain safetensors files, which any tool reads and hapi reads without decoding: a
    fine-tune's head (the tensors it shares with its base) then pulls at plain speed, and
    only the tensors fine-tunes changed are stored compressed, as deltas (needs
    `deltas`). Inflating the one plane of a float that compresses costs about a sixth of a
    plain head pull's CPU, so compressed heads pull 1.2-1.3x slower."""
    max_delta_depth: int = 3
    """The longest chain of deltas a push writes: a tensor whose parent's tensor is this
    deep is stored whole. Reading a tensor at depth N reads N + 1 blobs."""
    min_saving: float = 0.1
    """The fraction of a plain blob's size compression must save for a tensor to be
    stored compressed (0.1: at most 90% of it)."""

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise InvalidRequest(
                f"concurrency must be >= 1 (blob transfers in flight), got {self.concurrency}"
            )
        if self.lock_ttl_s <= 0:
            raise InvalidRequest(f"lock_ttl_s must be > 0 seconds, got {self.lock_ttl_s}")
        if self.relist_s < 0:
            raise InvalidRequest(f"relist_s must be >= 0 seconds, got {self.relist_s}")
        if self.deltas and not self.compress:
            raise InvalidRequest("deltas=True needs compress=True: a delta is stored compressed")
        if not self.compress_whole and not self.deltas:
            raise InvalidRequest(
                "compress_whole=False compresses only deltas: set deltas=True (and "
                "compress=True), or leave compress_whole at True"
            )
        if self.max_delta_depth < 1:
            raise InvalidRequest(
                f"max_delta_depth must be >= 1 (use deltas=False for none), got "
                f"{self.max_delta_depth}"
            )
        if not 0.0 <= self.min_saving < 1.0:
            raise InvalidRequest(
                f"min_saving must be in [0, 1) (a fraction of a blob), got {self.min_saving}"
            )
        if self.partial_age_s is not None and self.partial_age_s < 0:
            raise InvalidRequest(
                f"partial_age_s must be >= 0 seconds (or None: lock_ttl_s), got "
                f"{self.partial_age_s}"
            )
        if self.lock_wait_s < 0:
            raise InvalidRequest(f"lock_wait_s must be >= 0 seconds, got {self.lock_wait_s}")
