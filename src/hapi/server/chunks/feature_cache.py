"""The storage tier of the feature cache: features a server computed, kept beside the data.

`hapi serve --feature-cache DIR` keeps each computed feature in a `FeatureCache` under its
session's `FeatureSpace` and its key, object version and view, for any later session whose
head has the same content. Lookups come after the tenant's prefix check; hits and misses
are sent in the ticket's order; a miss is stored only for the version the ticket names, by
a writer thread that drops what it cannot keep up with. More: docs/server.md, "The feature
cache's storage tier".
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, cast, runtime_checkable

import pyarrow as pa
import torch
from torch import nn

from hapi._sizes import parse_bytes
from hapi.cache import FeatureCache, FeatureSpace, entry_name
from hapi.data import ObjectStore
from hapi.data.samples import read_objects
from hapi.data.shards.blob import Blob
from hapi.data.shards.members import split_member
from hapi.graph import INPUT, RAW
from hapi.graph.content import module_digest
from hapi.server.chunks._batches import Wire, encode, samples_per_batch
from hapi.server.chunks._counters import TimedReads
from hapi.server.chunks._outbox import Outbox
from hapi.server.chunks._write_behind import WriteBehind
from hapi.server.chunks.tier import (
    NO_FEATURE_CACHE,
    ChunkLookup,
    ChunkSession,
    Compute,
    FeatureTier,
    Uncached,
)
from hapi.wire import ChunkTicket
from hapi.wire.batches import decode_batch
from hapi.wire.messages import UploadedHead
from hapi.wire.replies import FeatureCacheStats

__all__ = ["ServerFeatureCache", "open_feature_cache"]

log = logging.getLogger("hapi.server")


@runtime_checkable
class VersionedStore(Protocol):
    """A store that tells which version of an object a read returned (`Store`); a store
    without it (an embedding program's own) is served, but nothing it reads is cached."""

    def get_versioned(self, key: str) -> tuple[bytes, str]: ...


def open_feature_cache(directory: str | Path | None, *, size: int | str) -> FeatureTier:
    """The server's feature cache in `directory`, of at most `size` bytes (`ServerConfig`'s
    `feature_cache` and `feature_cache_size`); `NO_FEATURE_CACHE` when None.

    Raises:
        InvalidRequest: the directory is a file, or the size is not one.
    """
    if directory is None:
        return NO_FEATURE_CACHE
    # No memory tier: decoded entries in the server's memory would sit outside its budget.
    cache = FeatureCache(directory, max_bytes=parse_bytes(size), memory_bytes=0)
    return ServerFeatureCache(cache)


class ServerFeatureCache:
    """A server's feature cache: the spaces of its sessions, lookups, and a writer.

    Args:
        cache: the directory of entries, shared with other processes that open it.
    """

    def __init__(self, cache: FeatureCache) -> None:
        self.cache = cache
        self._lock = threading.Lock()
        self._digests: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        self._digest_lock = threading.Lock()
        self._hits = 0
        self._misses = 0
        self._held: int | None = None
        self.writer = WriteBehind(cache)

    def __repr__(self) -> str:
        return f"ServerFeatureCache({self.cache!r})"

    def space(self, session: ChunkSession) -> FeatureSpace | None:
        """The space of a session's features, or None when they are not cached here: RAW
        sends objects, not features, and int8's and fp8's rounding is redone on every
        encode."""
        request = session.request
        if request.cut == RAW or request.wire_dtype in ("int8", "fp8"):
            return None
        if request.cut == INPUT or session.head is None:
            head = "input"
        elif isinstance(request.model, UploadedHead) and request.model.artifact:
            head = f"uploaded:{request.model.artifact}"  # its content address already
        else:
            try:
                head = self.head_digest(session.head)
            except Exception:  # a head whose tensors cannot be read out: served, uncached
                log.warning("feature cache: cannot digest the head of session %s", session.id)
                return None
        transforms = session.transforms
        return FeatureSpace(
            # Kernels differ between devices: exact features are exact on one kind only;
            # a bf16 head's features are another head's.
            head=f"{head}@{session.device.type}" + _precision(session),
            cut=request.cut,
            transforms=transforms.to_dict(),
            wire_dtype=request.wire_dtype,
            exact=request.exact,
            seed=request.seed if transforms.random_ops else None,
        )

    def head_digest(self, head: nn.Module) -> str:
        """The content digest of a head, computed once per module the head cache holds (a
        head rebuilt after eviction is digested again: a named model's random weights
        may differ)."""
        with self._digest_lock:
            digest = self._digests.get(head)
            if digest is None:
                digest = self._digests[head] = module_digest(head)
            return digest

    def lookup(self, session: ChunkSession, ticket: ChunkTicket) -> ChunkLookup:
        """The chunk's hits and misses: cached only where the features repeat (a view,
        not fresh draws) and the client named each key's version."""
        view = session.transforms.view(ticket.epoch)
        if view is None or ticket.versions is None:
            return Uncached(ticket)
        space = self.space(session)
        if space is None:
            return Uncached(ticket)
        names = [entry_name(k, v, view) for k, v in zip(ticket.keys, ticket.versions, strict=True)]
        hit = [self.cache.contains(space, name) for name in names]
        return _CachedChunk(self, session, ticket, space, names, hit)

    def counted(self, *, hits: int = 0, misses: int = 0) -> None:
        with self._lock:
            self._hits += hits
            self._misses += misses

    def stats(self) -> FeatureCacheStats:
        """The cache's counters, for `stats` and the metrics."""
        s = self.cache.stats
        if s.writes or s.evictions:
            held = s.bytes_held  # counted by the cache once it wrote
        else:
            if self._held is None:
                self._held = sum(u.bytes for u in self.cache.usage())
            held = self._held
        with self._lock:
            hits, misses = self._hits, self._misses
        return FeatureCacheStats(
            directory=str(self.cache.root),
            max_bytes=self.cache.max_bytes,
            bytes_held=held,
            hits=hits,
            misses=misses,
            writes=s.writes,
            evictions=s.evictions,
            corrupt=s.corrupt,
            dropped=self.writer.dropped,
            write_failures=s.write_failures,
            write_error=self.cache.write_error,
        )

    def flush(self) -> None:
        """Wait until every feature offered to the writer is written (or dropped)."""
        self.writer.flush()

    def close(self) -> None:
        """Write what is pending and stop the writer."""
        self.writer.close()


class _VersionedReader:
    """The store as `read_objects` reads it (`get` only), noting each read's version."""

    def __init__(self, store: VersionedStore) -> None:
        self.store = store
        self.versions: dict[str, str] = {}

    def get(self, key: str) -> bytes:
        data, version = self.store.get_versioned(key)
        self.versions[key] = version
        return data

    @property
    def members(self) -> _VersionedMembers | None:
        """Shard members read as the store reads them - those close together in one
        request - noting their versions (`read_objects` reads members through it)."""
        members = getattr(self.store, "members", None)
        return None if members is None else _VersionedMembers(members, self.versions)


class _VersionedMembers:
    """A `MemberStore`'s batched reads, each member's version noted: its shard's, as the
    shard's index holds it once the read checked it (`MemberStore.get_versioned`'s rule)."""

    def __init__(self, members: Any, versions: dict[str, str]) -> None:
        self.members, self.versions = members, versions

    def read(
        self, keys: Sequence[str], *, ahead: int = 16, max_bytes: int | None = None
    ) -> Iterator[Blob | BaseException]:
        reads = self.members.read(keys, ahead=ahead, max_bytes=max_bytes)
        for key, data in zip(keys, reads, strict=True):
            parts = split_member(key)
            if parts is not None and not isinstance(data, BaseException):
                # A whole object among members has no version here: it is not kept.
                self.versions[key] = self.members.indexes.version(parts[0])
            yield data


class _CachedChunk:
    """A chunk of a cacheable session: its hits sent from the cache, its misses computed
    and offered to it."""

    def __init__(
        self,
        tier: ServerFeatureCache,
        session: ChunkSession,
        ticket: ChunkTicket,
        space: FeatureSpace,
        names: list[str],
        hit: list[bool],
    ) -> None:
        self.tier, self.session, self.ticket, self.space = tier, session, ticket, space
        self.names, self.hit = names, hit
        self.to_read: Sequence[str] = [k for k, h in zip(ticket.keys, hit, strict=True) if not h]
        self.cached = 0
        self.hit_s = 0.0
        self._reader: _VersionedReader | None = None
        self._source: ObjectStore | None = None
        assert ticket.versions is not None  # lookup checked it
        self._entries = {
            k: (v, n) for k, v, n in zip(ticket.keys, ticket.versions, names, strict=True)
        }

    def reader(self, store: ObjectStore) -> ObjectStore:
        if isinstance(store, VersionedStore):
            self._reader = _VersionedReader(store)
            # `read_objects` calls `get` alone.
            self._source = cast("ObjectStore", self._reader)
        else:
            self._source = store  # read as ever; nothing read is stored
        return self._source

    def produce(
        self, compute: Compute, reads: Iterable[Blob | BaseException], out: Outbox[Wire]
    ) -> None:
        for start, end, hit in _runs(self.hit):
            if out.closed:
                return
            if hit:
                self._send_hits(start, end, compute, out)
            else:
                compute(self._part(start, end), reads, self._sent)

    def _send_hits(self, start: int, end: int, compute: Compute, out: Outbox[Wire]) -> None:
        session = self.session
        per_batch = samples_per_batch(session.info.bytes_per_sample)
        for first in range(start, end, per_batch):
            last = min(first + per_batch, end)
            t0 = time.perf_counter()
            tensors = self.tier.cache.get_many(self.space, self.names[first:last])
            self.hit_s += time.perf_counter() - t0
            # An entry evicted or found corrupt since the lookup is a miss after all.
            found = [t is not None for t in tensors]
            for a, b, got in _runs(found):
                if out.closed:
                    return
                if got:
                    keys = self.ticket.keys[first + a : first + b]
                    labels = self.ticket.labels[first + a : first + b]
                    t0 = time.perf_counter()
                    x = torch.stack([t for t in tensors[a:b] if t is not None])
                    batch = encode(session.schema, session.stats, keys, labels, features=x)
                    self.hit_s += time.perf_counter() - t0
                    if not out.put((batch, None)):
                        return
                    self.cached += b - a
                    session.stats.add(cache_hits=b - a)
                    self.tier.counted(hits=b - a)
                else:
                    self._compute_late(first + a, first + b, compute)

    def _compute_late(self, start: int, end: int, compute: Compute) -> None:
        """Read and compute keys the lookup took for hits."""
        keys = self.ticket.keys[start:end]
        assert self._source is not None  # the session asked for the reader first
        read = read_objects(self._source, keys, ahead=min(len(keys), 16))
        with contextlib.closing(read):
            reads = TimedReads(read)
            try:
                compute(self._part(start, end), reads, self._sent)
            finally:
                self.session.stats.add(read_s=reads.waited, bytes_read=reads.nbytes)

    def _part(self, start: int, end: int) -> ChunkTicket:
        assert self.ticket.versions is not None
        return self.ticket.model_copy(
            update={
                "keys": self.ticket.keys[start:end],
                "labels": self.ticket.labels[start:end],
                "versions": self.ticket.versions[start:end],
            }
        )

    def _sent(self, batch: pa.RecordBatch) -> None:
        """Offer a computed batch's features to the cache: those whose object was read at
        the version the ticket names."""
        decoded = decode_batch(batch)
        n = len(decoded.keys)
        self.session.stats.add(cache_misses=n)
        self.tier.counted(misses=n)
        if self._reader is None or decoded.features is None:
            return
        names, tensors = [], []
        for i, key in enumerate(decoded.keys):
            version, name = self._entries[key]
            if self._reader.versions.get(key) == version:
                names.append(name)
                tensors.append(decoded.features[i].clone())
        if names:
            self.tier.writer.offer(self.space, names, tensors)


def _runs(flags: Sequence[bool]) -> list[tuple[int, int, bool]]:
    """`(start, end, flag)` of each run of equal flags, in order."""
    runs: list[tuple[int, int, bool]] = []
    start = 0
    for i in range(1, len(flags) + 1):
        if i == len(flags) or flags[i] != flags[start]:
            runs.append((start, i, flags[start]))
            start = i
    return runs


def _precision(session: ChunkSession) -> str:
    """`/bfloat16` for a session whose head runs in bf16; empty for fp32."""
    dtype = session.head_dtype
    return "" if dtype == torch.float32 else f"/{str(dtype).removeprefix('torch.')}"
