"""`Snapshot`: every visible version in memory, indexed for the queries.

Turning SQLite rows into `ModelVersion`s costs tens of microseconds a row in Python, so a
query that answers thousands of versions from SQL cannot answer in milliseconds. The
catalog therefore keeps one snapshot per process, built in one query when its contents
changed (`Catalog.snapshot`), and queries scan or index it in memory, EvoStore's answer
at this scale. SQL still narrows what is small and indexed there (module trees).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Sequence

from hapi.repo.index.version import ModelVersion

__all__ = ["Snapshot"]


class Snapshot:
    """The visible versions, newest first, with their module-tree ids and indexes."""

    def __init__(self, rows: Sequence[tuple[ModelVersion, str | None]]) -> None:
        self.versions = [v for v, _ in rows]
        """Every visible version, newest first."""
        self.arch = {v.id: a for v, a in rows}
        """Version id -> its module tree's id (None without one)."""
        self.by_id = {v.id: v for v in self.versions}
        self.children: dict[str, list[ModelVersion]] = {}
        """Parent id -> the versions derived from it, oldest first."""
        self.tagged: dict[str, list[ModelVersion]] = {}
        newest: dict[str, ModelVersion] = {}
        for v in reversed(self.versions):
            if v.parent is not None:
                self.children.setdefault(v.parent, []).append(v)
            if v.name not in newest or v.version > newest[v.name].version:
                newest[v.name] = v
        self._places: dict[str, list[int]] = {}
        for i, (v, arch) in enumerate(rows):
            for tag in v.tags:
                self.tagged.setdefault(tag, []).append(v)
            if arch is not None:
                self._places.setdefault(arch, []).append(i)
        self.latest = [newest[n] for n in sorted(newest)]
        """The newest version of every name, by name."""
        self._names = sorted((v.name, i) for i, v in enumerate(self.versions))

    def of_trees(self, archs: Iterable[str]) -> list[ModelVersion]:
        """The versions whose module trees are `archs`, newest first."""
        places = [self._places[a] for a in archs if a in self._places]
        merged = places[0] if len(places) == 1 else sorted(itertools.chain(*places))
        return [self.versions[i] for i in merged]

    def named(self, prefix: str) -> list[ModelVersion]:
        """Versions whose name starts with `prefix`, newest first."""
        lo = bisect.bisect_left(self._names, (prefix, -1))
        hi = bisect.bisect_left(self._names, (prefix + "\U0010ffff", -1))
        return [self.versions[i] for i in sorted(i for _, i in self._names[lo:hi])]

    def ancestors(self, version: ModelVersion) -> list[ModelVersion]:
        """Parent, grandparent, ... up to the first version with no visible parent."""
        out: list[ModelVersion] = []
        seen = {version.id}
        parent = version.parent
        while parent and parent not in seen and parent in self.by_id:
            found = self.by_id[parent]
            out.append(found)
            seen.add(parent)
            parent = found.parent
        return out
