"""`MemberStore`: a store whose keys may also name a sample inside a shard.

A member's key is `CONTAINER#MEMBER`: `shards/train-003.tar#KEY` (a WebDataset sample) or
`data/train-0001.parquet#row=123` (a Parquet row). Reading one is a ranged request found
through the shard's index (`hapi.data.shards.indexes`); `read` reads a run of members
that lie close together with one request (`hapi.data.shards.blob`). More: docs/data.md,
"Samples inside shards".
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict, deque
from collections.abc import Generator, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from hapi.data.shards.blob import Blob
from hapi.data.shards.indexes import ShardIndexes, StaleIndex
from hapi.data.shards.parquet_index import ParquetIndex
from hapi.data.shards.tar_index import TarIndex
from hapi.errors import CorruptObject, InvalidRequest, ObjectNotFound, shorten

__all__ = ["MemberStore", "member_containers", "member_store", "split_member"]

_CONTAINERS = (".tar", ".parquet")


def split_member(key: str) -> tuple[str, str] | None:
    """A member key's (container key, member), or None for a key naming a whole object."""
    lower = key.lower()
    for ext in _CONTAINERS:
        at = lower.find(ext + "#")
        if at > 0:
            return key[: at + len(ext)], key[at + len(ext) + 1 :]
    return None


def member_containers(keys: pa.Array) -> pa.Array:
    """`split_member`'s container key of each of `keys` (a string array), null for a key
    naming a whole object: the same answers, from Arrow's regex engine (a Python call a
    key took 0.9 s at a million, this 0.3 s)."""
    found = pa.nulls(len(keys), pa.string())
    left = pc.is_valid(keys)
    for ext in _CONTAINERS:  # `split_member`'s order: the first container that names one
        if not pc.any(left).as_py():
            break
        asked = keys if left.false_count == 0 else pc.filter(keys, left)
        pattern = f"(?i)^(?P<container>.+?{re.escape(ext)})#"
        named = pc.struct_field(pc.extract_regex(asked, pattern), [0])
        # `split_member` takes the extension's first place: at the key's start, none.
        named = pc.if_else(pc.starts_with(asked, ext + "#", ignore_case=True), None, named)
        found = named if left.false_count == 0 else pc.replace_with_mask(found, left, named)
        left = pc.is_null(found)
    return found


def parquet_member(member: str, key: str) -> tuple[int, str | None]:
    """A Parquet member's (row, image column or None).

    Raises:
        InvalidRequest: not `row=N` (with `&image=COL`), naming the key.
    """
    fields = dict(p.partition("=")[::2] for p in member.split("&"))
    row = fields.pop("row", "")
    image = fields.pop("image", None)
    if not row.isdigit() or fields:
        raise InvalidRequest(
            f"key {shorten(repr(key))} names no Parquet row: write FILE.parquet#row=N "
            "(optionally &image=COLUMN)"
        )
    return int(row), image


@dataclass
class _Read:
    """One request: the positions of the keys it serves and the byte span it reads."""

    positions: list[int]
    container: str = ""
    start: int = 0
    end: int = 0
    offsets: list[tuple[int, int]] = field(default_factory=list)
    """Each position's (start, size) within a tar span; a Parquet read's rows."""
    group: int = -1
    index: Any = None
    """A Parquet read's index, and the image column its keys named (None: found by name)."""
    image: str | None = None
    error: BaseException | None = None

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(eq=False)
class MemberStore:
    """An `ObjectStore` over `inner` in which member keys (`CONTAINER#MEMBER`) read a
    sample of a shard; other keys, and writes and listings, go to `inner` as they are.

    Args:
        inner: the store (a `Store`: ranged reads need `get_range_versioned`).
        max_gap: members of one shard less than this many bytes apart are read with one
            request (the gap is read and dropped).
        max_span: at most this many bytes in one request; a longer span (a run of
            members, a Parquet row group's column) is read as several requests at once,
            so their first-byte latencies overlap. One request per chunk by default: on
            SeaweedFS, pieces of 2 MiB cost the store's core half as much again per byte.
    """

    inner: Any
    max_gap: int = 256 << 10
    max_span: int = 64 << 20
    row_groups_cached: int = 8
    """Decoded Parquet row groups kept, so the chunks of one row group read it once."""

    def __post_init__(self) -> None:
        self.indexes = ShardIndexes(self.inner)
        self._groups: OrderedDict[tuple[str, str, str, int], list[Blob | None]] = OrderedDict()
        self._loading: dict[tuple[str, str, str, int], Future[list[Blob | None]]] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"inner": self.inner, "max_gap": self.max_gap, "max_span": self.max_span}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    @property
    def uri(self) -> str:
        return str(self.inner.uri)

    def __repr__(self) -> str:
        return repr(self.inner)

    def __str__(self) -> str:
        return str(self.inner)

    def __getattr__(self, name: str) -> Any:
        # Writes, listings and the store's other methods (`check`, `size`, ...) are the
        # inner store's: only reading a sample differs.
        if name.startswith("_") or name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def get(self, key: str) -> bytes:
        if split_member(key) is None:
            return bytes(self.inner.get(key))
        result = self.get_many([key])[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def get_versioned(self, key: str) -> tuple[bytes, str]:
        """The sample's bytes and its object's version: a member's is its shard's."""
        parts = split_member(key)
        if parts is None:
            data, version = self.inner.get_versioned(key)
            return bytes(data), str(version)
        data = self.get(key)
        return data, self.indexes.version(parts[0])

    def get_many(self, keys: Iterable[str]) -> list[bytes | BaseException]:
        return [
            r if isinstance(r, BaseException | bytes) else bytes(r) for r in self.read(list(keys))
        ]

    def real_key(self, key: str) -> str:
        """Where a local store's symlinks lead the key: a member's shard is what is read."""
        parts = split_member(key)
        if parts is None:
            return str(self.inner.real_key(key))
        return f"{self.inner.real_key(parts[0])}#{parts[1]}"

    def read(
        self, keys: Sequence[str], *, ahead: int = 16, max_bytes: int | None = None
    ) -> Generator[Blob | BaseException, None, None]:
        """Each key's bytes in order (or the exception its read raised), members of one
        shard lying close together read with one request (a member is a view of it);
        `ahead` requests in flight, and no new one while those read and not yet taken
        pass `max_bytes`."""
        reads = self._plan(keys)
        if not reads:
            return
        owner = {p: i for i, r in enumerate(reads) for p in r.positions}
        left = [len(r.positions) for r in reads]
        limit = max_bytes if max_bytes is not None else float("inf")
        with ThreadPoolExecutor(min(ahead, len(reads)), thread_name_prefix="hapi-read") as pool:
            futures: dict[int, Future[dict[int, Blob | BaseException]]] = {}
            queue: deque[int] = deque(range(len(reads)))
            try:
                for position in range(len(keys)):
                    i = owner[position]
                    while queue and (
                        queue[0] <= i
                        or (len(futures) < ahead and sum(reads[j].nbytes for j in futures) < limit)
                    ):
                        j = queue.popleft()
                        futures[j] = pool.submit(self._run, keys, reads[j])
                    result = futures[i].result()[position]
                    left[i] -= 1
                    if not left[i]:
                        del futures[i]
                    yield result
            finally:
                for future in futures.values():
                    future.cancel()

    def _plan(self, keys: Sequence[str]) -> list[_Read]:
        """The requests that read `keys`, in the order their first key is needed."""
        reads: list[_Read] = []
        by_shard: dict[str, list[tuple[int, str]]] = {}
        for position, key in enumerate(keys):
            parts = split_member(key)
            if parts is None:
                reads.append(_Read([position]))
            else:
                by_shard.setdefault(parts[0], []).append((position, parts[1]))
        for container, members in by_shard.items():
            if container.lower().endswith(".parquet"):
                reads += self._parquet_reads(container, members, keys)
                continue
            try:
                index = self.indexes.get(container)
            except Exception as exc:
                reads.append(_Read([p for p, _ in members], container, error=exc))
                continue
            assert isinstance(index, TarIndex)  # a .tar container
            reads += self._tar_reads(container, index, members, keys)
        reads.sort(key=lambda r: min(r.positions))
        return reads

    def _tar_reads(
        self, container: str, index: TarIndex, members: list[tuple[int, str]], keys: Sequence[str]
    ) -> list[_Read]:
        found: list[tuple[int, int, int]] = []
        reads: list[_Read] = []
        for position, member in members:
            sample = index.find(member)
            if sample is None:
                reads.append(_Read([position], container, error=_missing(keys[position])))
            else:
                found.append((sample.offset, sample.size, position))
        found.sort()
        run: _Read | None = None
        for offset, size, position in found:
            if (
                run is None
                or offset - run.end > self.max_gap
                or offset + size - run.start > self.max_span
            ):
                run = _Read([], container, offset, offset)
                reads.append(run)
            run.positions.append(position)
            run.offsets.append((offset, size))
            run.end = max(run.end, offset + size)
        return reads

    def _parquet_reads(
        self,
        container: str,
        members: list[tuple[int, str]],
        keys: Sequence[str],
    ) -> list[_Read]:
        groups: dict[tuple[str | None, int], _Read] = {}
        reads: list[_Read] = []
        for position, member in members:
            try:
                row, image = parquet_member(member, keys[position])
                index = self.indexes.get(container, image=image)
                assert isinstance(index, ParquetIndex)  # a .parquet container
                g = index.group_of(row)
                if g < 0:
                    raise _missing(keys[position])
            except Exception as exc:
                reads.append(_Read([position], container, error=exc))
                continue
            rg = index.groups[g]
            read = groups.get((image, g))
            if read is None:
                read = _Read([], container, rg.start, rg.end, group=g, index=index, image=image)
                groups[image, g] = read
                reads.append(read)
            read.positions.append(position)
            read.offsets.append((row - rg.first_row, 0))
        return reads

    def _run(
        self, keys: Sequence[str], read: _Read, *, again: bool = True
    ) -> dict[int, Blob | BaseException]:
        try:
            return self._run_once(keys, read)
        except StaleIndex:
            if not again:
                raise
            # The shard was rewritten since it was indexed: plan these keys on the new one.
            mine = [keys[p] for p in read.positions]
            out: dict[int, Blob | BaseException] = {}
            for sub in self._plan(mine):
                for p, value in self._run(mine, sub, again=False).items():
                    out[read.positions[p]] = value
            return out
        except Exception as exc:
            return dict.fromkeys(read.positions, exc)

    def _run_once(self, keys: Sequence[str], read: _Read) -> dict[int, Blob | BaseException]:
        if read.error is not None:
            raise read.error
        if not read.container:
            return {read.positions[0]: bytes(self.inner.get(keys[read.positions[0]]))}
        if read.group >= 0:
            rows = self._row_group(read)
            out: dict[int, Blob | BaseException] = {}
            for position, (row, _) in zip(read.positions, read.offsets, strict=True):
                value = rows[row]
                out[position] = (
                    value
                    if value is not None
                    else CorruptObject(f"{keys[position]} holds no image bytes (null)")
                )
            return out
        span = self.indexes.read(read.container, read.start, read.end)
        # Views, not copies: a member is copied once, by whoever takes it (`Blob`).
        return {
            p: span[o - read.start : o - read.start + n]
            for p, (o, n) in zip(read.positions, read.offsets, strict=True)
        }

    def _row_group(self, read: _Read) -> list[Blob | None]:
        index: ParquetIndex = read.index
        version = self.indexes.version(read.container, image=read.image)
        name = (read.container, version, index.image, read.group)
        with self._lock:
            if name in self._groups:
                self._groups.move_to_end(name)
                return self._groups[name]
            # Chunks in flight together share row groups (a chunk of the shard order
            # straddles two): one reads it, the others wait for its rows.
            loading = self._loading.get(name)
            if loading is None:
                self._loading[name] = mine = Future[list[Blob | None]]()
        if loading is not None:
            return loading.result()
        try:
            pieces = self.indexes.read_pieces(
                read.container, read.start, read.end, piece=self.max_span, image=read.image
            )
            rows = index.read_group(read.group, pieces, name=read.container)
        except BaseException as exc:
            with self._lock:
                del self._loading[name]
            mine.set_exception(exc)
            raise
        with self._lock:
            del self._loading[name]
            self._groups[name] = rows
            while len(self._groups) > self.row_groups_cached:
                self._groups.popitem(last=False)
        mine.set_result(rows)
        return rows


def member_store(store: Any) -> MemberStore:
    """`store` (an `ObjectStore` with ranged reads) able to read member keys: itself if it
    already is, else a `MemberStore` over it."""
    if isinstance(store, MemberStore):
        return store
    return MemberStore(store)


def _missing(key: str) -> ObjectNotFound:
    return ObjectNotFound(
        f"sample {shorten(repr(key))} is not in its shard: list the dataset again "
        "(the shard was rewritten)"
    )
