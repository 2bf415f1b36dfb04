"""Compact columns for a dataset's keys, labels and versions: an Arrow array each, not a
Python object per sample (a million keys as a tuple of `str` take about 90 MB, as one
Arrow string column about 30 MB; issue 50 asks for at most 300 bytes a key in all).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar, overload

import numpy as np
import pyarrow as pa

__all__ = ["Column", "KeyIndex", "Versions", "column_of", "string_columns"]

T = TypeVar("T", str, int)

_BATCH = 65536
"""Values turned into Python objects at a time, iterating (a bounded transient)."""


class Column(Sequence[T], Generic[T]):
    """An immutable sequence of strings or integers held as one Arrow array.

    Reads as a tuple does (`len`, indexing, slicing, iteration, `==` with any sequence of
    the same values); `take` turns the values at many indices into Python at once.
    """

    __slots__ = ("array",)

    def __init__(self, array: pa.Array) -> None:
        self.array = array

    @classmethod
    def strings(cls, values: Iterable[str] | pa.Array) -> Column[str]:
        """A column of strings (`values` taken in batches, never all in Python at once)."""
        return Column(_build(values, pa.string()))

    @classmethod
    def ints(cls, values: Iterable[int] | pa.Array | np.ndarray) -> Column[int]:
        """A column of 32-bit integers (labels)."""
        if isinstance(values, np.ndarray):
            return Column(pa.array(values.astype(np.int32, copy=False)))
        return Column(_build(values, pa.int32()))

    def __len__(self) -> int:
        return len(self.array)

    @overload
    def __getitem__(self, index: int) -> T: ...
    @overload
    def __getitem__(self, index: slice) -> Column[T]: ...
    def __getitem__(self, index: int | slice) -> T | Column[T]:
        if isinstance(index, slice):
            if index.step not in (None, 1):
                return Column(self.array.take(np.arange(len(self))[index]))
            start, stop, _ = index.indices(len(self))
            return Column(self.array.slice(start, max(stop - start, 0)))
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"column index {index} out of range for {n} values")
        value: T = self.array[index % n].as_py()
        return value

    def __iter__(self) -> Iterator[T]:
        for start in range(0, len(self), _BATCH):
            yield from self.array.slice(start, _BATCH).to_pylist()

    def take(self, indices: Sequence[int] | np.ndarray) -> list[T]:
        """The values at `indices`, in that order, as a list."""
        values: list[T] = self.array.take(np.asarray(indices, dtype=np.int64)).to_pylist()
        return values

    def subset(self, indices: Sequence[int] | np.ndarray) -> Column[T]:
        """The column of the values at `indices`, in that order."""
        return Column(self.array.take(np.asarray(indices, dtype=np.int64)))

    def numpy(self) -> np.ndarray:
        """An integer column as a read-only numpy array (no copy)."""
        return self.array.to_numpy(zero_copy_only=False)

    @property
    def nbytes(self) -> int:
        """The bytes its Arrow buffers hold."""
        return int(self.array.nbytes)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Column):
            return bool(self.array.equals(other.array))
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # compared by value: not a dict key

    def __repr__(self) -> str:
        head = ", ".join(repr(v) for v in self.array.slice(0, 3).to_pylist())
        return f"Column([{head}{', ...' if len(self) > 3 else ''}], {len(self)} values)"


def column_of(values: Iterable[Any] | Column[Any], *, ints: bool = False) -> Column[Any]:
    """`values` as a column (itself, if it is one)."""
    if isinstance(values, Column):
        return values
    return Column.ints(values) if ints else Column.strings(values)


def _build(values: Iterable[Any] | pa.Array, kind: pa.DataType) -> pa.Array:
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if isinstance(values, pa.Array):
        return values.cast(kind) if values.type != kind else values
    if isinstance(values, list | tuple):
        return pa.array(values, kind)
    parts: list[pa.Array] = []
    batch: list[Any] = []
    for value in values:
        batch.append(value)
        if len(batch) == _BATCH:
            parts.append(pa.array(batch, kind))
            batch = []
    parts.append(pa.array(batch, kind))
    return pa.concat_arrays(parts) if len(parts) > 1 else parts[0]


def string_columns(rows: Iterable[tuple[str, ...]], width: int) -> tuple[Column[str], ...]:
    """`width` string columns of `rows` (tuples of `width` strings), taken in batches: a
    listing of millions of keys never stands in Python objects all at once."""
    parts: list[list[pa.Array]] = [[] for _ in range(width)]
    batch: list[tuple[str, ...]] = []

    def flush() -> None:
        for i, values in enumerate(zip(*batch, strict=True) if batch else [()] * width):
            parts[i].append(pa.array(values, pa.string()))
        batch.clear()

    for row in rows:
        batch.append(row)
        if len(batch) == _BATCH:
            flush()
    flush()
    return tuple(Column(pa.concat_arrays(p)) for p in parts)


class KeyIndex:
    """Where each key is in a column of distinct keys, in 16 bytes a key: the keys' hashes
    sorted, each with its position (a `dict` of a million keys takes about 100 MB).

    A hash found is checked against the key at its position, so a collision is never a
    wrong answer. Made on the first `find` (a hash a key: about 1.7 s a million), which
    a job whose lookups all go by place (`Versions.at`) never makes.
    """

    def __init__(self, keys: Column[str]) -> None:
        self.keys = keys
        self._lock = threading.Lock()
        self._sorted: tuple[np.ndarray, np.ndarray] | None = None

    def ready(self) -> tuple[np.ndarray, np.ndarray]:
        """The hashes sorted, and each one's position in the column (made now, if not
        yet: call it to make them ahead of the lookups that need them)."""
        with self._lock:
            if self._sorted is None:
                hashes = np.fromiter((hash(k) for k in self.keys), np.int64, len(self.keys))
                order = np.argsort(hashes, kind="stable")
                self._sorted = hashes[order], order
            return self._sorted

    def find(self, keys: Sequence[str]) -> np.ndarray:
        """The position of each of `keys` in the column, -1 for a key not in it."""
        if not len(self.keys):
            return np.full(len(keys), -1, dtype=np.int64)
        hashes, order = self.ready()
        wanted = np.fromiter((hash(k) for k in keys), np.int64, len(keys))
        at = np.minimum(np.searchsorted(hashes, wanted), len(hashes) - 1)
        positions = order[at]
        found = self.keys.take(positions)
        out = np.where(hashes[at] == wanted, positions, -1)
        for i, (key, there) in enumerate(zip(keys, found, strict=True)):
            if out[i] >= 0 and key != there:
                out[i] = self._collided(key, int(at[i]), wanted[i])
        return out

    def _collided(self, key: str, at: int, wanted: np.int64) -> int:
        """A key whose hash another key shares: the run of that hash searched in full."""
        hashes, order = self.ready()
        while at < len(hashes) and hashes[at] == wanted:
            if self.keys[int(order[at])] == key:
                return int(order[at])
            at += 1
        return -1


class Versions(Mapping[str, str]):
    """Each key's object version, as listed: a mapping over two aligned columns, looked
    up through a `KeyIndex` (made on first use, or shared with a listing of the same keys).
    """

    def __init__(self, keys: Column[str], versions: Column[str], index: KeyIndex | None = None):
        if len(keys) != len(versions):
            raise ValueError(f"{len(keys)} keys but {len(versions)} versions")
        self.key_column, self.version_column = keys, versions
        self._index = index

    @classmethod
    def of_listing(cls, listing: Iterable[tuple[str, str]]) -> Versions:
        """A listing's (key, version) pairs as two columns, taken in batches."""
        keys, versions = string_columns(listing, 2)
        return cls(keys, versions)

    @property
    def index(self) -> KeyIndex:
        """The keys' index (made now, if not yet)."""
        if self._index is None:
            self._index = KeyIndex(self.key_column)
        return self._index

    def of(self, keys: Sequence[str], default: str = "") -> list[str]:
        """The version of each of `keys` (`default` for a key not listed)."""
        if not len(self.key_column):
            return [default] * len(keys)
        positions = self.index.find(keys)
        known = self.version_column.take(np.maximum(positions, 0))
        return [v if p >= 0 else default for v, p in zip(known, positions, strict=True)]

    def at(self, keys: Column[str], positions: np.ndarray, default: str = "") -> list[str]:
        """The versions of `keys`' values at `positions`: taken by position where `keys`
        is this map's own key column (a listing of a manifest's keys, the usual case: no
        hash a key), else looked up."""
        if keys is self.key_column:
            return self.version_column.take(positions)
        return self.of(keys.take(positions), default)

    def __getitem__(self, key: str) -> str:
        position = int(self.index.find([key])[0])
        if position < 0:
            raise KeyError(key)
        return self.version_column[position]

    def __iter__(self) -> Iterator[str]:
        return iter(self.key_column)

    def pairs(self) -> Iterator[tuple[str, str]]:
        """(key, version) in the columns' order."""
        return zip(self.key_column, self.version_column, strict=True)

    def __len__(self) -> int:
        return len(self.key_column)
