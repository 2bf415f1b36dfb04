"""Lineage: who was derived from whom, from the parent ids manifests record."""

from __future__ import annotations

from dataclasses import dataclass

from hapi.repo.index.catalog import Catalog
from hapi.repo.index.version import ModelVersion

__all__ = ["LineageNode", "ancestors", "descendants", "forest", "lineage_tree"]


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
    return catalog.snapshot().ancestors(version)


def descendants(catalog: Catalog, version: ModelVersion) -> list[ModelVersion]:
    """Every version derived from `version`, directly or not, depth first."""
    return lineage_tree(catalog, version).walk()[1:]


def lineage_tree(catalog: Catalog, version: ModelVersion) -> LineageNode:
    """The tree of versions derived from `version`."""
    return forest(catalog, [version])[0]


def forest(catalog: Catalog, roots: list[ModelVersion]) -> list[LineageNode]:
    """The trees of versions derived from each of `roots`, children oldest first. A
    removed version ends its branch: the versions below it are roots of their own."""
    children = catalog.snapshot().children
    nodes: dict[str, LineageNode] = {}

    def grow(root: ModelVersion) -> LineageNode:
        # Without recursion: a chain of thousands of fine-tunes is a tree that deep.
        order, stack, seen = [], [root], set()
        while stack:
            v = stack.pop()
            if v.id not in seen and v.id not in nodes:
                seen.add(v.id)
                order.append(v)
                stack.extend(children.get(v.id, []))
        for v in reversed(order):  # children before their parent
            kids = tuple(nodes[c.id] for c in children.get(v.id, []) if c.id in nodes)
            nodes[v.id] = LineageNode(v, kids)
        return nodes[root.id]

    return [grow(root) for root in roots]
