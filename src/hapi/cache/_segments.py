"""`SpaceSegments`: one feature space's entries packed in append-only segment files.

Each process writes segments of its own (`<writer>-<n>.seg`, and `.idx` beside it), so
writers never lock each other: a batch of entries is one append to the segment, then one
append of their index records. A writer killed between the two leaves bytes no record
points to; a record whose bytes are torn or flipped fails its CRC and is a miss. Reading
maps segments into memory; the first touch of a segment asks the kernel to read it ahead
whole, since a cached epoch reads every entry - a few large sequential reads, not a file
per sample.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from hapi.cache._index import INDEX_SUFFIX, RECORD, Located, SpaceIndex
from hapi.cache._record import Layout, encode, header, rows

__all__ = ["SEGMENT_SUFFIX", "SpaceSegments"]

SEGMENT_SUFFIX = ".seg"

_TOUCH_S = 5.0
"""A segment read from is marked used (its mtime, eviction's clock) at most this often."""


class SpaceSegments:
    """The segments of one space directory: this process's writer, and every segment's
    entries for reading.

    Args:
        directory: the space's directory (made on the first write).
        writer: this cache's writer id (unique per open cache).
        segment_bytes: a segment is closed and the next begun past this size.
    """

    def __init__(self, directory: Path, writer: str, segment_bytes: int) -> None:
        self.directory, self.writer, self.segment_bytes = directory, writer, segment_bytes
        self.index = SpaceIndex(directory)
        self._maps: dict[str, mmap.mmap] = {}
        self._touched: dict[str, float] = {}
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._load_lock = threading.Lock()
        self._serial = 0
        self._stem: str | None = None
        self._size = 0
        self._loaded = False

    def find(self, names: Sequence[str]) -> list[Located | None]:
        """Each entry's place, or None."""
        self._load()
        return self.index.find([bytes.fromhex(n) for n in names])

    def read(self, names: Sequence[str]) -> tuple[list[torch.Tensor | None], int]:
        """Each entry's tensor, or None; and how many were corrupt (now misses)."""
        places = self.find(names)
        out: list[torch.Tensor | None] = [None] * len(names)
        corrupt = 0
        # In file order: a segment is read front to back. Entries of one layout (a
        # space's are alike) are decoded together.
        wanted = sorted(
            (i for i, p in enumerate(places) if p is not None),
            key=lambda i: (places[i].segment, places[i].offset),  # type: ignore[union-attr]
        )
        ends: dict[str, int] = {}
        for place in places:
            if place is not None:
                ends[place.segment] = max(ends.get(place.segment, 0), place.offset + place.length)
        groups: dict[Layout, tuple[list[int], list[memoryview]]] = {}
        segment: str | None = None
        mapped: memoryview | None = None
        for i in wanted:
            place = places[i]
            assert place is not None  # filtered above
            if place.segment != segment:
                segment = place.segment
                mapped = self._mapped(segment, ends[segment])
            if mapped is None:
                continue
            view = mapped[place.offset : place.offset + place.length]
            layout = header(view) if zlib.crc32(view) == place.crc else None
            if layout is None:
                corrupt += 1
                self.index.forget(bytes.fromhex(names[i]))
                continue
            group = groups.setdefault(layout, ([], []))
            group[0].append(i)
            group[1].append(view[layout.start :])
        for layout, (at, payloads) in groups.items():
            for i, tensor in zip(at, rows(payloads, layout), strict=True):
                out[i] = tensor
        return out, corrupt

    def write(self, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> int:
        """Append entries; the bytes added to the directory.

        Raises:
            OSError: the directory refused the write (full, read-only, no permission).
        """
        records, crcs = zip(
            *(encode(t.detach().to("cpu").contiguous()) for t in tensors), strict=True
        )
        index = np.empty(len(records), RECORD)
        index["name"] = [bytes.fromhex(n) for n in names]
        index["length"] = [len(r) for r in records]
        index["crc"] = crcs
        with self._write_lock:
            seg_fd, idx_fd = self._open()
            try:
                index["offset"] = self._size + np.concatenate(
                    [[0], np.cumsum(index["length"])[:-1]]
                )
                data = b"".join(records)
                try:
                    _write_all(seg_fd, data)
                    _write_all(idx_fd, index.tobytes())
                except OSError:
                    self._stem = None  # a partial append: the next write begins a segment
                    raise
                self._size += len(data)
                stem = self._stem
            finally:
                os.close(seg_fd)
                os.close(idx_fd)
        assert stem is not None  # set by _open
        self.index.add(stem, index)
        return len(data) + index.nbytes

    def prune(self) -> None:
        """Unmap segments that are gone, so their disk space is freed."""
        dead = self.index.dead()
        with self._lock:
            for stem in dead & self._maps.keys():
                del self._maps[stem]

    def close(self) -> None:
        with self._lock:
            self._maps.clear()  # mappings close when the last view of them goes

    def _load(self) -> None:
        """The index as the directory holds it, before the first lookup (threads that
        look up meanwhile wait: a half-loaded index would miss what is there)."""
        if self._loaded:
            return
        with self._load_lock:
            if not self._loaded:
                self.index.refresh(force=True)
                self._loaded = True

    def _open(self) -> tuple[int, int]:
        """This writer's segment and index, opened to append: a new pair when the segment
        is full or was evicted. Closed after each append, so a cache holds no file open
        between writes (a disk can be remounted, a directory removed)."""
        flags = os.O_WRONLY | os.O_APPEND
        if self._stem is not None and self._size < self.segment_bytes:
            try:
                seg = os.open(self.directory / f"{self._stem}{SEGMENT_SUFFIX}", flags)
            except FileNotFoundError:
                pass  # evicted: begin another
            else:
                try:
                    return seg, os.open(self.directory / f"{self._stem}{INDEX_SUFFIX}", flags)
                except OSError:
                    os.close(seg)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._serial += 1
        stem = f"{self.writer}-{self._serial:06d}"
        flags |= os.O_CREAT | os.O_EXCL
        seg = os.open(self.directory / f"{stem}{SEGMENT_SUFFIX}", flags, 0o644)
        try:
            idx = os.open(self.directory / f"{stem}{INDEX_SUFFIX}", flags, 0o644)
        except OSError:
            os.close(seg)
            raise
        self._stem, self._size = stem, 0
        return seg, idx

    def _mapped(self, stem: str, end: int) -> memoryview | None:
        """The segment's bytes up to `end` at least, or None where it is gone or shorter."""
        with self._lock:
            mapped = self._maps.get(stem)
        if mapped is None or len(mapped) < end:
            mapped = self._map(stem, end)
            if mapped is None:
                return None
        self._touch(stem)
        return memoryview(mapped)

    def _map(self, stem: str, need: int) -> mmap.mmap | None:
        path = self.directory / f"{stem}{SEGMENT_SUFFIX}"
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < need:
                    return None  # torn: the record points past the bytes written
                mapped = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
        except (OSError, ValueError):
            self.index.drop(stem)
            return None
        with self._lock:
            first = stem not in self._maps
            self._maps[stem] = mapped
        if first and hasattr(mmap, "MADV_WILLNEED"):
            mapped.madvise(mmap.MADV_WILLNEED)
        return mapped

    def _touch(self, stem: str) -> None:
        now = time.monotonic()
        if now - self._touched.get(stem, -_TOUCH_S) < _TOUCH_S:
            return
        self._touched[stem] = now
        # Read-only or gone: eviction's clock is not worth an error.
        with contextlib.suppress(OSError):
            os.utime(self.directory / f"{stem}{SEGMENT_SUFFIX}")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
