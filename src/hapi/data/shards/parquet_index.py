"""`ParquetIndex`: a Parquet file's row groups and where its image column lies in each.

The footer is read once (per version) with a ranged read of the file's tail; reading rows
is then one ranged request for the image column of their row group, decoded by pyarrow
from those bytes alone (a sparse file: the footer and the column chunk, nothing else).
Hugging Face's `image` column (a struct of `bytes` and `path`) is understood.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hapi.data.shards.blob import Blob
from hapi.errors import CorruptObject, InvalidRequest, shorten

__all__ = ["IMAGE_COLUMNS", "LABEL_COLUMNS", "ParquetIndex", "RowGroup"]

IMAGE_COLUMNS = ("image", "img", "jpg", "jpeg", "png", "webp", "image_bytes", "bytes")
"""Image columns found by name, in this order, when none is named."""
LABEL_COLUMNS = ("label", "labels", "cls", "class", "target")
"""Label columns found by name, in this order, when none is named."""

_TAIL = 64 << 10

ReadRange = Callable[[int, int], bytes]


@dataclass(frozen=True)
class RowGroup:
    """One row group: its rows and the byte span of its image column's chunks."""

    first_row: int
    rows: int
    start: int
    end: int


@dataclass(frozen=True)
class ParquetIndex:
    """A Parquet file's row groups, its image column, and its footer (to decode them)."""

    size: int
    image: str
    groups: tuple[RowGroup, ...]
    footer: bytes
    """The file's last bytes: its metadata, length and magic."""

    @property
    def rows(self) -> int:
        return sum(g.rows for g in self.groups)

    def group_of(self, row: int) -> int:
        """The index of the row group that holds `row`; -1 if none does."""
        for i, g in enumerate(self.groups):
            if g.first_row <= row < g.first_row + g.rows:
                return i
        return -1

    @classmethod
    def build(cls, read: ReadRange, size: int, *, name: str, image: str | None) -> ParquetIndex:
        """Index a file of `size` bytes from its footer, read through `read`.

        Raises:
            CorruptObject: not a Parquet file (the message names it).
            InvalidRequest: no image column by that name (or none found by `IMAGE_COLUMNS`).
        """
        import pyarrow as pa
        import pyarrow.parquet as pq

        tail = read(max(0, size - _TAIL), size)
        if size < 12 or tail[-4:] != b"PAR1":
            raise CorruptObject(f"{name} is not a Parquet file (no PAR1 footer): rewrite it")
        need = int.from_bytes(tail[-8:-4], "little") + 8
        if need > len(tail):
            tail = read(size - need, size)
        footer = tail[-need:]
        try:
            meta = pq.read_metadata(pa.BufferReader(b"PAR1" + footer))
        except (pa.ArrowException, OSError) as exc:
            raise CorruptObject(
                f"{name} has a damaged Parquet footer ({exc}): rewrite it"
            ) from None
        column = image or find_column(meta.schema.to_arrow_schema(), IMAGE_COLUMNS, name, "image")
        leaves = [
            i for i in range(meta.num_columns) if meta.schema.column(i).path.split(".")[0] == column
        ]
        if not leaves:
            raise InvalidRequest(f"{name} has no column {column!r}: name its image column")
        groups, first = [], 0
        for g in range(meta.num_row_groups):
            rg = meta.row_group(g)
            spans = [_span(rg.column(i)) for i in leaves]
            groups.append(
                RowGroup(first, rg.num_rows, min(s for s, _ in spans), max(e for _, e in spans))
            )
            first += rg.num_rows
        return cls(size, column, tuple(groups), footer)

    def read_group(
        self, group: int, pieces: Sequence[tuple[int, Blob]], *, name: str
    ) -> list[Blob | None]:
        """The image bytes of each row of `group`, decoded from `pieces` (its column's
        bytes as (offset in the file, bytes), as ranged reads of the group gave them):
        views of the decoded column's one buffer, not a `bytes` per row.

        Raises:
            CorruptObject: the bytes do not decode (the message names the file and group).
        """
        import pyarrow as pa
        import pyarrow.parquet as pq

        known = {at: data for at, data in pieces}
        sparse = _Sparse(self.size, {**known, self.size - len(self.footer): self.footer})
        try:
            table = pq.ParquetFile(pa.PythonFile(sparse, mode="r")).read_row_group(
                group, columns=[self.image]
            )
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise CorruptObject(
                f"row group {group} of {name} does not decode ({shorten(str(exc))}): rewrite it"
            ) from None
        rows: list[Blob | None] = []
        for chunk in table.column(0).chunks:
            rows += _row_views(chunk)
        return rows

    def labels(self, read: ReadRange, column: str, *, name: str) -> list[Any]:
        """Every row's label, read with one ranged request per row group."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        meta = pq.read_metadata(pa.BufferReader(b"PAR1" + self.footer))
        leaves = [i for i in range(meta.num_columns) if meta.schema.column(i).path == column]
        if not leaves:
            raise InvalidRequest(f"{name} has no label column {column!r}: name its label column")
        pieces = {self.size - len(self.footer): self.footer}
        for g in range(meta.num_row_groups):
            start, end = _span(meta.row_group(g).column(leaves[0]))
            pieces[start] = read(start, end)
        table = pq.ParquetFile(pa.PythonFile(_Sparse(self.size, pieces), mode="r")).read(
            columns=[column]
        )
        return table.column(0).to_pylist()


def class_names(schema: Any, label: str) -> list[str] | None:
    """The label's class names from Hugging Face's schema metadata (a `ClassLabel`)."""
    meta = (schema.metadata or {}).get(b"huggingface")
    if not meta:
        return None
    try:
        feature = json.loads(meta)["info"]["features"][label]
        names = feature.get("names") if feature.get("_type") == "ClassLabel" else None
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    return [str(n) for n in names] if isinstance(names, list) else None


def find_column(schema: Any, names: Sequence[str], file: str, what: str) -> str:
    """The first of `names` that `schema` has (any case).

    Raises:
        InvalidRequest: none of them, naming the file's columns and how to name one.
    """
    have = {n.lower(): n for n in schema.names}
    for n in names:
        if n in have:
            return have[n]
    raise InvalidRequest(
        f"{file} has no {what} column named {'/'.join(names)} (its columns: "
        f"{shorten(', '.join(schema.names))}): name it, e.g. `{what}_column=`"
    )


def _span(column: Any) -> tuple[int, int]:
    start = column.data_page_offset
    if column.has_dictionary_page and column.dictionary_page_offset is not None:
        start = min(start, column.dictionary_page_offset)
    return start, start + column.total_compressed_size


def _row_views(array: Any) -> list[Blob | None]:
    """Each row's image bytes as a view of the array's data buffer (None: null, or not
    bytes at all)."""
    import numpy as np
    import pyarrow as pa

    if pa.types.is_struct(array.type):  # Hugging Face's Image(): {"bytes": ..., "path": ...}
        names = [array.type.field(i).name for i in range(array.type.num_fields)]
        if "bytes" not in names:
            return [None] * len(array)
        array = array.flatten()[names.index("bytes")]  # the parent's nulls included
    if not (pa.types.is_binary(array.type) or pa.types.is_large_binary(array.type)):
        return [None] * len(array)
    wide = np.int64 if pa.types.is_large_binary(array.type) else np.int32
    _, offsets_buffer, data_buffer = array.buffers()
    offsets = np.frombuffer(offsets_buffer, wide)[array.offset : array.offset + len(array) + 1]
    data = memoryview(data_buffer if data_buffer is not None else b"")
    valid = array.is_valid().to_numpy(zero_copy_only=False)
    bounds = offsets.tolist()
    return [data[bounds[i] : bounds[i + 1]] if valid[i] else None for i in range(len(array))]


class _Sparse(io.RawIOBase):
    """A read-only file of `size` bytes of which only `pieces` (offset -> bytes) are known:
    enough for pyarrow to decode the row groups whose bytes were read."""

    def __init__(self, size: int, pieces: Mapping[int, Blob]) -> None:
        self.size, self.pieces, self.pos = size, sorted(pieces.items()), 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = base + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read_buffer(self, size: int = -1) -> Blob:
        """The next `size` bytes; a view of a piece where they lie within one, so pyarrow
        decodes the column from the response's buffer, not from a copy of it (it asks
        for `read_buffer` where a file has one)."""
        want = max(0, min(size if size >= 0 else self.size, self.size - self.pos))
        for at, data in self.pieces:
            if at <= self.pos and self.pos + want <= at + len(data):
                view = memoryview(data)[self.pos - at : self.pos - at + want]
                self.pos += want
                return view
        return self.read(want) or b""

    def readinto(self, buffer: Any) -> int:
        # Bytes not read are zeros: pyarrow reads the last 64 KiB for the footer, of which
        # it uses only the footer, and reads no column chunk it was not asked for.
        want = max(0, min(len(buffer), self.size - self.pos))
        view = memoryview(buffer).cast("B")
        end, filled = self.pos + want, self.pos
        for at, data in self.pieces:  # sorted by offset
            lo, hi = max(at, self.pos), min(at + len(data), end)
            if lo < hi:
                if lo > filled:
                    view[filled - self.pos : lo - self.pos] = bytes(lo - filled)
                view[lo - self.pos : hi - self.pos] = data[lo - at : hi - at]
                filled = max(filled, hi)
        view[filled - self.pos : want] = bytes(end - filled)
        self.pos = end
        return want
