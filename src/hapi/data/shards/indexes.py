"""`ShardIndexes`: each shard's index (a `TarIndex` or `ParquetIndex`), built once per
version of the shard and kept in memory for the process (and a tar's on disk under
`$HAPI_CACHE_DIR/shards`, so a restarted server or the next listing reads no headers).

An index is trusted only with bytes of its own version: every ranged read returns its
object's version, and one that differs drops the index (`StaleIndex`) to be built again.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hapi._cache_home import cache_home
from hapi.data.shards.parquet_index import ParquetIndex
from hapi.data.shards.tar_index import WINDOW, TarIndex
from hapi.errors import HapiError, ObjectNotFound

__all__ = ["ShardIndex", "ShardIndexes", "StaleIndex", "index_dir"]

ShardIndex = TarIndex | ParquetIndex

_KEPT = 4096
"""Indexes kept in memory, the least recently used dropped first."""

# Process-wide, so every store object on one store (a server's listing and its chunks, a
# job's fallback) shares what was built. Keyed by (store uri, shard, image column).
_MEMORY: OrderedDict[tuple[str, str, str | None], tuple[str, ShardIndex]] = OrderedDict()
_LOCK = threading.Lock()


class StaleIndex(HapiError):
    """A shard changed since its index was built: build it again and re-read."""


def index_dir() -> Path:
    """`$HAPI_CACHE_DIR/shards`, or `~/.cache/hapi/shards`."""
    return cache_home("shards")


class ShardIndexes:
    """The indexes of the shards of one store (`inner`, with `get_range_versioned`)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.builds = 0
        """Indexes this object built (read from the shard, not found kept)."""

    def get(
        self, container: str, *, image: str | None = None, version: str | None = None
    ) -> ShardIndex:
        """The shard's index, built if no version of it is kept (or, given the `version`
        a listing saw, none of that version: a shard rewritten since is indexed again).

        Raises:
            ObjectNotFound: no such shard.
            CorruptObject: its footer is damaged (naming it).
        """
        if version is not None:
            name = (self.inner.uri, container, image)
            with _LOCK:
                kept = _MEMORY.get(name)
                if kept is not None and kept[0] != version:
                    del _MEMORY[name]
        return self._entry(container, image)[1]

    def version(self, container: str, *, image: str | None = None) -> str:
        """The version of the shard that its kept index describes."""
        return self._entry(container, image)[0]

    def read(self, container: str, start: int, end: int, *, image: str | None = None) -> memoryview:
        """Bytes `start` to `end` of the shard, in one request (a view of the response).

        Raises:
            StaleIndex: the shard is not the version its index was built from (dropped).
        """
        name = (self.inner.uri, container, image)
        try:
            data, version, _ = self.inner.get_range_versioned(container, start, end)
        except ObjectNotFound:
            raise
        except HapiError:
            # A range past a shortened shard's end is refused, not answered with the new
            # version: ask for its first byte to tell that from a store that failed.
            version = self.inner.get_range_versioned(container, 0, 1)[1]
            with _LOCK:
                kept = _MEMORY.get(name)
            if kept is None or kept[0] == version:
                raise
            data = b""
        with _LOCK:
            kept = _MEMORY.get(name)
        if kept is not None and kept[0] != version:
            with _LOCK:
                _MEMORY.pop(name, None)
            raise StaleIndex(f"shard {container} changed since it was indexed")
        return memoryview(data)

    def read_pieces(
        self, container: str, start: int, end: int, *, piece: int, image: str | None = None
    ) -> list[tuple[int, memoryview]]:
        """Bytes `start` to `end` of the shard as (offset, bytes) pieces of at most `piece`
        bytes, read in parallel: a store's first-byte latency is paid about once, not
        once per piece.

        Raises:
            StaleIndex: as `read`.
        """
        cuts = list(range(start, end, max(piece, 1))) or [start]
        spans = [(a, min(a + piece, end)) for a in cuts]
        if len(spans) == 1:
            return [(start, self.read(container, start, end, image=image))]
        with ThreadPoolExecutor(len(spans) - 1, thread_name_prefix="hapi-piece") as pool:
            rest = [pool.submit(self.read, container, a, b, image=image) for a, b in spans[1:]]
            first = self.read(container, *spans[0], image=image)
            later = [(a, f.result()) for (a, _), f in zip(spans[1:], rest, strict=True)]
        return [(start, first), *later]

    def _entry(self, container: str, image: str | None) -> tuple[str, ShardIndex]:
        name = (self.inner.uri, container, image)
        with _LOCK:
            kept = _MEMORY.get(name)
            if kept is not None:
                _MEMORY.move_to_end(name)
                return kept
        kept = self._build(container, image)
        with _LOCK:
            _MEMORY[name] = kept
            while len(_MEMORY) > _KEPT:
                _MEMORY.popitem(last=False)
        return kept

    def _build(self, container: str, image: str | None) -> tuple[str, ShardIndex]:
        # The first window gives the shard's version and size with its first headers.
        head, version, size = self.inner.get_range_versioned(container, 0, WINDOW)

        def read(start: int, end: int) -> bytes:
            if end <= len(head):
                return bytes(head[start:end])
            data, now, _ = self.inner.get_range_versioned(container, start, end)
            if now != version:
                raise StaleIndex(f"shard {container} changed while it was indexed")
            return bytes(data)

        if container.lower().endswith(".parquet"):
            self.builds += 1
            return version, ParquetIndex.build(read, size, name=container, image=image)
        # "2": indexes kept before shards that break off were noted are built again.
        path = index_dir() / f"{_digest('2', self.inner.uri, container, version)}.json"
        try:
            return version, TarIndex.from_dict(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            pass  # not kept (or unreadable): build it
        self.builds += 1
        index = TarIndex.build(read, size, name=container)
        _keep(path, index)
        return version, index


def _keep(path: Path, index: TarIndex) -> None:
    # Best effort and atomic: a cache that cannot be written costs a rebuild, nothing more.
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(index.to_dict()))
        os.replace(tmp, path)
    except OSError:
        pass


def _digest(*parts: str) -> str:
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=16).hexdigest()
