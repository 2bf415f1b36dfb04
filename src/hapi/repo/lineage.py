"""Lineage: who was derived from whom, from the parent ids manifests record."""

from __future__ import annotations

from dataclasses import dataclass

from hapi.repo.catalog import Catalog
from hapi.repo.version import ModelVersion

__all__ = ["LineageNode", "ancestors", "descendants", "lineage_tree"]


@dataclass(frozen=True)
class LineageNode:
    """A version and the versions derived from it."""

    version: ModelVersion
    children: tuple[LineageNode, ...] = ()

    def walk(self) -> list[ModelVersion]:
        """This version and every descendant, depth first."""
        out = [self.version]
        for child in self.children:
            out.extend(child.walk())
        return out


def ancestors(catalog: Catalog, version: ModelVersion) -> list[ModelVersion]:
    """Parent, grandparent, ... up to the first version with no (stored) parent."""
    out: list[ModelVersion] = []
    seen = {version.id}
    parent = version.parent
    while parent and parent not in seen:
        found = catalog.version_of(parent)
        if found is None:
            break  # removed: the chain above it is no longer known
        out.append(found)
        seen.add(parent)
        parent = found.parent
    return out


def _children(catalog: Catalog, manifest_id: str) -> list[ModelVersion]:
    return catalog.versions(
        "m.id IN (SELECT child FROM edges WHERE parent = ?)", (manifest_id,), "m.created, m.id"
    )


def descendants(catalog: Catalog, version: ModelVersion) -> list[ModelVersion]:
    """Every version derived from `version`, directly or not, depth first."""
    return lineage_tree(catalog, version).walk()[1:]


def lineage_tree(catalog: Catalog, version: ModelVersion) -> LineageNode:
    """The tree of versions derived from `version`."""
    seen: set[str] = set()

    def grow(v: ModelVersion) -> LineageNode:
        seen.add(v.id)
        kids = [grow(c) for c in _children(catalog, v.id) if c.id not in seen]
        return LineageNode(v, tuple(kids))

    return grow(version)
