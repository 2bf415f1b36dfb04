"""Architecture queries over the catalog: by module classes and by shared leading layers."""

from __future__ import annotations

from dataclasses import dataclass

from hapi.repo.catalog import Catalog
from hapi.repo.version import ModelVersion

__all__ = ["PrefixMatch", "containing", "prefix_matches"]

# Keeps each IN (...) list well under SQLite's limit on bound parameters.
_CHUNK = 500


@dataclass(frozen=True)
class PrefixMatch:
    """A stored version that starts with the same layers as a given model."""

    version: ModelVersion
    """The stored version."""
    layers: int
    """How many leading layers the two share (same class, settings and tensor shapes)."""
    of: int
    """How many layers the given model has."""

    @property
    def ref(self) -> str:
        return self.version.ref


def prefix_matches(
    catalog: Catalog, layer_ids: list[str], min_layers: int = 1
) -> list[PrefixMatch]:
    """Versions sharing at least `min_layers` leading layers with a model whose layer
    identities are `layer_ids`; most shared layers first, then newest first.

    Layer identities chain, so a version holding identity `i` shares the whole prefix up to
    `i`: the depth of its deepest matching identity is the length of the shared prefix.
    """
    depth: dict[str, int] = {}
    for start in range(0, len(layer_ids), _CHUNK):
        chunk = layer_ids[start : start + _CHUNK]
        marks = ",".join("?" * len(chunk))
        rows = catalog.query(
            f"SELECT manifest, MAX(layer) FROM modules WHERE layer_id IN ({marks}) "
            "GROUP BY manifest",
            chunk,
        )
        for mid, layer in rows:
            depth[mid] = max(depth.get(mid, 0), int(layer))
    matches = []
    for mid, layers in depth.items():
        version = catalog.version_of(mid)
        if version is not None and layers >= min_layers:
            matches.append(PrefixMatch(version, layers, len(layer_ids)))
    # Two stable sorts: newest first, then most shared layers first.
    matches.sort(key=lambda m: m.version.created, reverse=True)
    matches.sort(key=lambda m: m.layers, reverse=True)
    return matches


def containing(catalog: Catalog, classes: list[str]) -> list[ModelVersion]:
    """Versions with modules of `classes`: one class matches any module of that class; a
    sequence matches that many consecutive layers. Names are a class's own name
    (`Conv2d`) or its full `module.qualname`."""
    if not classes:
        return catalog.versions()
    first = classes[0]
    candidates = {
        r[0]
        for r in catalog.query(
            "SELECT DISTINCT manifest FROM modules WHERE short_cls = ? OR cls = ?", (first, first)
        )
    }
    found = []
    for mid in sorted(candidates):
        version = catalog.version_of(mid)
        if version is None:
            continue
        if len(classes) == 1:
            found.append(version)
            continue
        rows = catalog.query(
            "SELECT short_cls, cls FROM modules WHERE manifest = ? AND layer IS NOT NULL "
            "ORDER BY layer",
            (mid,),
        )
        if _has_run(rows, classes):
            found.append(version)
    return found


def _has_run(rows: list[tuple[str, str]], classes: list[str]) -> bool:
    n = len(classes)
    for i in range(len(rows) - n + 1):
        if all(c in rows[i + j] for j, c in enumerate(classes)):
            return True
    return False
