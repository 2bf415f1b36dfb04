"""`SpaceSegments`: one feature space's entries packed in append-only segment files.

Each process writes segments of its own (`<writer>-<n>.seg`, and `.idx` beside it), so
writers never lock each other: a batch of entries is one append to the segment, then one
append of their index records. A writer killed between the two leaves bytes no record
points to; a record whose bytes are torn or flipped fails its CRC and is a miss. Reading
maps segments into memory whole (`MAP_POPULATE`), since a cached epoch reads every entry -
a few large sequential reads, not a file per sample.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from hapi.cache._index import INDEX_SUFFIX, RECORD, SpaceIndex
from hapi.cache._record import ALIGN, decode_block, encode
from hapi.errors import InvalidRequest

__all__ = ["SEGMENT_SUFFIX", "SpaceSegments"]

SEGMENT_SUFFIX = ".seg"

_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
"""A segment is mapped whole and at once (Linux): the kernel reads it in one sequential
pass and maps every page, where faulting 4 KiB pages one by one made a warm epoch of 1.28
million entries 1.4x slower."""

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

    def find(self, names: Sequence[str]) -> np.ndarray:
        """Which entries the index holds (a bool mask; not checked: `read` checks)."""
        self._load()
        return self.index.find(_keys(names)[0])[0]

    def read(self, names: Sequence[str]) -> tuple[list[torch.Tensor | None], int]:
        """Each entry's tensor, or None; and how many were corrupt (`read_batch`). Entries
        of any shapes and dtypes."""
        parts, corrupt = self._parts(names)
        out: list[torch.Tensor | None] = [None] * len(names)
        for at, batch in parts:
            for i, row in zip(at.tolist(), batch.unbind(0), strict=True):
                out[i] = row
        return out, corrupt

    def read_batch(self, names: Sequence[str]) -> tuple[np.ndarray, torch.Tensor | None, int]:
        """The places in `names` of the entries read, ascending, and their tensors stacked
        in that order (None: none was); and how many were corrupt (now misses, or read
        from another writer's copy). No tensor an entry: a chunk's hits are one batch.

        A batch is of one shape and dtype, the first entry's: where a space holds others
        (an unusual head, or images of several sizes without a resize), those are left
        out, misses here (`read` reads them)."""
        parts, corrupt = self._parts(names)
        at, batch = _in_order([p for p in parts if _alike(p[1], parts[0][1])])
        return at, batch, corrupt

    def _parts(self, names: Sequence[str]) -> tuple[list[tuple[np.ndarray, torch.Tensor]], int]:
        """The entries read, as batches (their places in `names`, their tensors stacked),
        and how many were corrupt."""
        keys, raw = _keys(names)
        self._load()
        found, places = self.index.find(keys)
        parts, corrupt = self._read(found, places)
        if corrupt:
            self.index.forget(
                {
                    raw[16 * i : 16 * (i + 1)]: (int(places["seg"][i]), int(places["offset"][i]))
                    for i in corrupt
                }
            )
            again = np.zeros(len(names), bool)
            again[corrupt] = True
            found, places = self.index.find(keys)
            parts += self._read(found & again, places)[0]
        return parts, len(corrupt)

    def _read(
        self, found: np.ndarray, places: np.ndarray
    ) -> tuple[list[tuple[np.ndarray, torch.Tensor]], list[int]]:
        """The entries found at `places`, as batches (their places, their tensors stacked),
        and which of them are corrupt."""
        parts: list[tuple[np.ndarray, torch.Tensor]] = []
        at = np.flatnonzero(found)
        if not len(at):
            return parts, []
        # Each segment mapped once, then records of one length copied out of their
        # segments end to end (a slice each: a chunk's entries lie in a dozen segments at
        # a million entries, where a gather per segment cost 4x as much) and decoded
        # together as rows of 8-byte words.
        places = places if len(at) == len(places) else places[at]
        offsets, lengths, segs = places["offset"], places["length"], places["seg"]
        ends = (offsets + lengths).astype(np.int64)
        # Each segment's furthest end, mapped to cover it: a chunk's entries lie in a few
        # segments (one numpy pass a segment, not a Python step an entry).
        distinct = np.unique(segs)
        one = len(distinct) == 1
        maps: dict[int, mmap.mmap] = {}
        sizes = np.full(len(distinct), -1, np.int64)  # -1: gone (evicted), a miss
        for k, seg in enumerate(distinct.tolist()):
            end = int(ends.max() if one else ends[segs == seg].max())
            mapped = self._mapped(self.index.stem(seg), end)
            if mapped is not None:
                maps[seg], sizes[k] = mapped, len(mapped)
        limit = sizes[np.zeros(len(segs), np.intp) if one else np.searchsorted(distinct, segs)]
        # A record past the segment's end (torn) or off the 8-byte grid is corrupt.
        aligned = (offsets % ALIGN == 0) & (lengths % ALIGN == 0)
        mapped_at = limit >= 0
        whole = mapped_at & aligned & (ends <= limit)
        corrupt = at[mapped_at & ~whole].tolist()
        for length in _distinct(lengths[whole]):
            rows = np.flatnonzero(whole & (lengths == length))
            spans = zip(segs[rows].tolist(), offsets[rows].tolist(), strict=True)
            # A bytearray: the block is writable, as the tensors decoded from it are.
            raw = bytearray().join([maps[seg][start : start + length] for seg, start in spans])
            block = np.frombuffer(raw, np.uint64).reshape(len(rows), length // ALIGN)
            decoded = decode_block(block, places["crc"][rows])
            parts += [(at[rows[part]], tensors) for part, tensors in decoded.parts]
            corrupt += at[rows[decoded.failed]].tolist()
        return parts, corrupt

    def write(self, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> int:
        """Append entries; the bytes added to the directory.

        Raises:
            OSError: the directory refused the write (full, read-only, no permission).
        """
        records, crcs = zip(
            *(encode(t.detach().to("cpu").contiguous()) for t in tensors), strict=True
        )
        index = np.empty(len(records), RECORD)
        index["name"] = _keys(names)[0]
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

    def _mapped(self, stem: str, end: int) -> mmap.mmap | None:
        """The segment, mapped (again, if it grew) to cover `end` where it can; None where
        it is gone."""
        with self._lock:
            mapped = self._maps.get(stem)
        if mapped is None or len(mapped) < end:
            mapped = self._map(stem)
            if mapped is None:
                return None
        self._touch(stem)
        return mapped

    def _map(self, stem: str) -> mmap.mmap | None:
        path = self.directory / f"{stem}{SEGMENT_SUFFIX}"
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                mapped = mmap.mmap(f.fileno(), size, flags=_MAP_FLAGS, prot=mmap.PROT_READ)
        except (OSError, ValueError):  # gone, or empty (ValueError)
            self.index.drop(stem)
            return None
        with self._lock:
            self._maps[stem] = mapped
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


def _keys(names: Sequence[str]) -> tuple[np.ndarray, bytes]:
    """Entry names (32 hex digits each, `entry_name`) as index keys (`S16`), and their
    bytes end to end (an `S16` drops trailing NULs; these keep them).

    Raises:
        InvalidRequest: a name that is not 32 hex digits.
    """
    try:
        raw = bytes.fromhex("".join(names))
    except ValueError:
        raw = b""
    if len(raw) != 16 * len(names):
        raise InvalidRequest("a cache entry's name is 32 hex digits: make it with entry_name()")
    return np.frombuffer(raw, "S16"), raw


def _alike(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape[1:] == b.shape[1:]


def _in_order(
    parts: list[tuple[np.ndarray, torch.Tensor]],
) -> tuple[np.ndarray, torch.Tensor | None]:
    """Batches read in file order as one, in the order of their places."""
    if not parts:
        return np.zeros(0, np.intp), None
    if len(parts) == 1:  # one block's rows alike: ascending already (`_read`)
        return parts[0]
    at = np.concatenate([p for p, _ in parts])
    batch = torch.cat([t for _, t in parts])
    order = np.argsort(at, kind="stable")
    if (order[1:] > order[:-1]).all():
        return at, batch
    return at[order], batch.index_select(0, torch.from_numpy(order))


def _distinct(values: np.ndarray) -> list[int]:
    """A column's distinct values, ascending (a space's records are usually one length)."""
    if len(values) and values.min() == values.max():
        return [int(values[0])]
    return [int(v) for v in np.unique(values).tolist()]
