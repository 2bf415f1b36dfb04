"""`ModelDiff`: which tensors two versions do not share."""

from __future__ import annotations

from dataclasses import dataclass

from hapi.repo.index.version import ModelVersion
from hapi.repo.storage.manifest import VersionManifest

__all__ = ["ModelDiff", "diff_manifests"]


@dataclass(frozen=True, kw_only=True)
class ModelDiff:
    """The difference from version `a` to version `b`."""

    a: ModelVersion
    b: ModelVersion
    changed: tuple[str, ...] = ()
    """Keys in both whose tensors differ (values, dtype or shape)."""
    added: tuple[str, ...] = ()
    """Keys only in `b`."""
    removed: tuple[str, ...] = ()
    """Keys only in `a`."""
    same: int = 0
    """Keys in both with equal tensors."""
    changed_bytes: int = 0
    """Raw bytes of `b`'s changed and added tensors: what storing `b` after `a` costs."""
    shared_layers: int = 0
    """Leading layers with the same architecture (class, settings, shapes)."""

    @property
    def identical(self) -> bool:
        return not (self.changed or self.added or self.removed)


def diff_manifests(
    a: ModelVersion, ma: VersionManifest, b: ModelVersion, mb: VersionManifest
) -> ModelDiff:
    """Compare two versions' manifests (no tensor is read: hashes decide)."""
    changed = [k for k in ma.tensors if k in mb.tensors and ma.tensors[k] != mb.tensors[k]]
    added = [k for k in mb.tensors if k not in ma.tensors]
    removed = [k for k in ma.tensors if k not in mb.tensors]
    shared = 0
    for la, lb in zip(ma.layers, mb.layers, strict=False):
        if la.layer != lb.layer:
            break
        shared += 1
    return ModelDiff(
        a=a,
        b=b,
        changed=tuple(changed),
        added=tuple(added),
        removed=tuple(removed),
        same=len(ma.tensors) - len(changed) - len(removed),
        changed_bytes=sum(mb.tensors[k].nbytes for k in (*changed, *added)),
        shared_layers=shared,
    )
