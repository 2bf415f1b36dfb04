"""`RepoUsage`: what the repository costs in the store, against one file per version."""

from __future__ import annotations

from dataclasses import dataclass

from hapi.data.store import ObjectStore
from hapi.errors import ObjectNotFound
from hapi.repo.index.catalog import Catalog
from hapi.repo.storage.layout import MANIFESTS, TENSORS

__all__ = ["RepoUsage", "measure_usage"]


@dataclass(frozen=True, kw_only=True)
class RepoUsage:
    """Sizes in bytes."""

    versions: int
    """Visible versions."""
    blobs: int
    """Tensor blobs stored."""
    blob_bytes: int
    """Their total size."""
    manifest_bytes: int
    """Total size of the manifests."""
    logical_bytes: int
    """The versions' state dicts added up, as one file per version would store them."""

    @property
    def stored_bytes(self) -> int:
        return self.blob_bytes + self.manifest_bytes

    @property
    def dedup_ratio(self) -> float:
        """Logical bytes per stored byte (how many times smaller than one file each)."""
        return self.logical_bytes / self.stored_bytes if self.stored_bytes else 0.0


def measure_usage(store: ObjectStore, catalog: Catalog) -> RepoUsage:
    """Add up the store's blobs and manifests (one size request per object)."""
    blobs = list(store.list(TENSORS))
    manifests = list(store.list(MANIFESTS))
    versions = catalog.versions()
    return RepoUsage(
        versions=len(versions),
        blobs=len(blobs),
        blob_bytes=sum(_size(store, k) for k in blobs),
        manifest_bytes=sum(_size(store, k) for k in manifests),
        logical_bytes=sum(v.nbytes for v in versions),
    )


def _size(store: ObjectStore, key: str) -> int:
    try:
        return store.size(key)
    except ObjectNotFound:
        return 0  # removed since the listing
