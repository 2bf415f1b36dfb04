"""`SpaceIndex`: where each entry of one feature space lies, held compactly.

Every writer appends 32-byte records (name, offset, length, CRC-32) to the `.idx` beside
its segment; a reader loads them all once and then only what the files gained. A million
entries cost 44 bytes each in sorted numpy columns (searched a batch at a time), not a
Python object each; the newest record of a name wins, so an entry written again after a
corrupt copy is found.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np

__all__ = ["COLUMNS", "INDEX_SUFFIX", "RECORD", "SpaceIndex"]

RECORD = np.dtype([("name", "S16"), ("offset", "<u8"), ("length", "<u4"), ("crc", "<u4")])
"""An index record: a name's 16 bytes, where its record lies in the segment, its CRC-32."""

COLUMNS = np.dtype([("seg", "<u4"), ("offset", "<u8"), ("length", "<u4"), ("crc", "<u4")])
"""Where an entry lies: its segment (a number, `SpaceIndex.stem` names it), its record's
offset and length there, and the record's CRC-32."""

INDEX_SUFFIX = ".idx"

_MERGE_AT = 1 << 16
"""Records kept in a dict before they are merged into the sorted columns."""


class SpaceIndex:
    """The records of every segment of one space directory.

    Args:
        directory: the space's directory.
        refresh_s: how often at most a miss lists the directory again for other
            processes' writes (they are seen within this long).
    """

    def __init__(self, directory: Path, *, refresh_s: float = 1.0) -> None:
        self.directory, self.refresh_s = directory, refresh_s
        self._lock = threading.Lock()
        self._stems: list[str] = []
        self._ids: dict[str, int] = {}
        self._alive: list[bool] = []
        self._read: dict[str, int] = {}
        """Bytes of each `.idx` already loaded."""
        self._names = np.empty(0, "S16")
        self._prefix = np.empty(0, np.uint64)
        """Each name's first 8 bytes as a number, searched first: a key of 8 bytes is
        found 3x faster than one of 16 (names are hashes, so prefixes rarely repeat)."""
        self._cols = np.empty(0, COLUMNS)
        self._recent: dict[bytes, tuple[int, int, int, int]] = {}
        self._gone: set[bytes] = set()
        self._bad: set[tuple[int, int]] = set()
        """Records (segment, offset) that failed their CRC."""
        self._listed = -float("inf")

    def __len__(self) -> int:
        return len(self._names) + len(self._recent)

    def add(self, stem: str, records: np.ndarray) -> None:
        """Records this process wrote to `stem` (already in its `.idx`)."""
        with self._lock:
            self._add(self._id(stem), records)
            self._read[stem] = self._read.get(stem, 0) + records.nbytes

    def find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where each key's newest record lies (`COLUMNS`), and which keys were found
        (a bool mask); a miss lists the directory again (at most once per `refresh_s`) for
        what other processes wrote. `keys`: an array of names (`S16`)."""
        found, places = self._find(keys)
        if not found.all() and self.refresh():
            found, places = self._find(keys)
        return found, places

    def stem(self, seg: int) -> str:
        """A segment's stem (`<writer>-<n>`) by its number in `find`'s columns."""
        return self._stems[seg]  # only ever appended to: no lock needed to read

    def refresh(self, *, force: bool = False) -> bool:
        """Load what the directory's `.idx` files gained; True if anything changed."""
        now = time.monotonic()
        with self._lock:
            if not force and now - self._listed < self.refresh_s:
                return False
            self._listed = now
        changed = False
        try:
            listed = {
                e.name[: -len(INDEX_SUFFIX)]: e
                for e in os.scandir(self.directory)
                if e.name.endswith(INDEX_SUFFIX)
            }
        except OSError:
            return False
        with self._lock:
            for stem, i in self._ids.items():
                if stem not in listed and self._alive[i]:
                    self._alive[i], changed = False, True  # evicted by another process
        for stem, entry in listed.items():
            with self._lock:
                done = self._read.get(stem, 0)
            try:
                size = entry.stat().st_size // RECORD.itemsize * RECORD.itemsize
                if size <= done:
                    continue
                with open(entry.path, "rb") as f:
                    f.seek(done)
                    data = f.read(size - done)
            except OSError:
                continue
            records = np.frombuffer(data[: len(data) // RECORD.itemsize * RECORD.itemsize], RECORD)
            with self._lock:
                if self._read.get(stem, 0) != done:
                    continue  # another thread loaded it meanwhile
                self._add(self._id(stem), records)
                self._read[stem] = done + records.nbytes
                changed = True
        return changed

    def forget(self, bad: dict[bytes, tuple[int, int]]) -> None:
        """Names whose record (at segment, offset) proved corrupt. Another writer's copy
        of a name is found where one is there - the `.idx` files are searched again, as
        which writer's record is newer is not known - else the name is a miss until it
        is written again."""
        with self._lock:
            self._bad.update((seg, offset) for seg, offset in bad.values())
            for name in bad:
                self._gone.add(name)
                self._recent.pop(name, None)
            stems = dict(self._ids)
        copies: dict[bytes, tuple[int, int, int, int]] = {}
        for stem, seg in stems.items():
            try:
                data = (self.directory / f"{stem}{INDEX_SUFFIX}").read_bytes()
            except OSError:
                continue
            records = np.frombuffer(data[: len(data) // RECORD.itemsize * RECORD.itemsize], RECORD)
            at = np.flatnonzero(np.isin(records["name"], np.array(list(bad), "S16")))
            for r in records[at].tolist():
                if (seg, r[1]) not in self._bad:
                    copies[r[0].ljust(16, b"\0")] = (seg, r[1], r[2], r[3])
        with self._lock:
            for name, place in copies.items():
                if name in self._gone:
                    self._recent[name] = place
                    self._gone.discard(name)

    def drop(self, stem: str) -> None:
        """A segment that is gone (evicted, or unreadable)."""
        with self._lock:
            i = self._ids.get(stem)
            if i is not None:
                self._alive[i] = False

    def dead(self) -> set[str]:
        """The segments known gone."""
        with self._lock:
            return {s for s, alive in zip(self._stems, self._alive, strict=True) if not alive}

    def _id(self, stem: str) -> int:
        i = self._ids.get(stem)
        if i is None:
            i = self._ids[stem] = len(self._stems)
            self._stems.append(stem)
            self._alive.append(True)
        self._alive[i] = True
        return i

    def _add(self, seg: int, records: np.ndarray) -> None:
        if len(records) > _MERGE_AT // 4:
            self._merge(seg, records)
            return
        recent, gone = self._recent, self._gone
        for r in records.tolist():
            name = r[0].ljust(16, b"\0")  # numpy drops an S16's trailing NULs
            recent[name] = (seg, r[1], r[2], r[3])
            gone.discard(name)
        if len(recent) > max(_MERGE_AT, len(self._names) // 4):
            self._merge(seg, records[:0])

    def _merge(self, seg: int, batch: np.ndarray) -> None:
        """Recent records and `batch` into the sorted columns: the newest of a name wins,
        records of gone segments go."""
        recent = list(self._recent.items())
        names = np.concatenate(
            [self._names, np.array([n for n, _ in recent], "S16"), batch["name"]]
        )
        cols = np.empty(len(recent) + len(batch), COLUMNS)
        if recent:
            cols[: len(recent)] = [v for _, v in recent]
        cols["seg"][len(recent) :] = seg
        for field in ("offset", "length", "crc"):
            cols[field][len(recent) :] = batch[field]
        cols = np.concatenate([self._cols, cols])
        order = np.argsort(names, kind="stable")
        names, cols = names[order], cols[order]
        keep = np.ones(len(names), bool)
        keep[:-1] = names[1:] != names[:-1]  # the last of a run is the newest
        if len(cols):
            keep &= np.asarray(self._alive, bool)[cols["seg"]]
        self._names, self._cols = names[keep], cols[keep]
        self._prefix = _prefix(self._names)
        self._recent = {}
        if self._gone:  # a name written again is found again (a set of a million costs)
            self._gone -= {n.ljust(16, b"\0") for n in batch["name"].tolist()}

    def _find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # A batch at a time: one search of the sorted columns, then the few names held
        # in the dict (written since the last merge) or forgotten, which override it.
        places = np.zeros(len(keys), COLUMNS)
        with self._lock:
            found = np.zeros(len(keys), bool)
            if len(self._names):
                last = len(self._names) - 1
                prefix = _prefix(keys)
                at = np.minimum(np.searchsorted(self._prefix, prefix), last)
                found = self._names[at] == keys
                shared = np.flatnonzero(~found & (self._prefix[at] == prefix))
                if len(shared):  # another name with the same 8 bytes first
                    at[shared] = np.minimum(np.searchsorted(self._names, keys[shared]), last)
                    found[shared] = self._names[at[shared]] == keys[shared]
                if found.all():  # the usual case: one gather, no mask
                    places = self._cols[at]
                else:
                    places[found] = self._cols[at[found]]
            if self._recent or self._gone:
                recent, gone = self._recent, self._gone
                for i, name in enumerate(keys.tolist()):
                    name = name.ljust(16, b"\0")  # numpy drops an S16's trailing NULs
                    hit = recent.get(name)
                    if hit is not None:
                        places[i], found[i] = hit, True
                    elif name in gone:
                        found[i] = False
            if not all(self._alive):  # a segment gone: its records are misses
                found &= np.asarray(self._alive, bool)[places["seg"]]
        return found, places


def _prefix(names: np.ndarray) -> np.ndarray:
    """The first 8 bytes of `S16` names as numbers, ordered as the names are."""
    return np.ascontiguousarray(names).view(">u8")[::2].astype(np.uint64)
