"""Queries over the catalog: by name, tag, module classes and shared leading layers.

Architecture queries work on module trees, not versions: the catalog keeps each distinct
tree once (`catalog.arch_id`), so a query checks in SQL the few dozen trees of a
repository of thousands of versions, then takes the versions of the trees that match from
the catalog's in-memory snapshot (`snapshot.py`), as the name and tag filters do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase

from hapi.repo.index.catalog import Catalog
from hapi.repo.index.version import ModelVersion

__all__ = ["PrefixMatch", "find_versions", "prefix_matches"]

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


def find_versions(
    catalog: Catalog,
    *,
    name: str | None = None,
    tag: str | None = None,
    contains: Sequence[str] | None = None,
    layer_ids: list[str] | None = None,
    min_layers: int = 1,
) -> list[ModelVersion]:
    """Versions matching every condition given (see `ModelRepo.find`): by shared prefix
    (most shared first) when `layer_ids` is given, else newest first."""
    snap = catalog.snapshot()
    archs = _archs_containing(catalog, list(contains)) if contains else None
    # Start from the narrowest index at hand, then filter by the other conditions.
    if layer_ids is not None:
        found = [m.version for m in prefix_matches(catalog, layer_ids, min_layers)]
    elif tag is not None:
        found = snap.tagged.get(tag, [])
    elif name is not None:
        found = snap.named(_literal_prefix(name))
    elif archs is not None:
        found, archs = snap.of_trees(archs), None  # nothing left to filter by
    else:
        found = snap.versions
    if archs is not None:
        found = [v for v in found if snap.arch.get(v.id) in archs]
    if tag is not None:
        found = [v for v in found if tag in v.tags]
    if name is not None:
        found = [v for v in found if fnmatchcase(v.name, name)]
    return list(found)


def prefix_matches(
    catalog: Catalog, layer_ids: list[str], min_layers: int = 1
) -> list[PrefixMatch]:
    """Versions sharing at least `min_layers` leading layers with a model whose layer
    identities are `layer_ids`; most shared layers first, then newest first.

    Layer identities chain, so a tree holding identity `i` shares the whole prefix up to
    `i`: the depth of its deepest matching identity is the length of the shared prefix.
    """
    depth: dict[str, int] = {}
    for start in range(0, len(layer_ids), _CHUNK):
        chunk = layer_ids[start : start + _CHUNK]
        marks = ",".join("?" * len(chunk))
        rows = catalog.query(
            f"SELECT arch, MAX(layer) FROM modules WHERE layer_id IN ({marks}) GROUP BY arch",
            chunk,
        )
        for arch, layer in rows:
            depth[arch] = max(depth.get(arch, 0), int(layer))
    snap = catalog.snapshot()
    by_depth: dict[int, list[str]] = {}
    for arch, layers in depth.items():
        if layers >= min_layers:
            by_depth.setdefault(layers, []).append(arch)
    # The versions of the matching trees only, never a scan of every version.
    return [
        PrefixMatch(v, layers, len(layer_ids))
        for layers in sorted(by_depth, reverse=True)
        for v in snap.of_trees(by_depth[layers])
    ]


def _archs_containing(catalog: Catalog, classes: list[str]) -> set[str]:
    first = classes[0]
    archs = [
        r[0]
        for r in catalog.query(
            "SELECT DISTINCT arch FROM modules WHERE short_cls = ? OR cls = ?", (first, first)
        )
    ]
    if len(classes) > 1:
        archs = [a for a in archs if _has_run(_layers(catalog, a), classes)]
    return set(archs)


def _literal_prefix(pattern: str) -> str:
    for i, c in enumerate(pattern):
        if c in "*?[":
            return pattern[:i]
    return pattern


def _layers(catalog: Catalog, arch: str) -> list[tuple[str, str]]:
    return [
        (r[0], r[1])
        for r in catalog.query(
            "SELECT short_cls, cls FROM modules WHERE arch = ? AND layer IS NOT NULL "
            "ORDER BY layer",
            (arch,),
        )
    ]


def _has_run(rows: list[tuple[str, str]], classes: list[str]) -> bool:
    n = len(classes)
    for i in range(len(rows) - n + 1):
        if all(c in rows[i + j] for j, c in enumerate(classes)):
            return True
    return False
