"""`FeatureCache`: computed features in a directory, bounded in size, shared by processes.

Entries are packed in segments, per space (`<root>/v2/<space id>/`, `_segments.py`), each
entry checked by its CRC (a corrupt one is a miss); eviction works on whole segments,
least recently used first, and recent entries are also kept decoded in memory, up to
`memory_bytes`. A write that fails turns writing off for this cache, with one warning and
a count: a job never fails for its cache. Costs and details: `docs/architecture.md`,
"The feature cache".
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hapi._cache_home import cache_home
from hapi.cache._index import INDEX_SUFFIX, RECORD
from hapi.cache._memory_tier import MemoryTier
from hapi.cache._segments import SEGMENT_SUFFIX, SpaceSegments
from hapi.cache.space import FeatureSpace
from hapi.errors import InvalidRequest

__all__ = ["CacheStats", "FeatureCache", "SpaceUsage", "default_cache_root"]

log = logging.getLogger(__name__)

_VERSION_DIR = "v2"
_OLD_DIRS = ("v1",)
_SEGMENT_MAX = 64 << 20
"""Bytes a segment grows to at most (a 16th of a smaller bound: eviction's grain)."""


def default_cache_root() -> Path:
    """`$HAPI_CACHE_DIR/features`, or `~/.cache/hapi/features`."""
    return cache_home("features")


@dataclass
class CacheStats:
    """What a cache did since it was opened (this process's view)."""

    hits: int = 0
    memory_hits: int = 0
    """Hits served from memory, without reading the file (included in `hits`)."""
    misses: int = 0
    writes: int = 0
    evictions: int = 0
    """Entries evicted (whole segments of them)."""
    corrupt: int = 0
    """Entries that failed their checksum: counted as misses."""
    bytes_held: int = 0
    """Bytes on disk, as this process last counted them."""
    write_failures: int = 0
    """Entries not written because the directory refused them (full, read-only, no
    permission): the first turned writing off (`FeatureCache.write_error`)."""


@dataclass(frozen=True)
class SpaceUsage:
    """One space of a cache directory, for `hapi cache ls`."""

    id: str
    entries: int
    bytes: int
    described: dict[str, Any]


class FeatureCache:
    """Features by (space, sample) in a directory bounded to `max_bytes`.

    Args:
        root: the directory (created); None: `default_cache_root()`.
        max_bytes: the bound on the entries' bytes: the least recently used go beyond it.
        memory_bytes: decoded entries kept in this process's memory, most recent first.

    Raises:
        InvalidRequest: a bound below 1 byte, or a root that is not a directory.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        max_bytes: int = 10 << 30,
        memory_bytes: int = 256 << 20,
    ) -> None:
        if max_bytes < 1 or memory_bytes < 0:
            raise InvalidRequest(
                f"cache_size must be >= 1 byte and memory >= 0, got {max_bytes} and {memory_bytes}"
            )
        self.root = Path(root) if root is not None else default_cache_root()
        if self.root.exists() and not self.root.is_dir():
            raise InvalidRequest(f"cache directory {self.root} is a file: pass a directory")
        self.max_bytes, self.memory_bytes = max_bytes, memory_bytes
        self.stats = CacheStats()
        self.write_error: str | None = None
        """Why writing is off (the first write the directory refused), or None."""
        self._lock = threading.Lock()
        self._memory = MemoryTier(memory_bytes)
        self._counted = False
        self._described: set[str] = set()
        self._spaces: dict[str, SpaceSegments] = {}
        self._writer = uuid.uuid4().hex[:16]
        self._segment_bytes = max(1, min(_SEGMENT_MAX, max_bytes // 16))
        try:
            (self.root / _VERSION_DIR).mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a read-only directory still serves what it holds
            self._refused(exc)

    def __repr__(self) -> str:
        return f"FeatureCache({str(self.root)!r}, max_bytes={self.max_bytes})"

    @property
    def writing(self) -> bool:
        """Whether new entries are written (False once the directory refused one)."""
        return self.write_error is None

    def describe(self, space: FeatureSpace) -> None:
        """Write what the space is, once, for `hapi cache ls`."""
        if space.id in self._described or not self.writing:
            return
        path = self._space_dir(space.id) / "space.json"
        try:
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f"space.{self._writer}.tmp")
                tmp.write_text(json.dumps(space.describe(), indent=1))
                os.replace(tmp, path)
        except OSError as exc:
            self._refused(exc)
            return
        self._described.add(space.id)

    def get_many(self, space: FeatureSpace, names: Sequence[str]) -> list[torch.Tensor | None]:
        """Each entry's tensor, or None for a miss (absent, evicted, or corrupt)."""
        out: list[torch.Tensor | None] = [None] * len(names)
        found, rows = self.get_batch(space, names)
        if rows is not None:
            for i, row in zip(found, rows.unbind(0), strict=True):
                out[i] = row
        if len(found) < len(names):  # entries of another shape than the batch's
            rest = [i for i, t in enumerate(out) if t is None]
            read, _ = self._space(space.id).read([names[i] for i in rest])
            for i, tensor in zip(rest, read, strict=True):
                out[i] = tensor
            more = sum(t is not None for t in read)
            with self._lock:
                self.stats.hits += more
                self.stats.misses -= more
        return out

    def get_batch(
        self, space: FeatureSpace, names: Sequence[str]
    ) -> tuple[list[int], torch.Tensor | None]:
        """The places in `names` of the entries found, in order, and their tensors stacked
        in that order (None when none is): no tensor a sample, for a chunk of hits."""
        sid = space.id
        with self._lock:
            held, rows = self._memory.get_batch(sid, names) if self._memory else ([], None)
            self.stats.memory_hits += len(held)
        taken = set(held)
        rest = [i for i in range(len(names)) if i not in taken] if held else range(len(names))
        read_at: list[int] = []
        read: torch.Tensor | None = None
        if rest:
            asked = [names[i] for i in rest] if held else names
            at, read, corrupt = self._space(sid).read_batch(asked)
            read_at = [rest[i] for i in at.tolist()] if held else at.tolist()
            with self._lock:
                self.stats.corrupt += corrupt
                if self.memory_bytes and read is not None:
                    # Copied into the tier's slabs (a row kept does not keep its batch
                    # alive), into free rows only: a scan must not push out what the next
                    # epoch reads first.
                    kept = names if len(read_at) == len(names) else [names[i] for i in read_at]
                    self._memory.put_batch(sid, kept, read, evict=False)
        found, batch = _together(held, rows, read_at, read)
        with self._lock:
            self.stats.hits += len(found)
            self.stats.misses += len(names) - len(found)
        return found, batch

    def get(self, space: FeatureSpace, name: str) -> torch.Tensor | None:
        """The entry's tensor, or None for a miss."""
        return self.get_many(space, [name])[0]

    def put_many(
        self, space: FeatureSpace, names: Sequence[str], tensors: Sequence[torch.Tensor]
    ) -> None:
        """Store each tensor under its name (an entry already held is not written again).

        Once the directory refused a write, entries are kept in memory only (within
        `memory_bytes`) and counted in `stats.write_failures`.
        """
        sid = space.id
        self.describe(space)
        new = np.flatnonzero(~self._space(sid).find(names)).tolist()
        if self.memory_bytes:
            with self._lock:
                for name, tensor in zip(names, tensors, strict=True):
                    self._remember(sid, name, tensor.detach().to("cpu"))
        if not new:
            return
        if not self.writing:
            with self._lock:
                self.stats.write_failures += len(new)
            return
        try:
            added = self._space(sid).write([names[i] for i in new], [tensors[i] for i in new])
        except OSError as exc:
            self._refused(exc)
            with self._lock:
                self.stats.write_failures += len(new)
            return
        with self._lock:
            self.stats.writes += len(new)
        self._bound(added)

    def contains(self, space: FeatureSpace, name: str) -> bool:
        """Whether an entry exists (not checked: `get` checks)."""
        with self._lock:
            if self._memory.contains(space.id, name):
                return True
        return bool(self._space(space.id).find([name])[0])

    def contains_all(self, space: FeatureSpace, names: Sequence[str]) -> bool:
        """Whether every one of the entries exists (not checked: `get` checks), looked up
        together: a million names take about a second, not one lookup each."""
        with self._lock:
            rest = [n for n in names if not self._memory.contains(space.id, n)]
        return not rest or bool(self._space(space.id).find(rest).all())

    def usage(self) -> list[SpaceUsage]:
        """Each space's entries and bytes (from its segments' sizes, not its entries)."""
        spaces = []
        base = self.root / _VERSION_DIR
        if not base.is_dir():  # never created: a read-only place
            return []
        for directory in sorted(p for p in base.iterdir() if p.is_dir()):
            entries = held = 0
            for path, size, _ in _files(directory):
                held += size
                if path.suffix == INDEX_SUFFIX:
                    entries += size // RECORD.itemsize
            described: dict[str, Any] = {}
            with contextlib.suppress(OSError, ValueError):
                described = json.loads((directory / "space.json").read_text())
            spaces.append(SpaceUsage(directory.name, entries, held, described))
        return spaces

    def clear(self, space_id: str | None = None) -> int:
        """Remove every entry (of one space); return the bytes freed. Clearing them all
        also removes a cache directory of an older layout."""
        freed = 0
        for usage in self.usage():
            if space_id is not None and usage.id != space_id:
                continue
            freed += usage.bytes
            directory = self._space_dir(usage.id)
            shutil.rmtree(directory, ignore_errors=True)
            with self._lock:
                segments = self._spaces.pop(usage.id, None)
            if segments is not None:
                segments.close()
        if space_id is None:
            for old in _OLD_DIRS:
                shutil.rmtree(self.root / old, ignore_errors=True)
        with self._lock:
            self._memory.clear()
            self._counted = False
            self._described.clear()
        return freed

    def close(self) -> None:
        """Close this cache's segment files (it reopens them if used again)."""
        with self._lock:
            spaces, self._spaces = list(self._spaces.values()), {}
        for segments in spaces:
            segments.close()

    def _space(self, sid: str) -> SpaceSegments:
        with self._lock:
            segments = self._spaces.get(sid)
            if segments is None:
                segments = self._spaces[sid] = SpaceSegments(
                    self._space_dir(sid), self._writer, self._segment_bytes
                )
            return segments

    def _refused(self, exc: OSError) -> None:
        """The directory refused a write: writing stops, with one warning."""
        with self._lock:
            if self.write_error is not None:
                return
            self.write_error = f"{type(exc).__name__}: {exc.strerror or exc}"
        log.warning(
            "feature cache %s refused a write (%s): it serves what it holds and writes "
            "nothing more; free space or pass a writable cache_dir",
            self.root,
            self.write_error,
        )

    def _bound(self, added: int) -> None:
        """Evict the least recently used segments once the directory passes its bound,
        down to 90% of it (so eviction's listing runs once per tenth of the bound)."""
        with self._lock:
            if not self._counted:
                self.stats.bytes_held = sum(s for _, s, _ in _files(self.root / _VERSION_DIR, 2))
                self._counted = True
            else:
                self.stats.bytes_held += added
            if self.stats.bytes_held <= self.max_bytes:
                return
            segments = []
            sizes: dict[Path, int] = {}
            for path, size, mtime in _files(self.root / _VERSION_DIR, 2):
                sizes[path] = size
                if path.suffix == SEGMENT_SUFFIX:
                    segments.append((mtime, path))
            held = sum(sizes.values())
            target = int(0.9 * self.max_bytes)
            for _, path in sorted(segments):
                if held <= target:
                    break
                index = path.with_suffix(INDEX_SUFFIX)
                with contextlib.suppress(OSError):
                    index.unlink()  # first: no reader finds its entries from now on
                    held -= sizes.get(index, 0)
                    self.stats.evictions += sizes.get(index, 0) // RECORD.itemsize
                with contextlib.suppress(OSError):
                    path.unlink()
                    held -= sizes[path]
                segments_of = self._spaces.get(path.parent.name)
                if segments_of is not None:
                    segments_of.index.drop(path.stem)
                    segments_of.prune()
            self.stats.bytes_held = held

    def _remember(self, sid: str, name: str, tensor: torch.Tensor) -> None:
        """Keep a decoded entry in memory (under the lock): copied into the tier's slabs,
        so a row that is a view of its whole batch does not keep the batch alive."""
        self._memory.put(sid, name, tensor)

    def _space_dir(self, sid: str) -> Path:
        return self.root / _VERSION_DIR / sid


def _files(directory: Path, depth: int = 1) -> list[tuple[Path, int, float]]:
    """The segment and index files under `directory` (`depth` 2: of every space), with
    their sizes and modification times."""
    pattern = "*/*" if depth == 2 else "*"
    found = []
    for path in directory.glob(pattern):
        if path.suffix in (SEGMENT_SUFFIX, INDEX_SUFFIX):
            with contextlib.suppress(OSError):
                st = path.stat()
                found.append((path, st.st_size, st.st_mtime))
    return found


def _together(
    held: list[int], rows: torch.Tensor | None, read_at: list[int], read: torch.Tensor | None
) -> tuple[list[int], torch.Tensor | None]:
    """Memory's and the disk's hits as one batch in the names' order."""
    if read is None:
        return held, rows
    if rows is None:
        return read_at, read
    places = held + read_at
    order = sorted(range(len(places)), key=places.__getitem__)
    return [places[j] for j in order], torch.cat([rows, read]).index_select(0, torch.tensor(order))
