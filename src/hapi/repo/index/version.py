"""`ModelVersion`: what the repository reports about one stored model version."""

from __future__ import annotations

from dataclasses import dataclass, field

from hapi.repo.storage.manifest import VersionManifest

__all__ = ["ModelVersion", "PushedVersion"]


@dataclass(frozen=True, kw_only=True)
class ModelVersion:
    """One model version, as listed by `ModelRepo.log`, `ls`, `find` and friends."""

    id: str
    """The manifest id (64 hex digits)."""
    name: str
    """The model name."""
    version: int
    """Its number under `name` (1, 2, ...)."""
    parent: str | None
    """The id of the version it derives from."""
    created: str
    """ISO-8601 UTC time of the push."""
    tags: tuple[str, ...] = ()
    """Labels given at push time."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Numbers given at push time."""
    tensors: int = 0
    """State-dict entries."""
    nbytes: int = 0
    """Raw bytes of the state dict."""

    @property
    def ref(self) -> str:
        """A reference that names exactly this version (`name@3`)."""
        return f"{self.name}@{self.version}"

    @property
    def short_id(self) -> str:
        return self.id[:12]

    @classmethod
    def of(cls, manifest: VersionManifest, version: int) -> ModelVersion:
        """The version `version` that `manifest` is stored as."""
        return cls(
            id=manifest.id,
            name=manifest.name,
            version=version,
            parent=manifest.parent,
            created=manifest.created,
            tags=tuple(manifest.tags),
            metrics=dict(manifest.metrics),
            tensors=len(manifest.tensors),
            nbytes=manifest.nbytes,
        )


@dataclass(frozen=True, kw_only=True)
class PushedVersion(ModelVersion):
    """The version a push created, with what the push moved."""

    uploaded_tensors: int = 0
    """Blobs this push wrote (the rest were in the repository already)."""
    uploaded_bytes: int = 0
    """Bytes this push wrote to the store for blobs (safetensors headers included)."""
    unique_bytes: int = 0
    """Raw bytes of the version's distinct tensors, uploaded or already stored."""
    seconds: float = 0.0
    """Wall time of the push."""
