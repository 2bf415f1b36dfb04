"""Delta markers: which stored blobs are deltas against which tensors (`deltas/<h>/<b>`).

`gc` and `fsck` need a delta's base kept and counted as referenced; reading every blob's
header to learn it would cost a read per blob, so each delta blob has an empty marker
object whose key names both, and one listing finds them all.
"""

from __future__ import annotations

from collections.abc import Iterable

from hapi.data.store import ObjectStore
from hapi.repo.storage.layout import DELTAS, parse_delta_key

__all__ = ["read_markers", "with_bases"]


def read_markers(store: ObjectStore) -> dict[str, set[str]]:
    """Blob hash -> the hashes of the tensors it may be a delta against (more than one
    when concurrent pushes wrote it, or a repaired blob was written again)."""
    marks: dict[str, set[str]] = {}
    for key in store.list(DELTAS):
        parsed = parse_delta_key(key)
        if parsed is not None:
            marks.setdefault(parsed[0], set()).add(parsed[1])
    return marks


def with_bases(referenced: Iterable[str], markers: dict[str, set[str]]) -> set[str]:
    """`referenced` and every base a delta among them needs, however deep the chain."""
    needed = set(referenced)
    stack = list(needed)
    while stack:
        for base in markers.get(stack.pop(), ()):
            if base not in needed:
                needed.add(base)
                stack.append(base)
    return needed
