"""`FeatureTier`: what a session's chunks ask of the server's feature cache.

The session runs a chunk through its tier without knowing whether there is a cache
(`NO_FEATURE_CACHE` computes every key); the cache reads what it needs of the session
through `ChunkSession`, so neither module imports the other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import pyarrow as pa
import torch
from torch import nn

from hapi.data import ObjectStore, Transforms
from hapi.data.shards.blob import Blob
from hapi.server.chunks._batches import Sent, Wire
from hapi.server.chunks._counters import SessionCounters
from hapi.server.chunks._outbox import Outbox
from hapi.wire import ChunkTicket, SessionInfo, SessionRequest
from hapi.wire.replies import FeatureCacheStats

__all__ = [
    "NO_FEATURE_CACHE",
    "ChunkLookup",
    "ChunkSession",
    "Compute",
    "FeatureTier",
    "Uncached",
]

Compute = Callable[[ChunkTicket, Iterable[Blob | BaseException], Sent], None]
"""Runs the session's pipeline over some of a chunk's keys, given their objects in order."""


class ChunkSession(Protocol):
    """What the feature cache reads of a session (`Session` is one): what its features
    depend on, for the cache's key, and where hits are encoded and counted."""

    id: str
    request: SessionRequest
    info: SessionInfo
    schema: pa.Schema
    head: nn.Module | None
    transforms: Transforms
    device: torch.device
    head_dtype: torch.dtype
    stats: SessionCounters


class ChunkLookup(Protocol):
    """One chunk's view of the cache: which objects it still reads, and how it runs."""

    to_read: Sequence[str]
    """The keys whose objects the chunk reads, in order (the misses)."""
    cached: int
    """Keys sent from the cache so far (the chunk report's `cached`)."""
    hit_s: float
    """Seconds spent reading hits from the cache and encoding them (the report's
    `server_s` counts them with the chunk's computing: they are the server's work)."""

    def reader(self, store: ObjectStore) -> ObjectStore:
        """The store to read `to_read` through."""
        ...

    def produce(
        self, compute: Compute, reads: Iterable[Blob | BaseException], out: Outbox[Wire]
    ) -> None:
        """Send the chunk's batches into `out`, in key order, computing the misses with
        `compute` from `reads` (the objects of `to_read`)."""
        ...


class FeatureTier(Protocol):
    """What a session asks of its server's feature cache."""

    def lookup(self, session: ChunkSession, ticket: ChunkTicket) -> ChunkLookup: ...

    def stats(self) -> FeatureCacheStats | None: ...

    def close(self) -> None: ...


def _ignore(_: pa.RecordBatch) -> None:
    pass


class Uncached:
    """A chunk computed as if there were no cache."""

    cached = 0
    hit_s = 0.0

    def __init__(self, ticket: ChunkTicket) -> None:
        self.ticket = ticket
        self.to_read: Sequence[str] = ticket.keys

    def reader(self, store: ObjectStore) -> ObjectStore:
        return store

    def produce(
        self, compute: Compute, reads: Iterable[Blob | BaseException], out: Outbox[Wire]
    ) -> None:
        compute(self.ticket, reads, _ignore)


class _NoFeatureCache:
    """A server without a feature cache: every chunk is computed."""

    def lookup(self, session: ChunkSession, ticket: ChunkTicket) -> ChunkLookup:
        return Uncached(ticket)

    def stats(self) -> FeatureCacheStats | None:
        return None

    def close(self) -> None:
        pass


NO_FEATURE_CACHE: FeatureTier = _NoFeatureCache()
