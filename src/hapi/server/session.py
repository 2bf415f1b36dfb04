"""A session: one job's head, transforms and wire format on a server, and its chunk pipeline."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields

import pyarrow as pa
import torch
from torch import nn

from hapi.data import ObjectStore, Transforms
from hapi.data.samples import Sample, load_samples, read_objects, skip_or_raise
from hapi.errors import InvalidRequest
from hapi.graph import RAW
from hapi.wire import (
    ChunkReport,
    ChunkTicket,
    SessionInfo,
    SessionRequest,
    SessionStats,
    SkippedKey,
    encode_batch,
)

__all__ = ["Session", "SessionCounters"]

# RAW batches are cut at about this many bytes so shaping and memory stay smooth.
_RAW_BATCH_BYTES = 4 << 20


@dataclass
class SessionCounters:
    """What a session has cost the server so far; `snapshot` is its `SessionStats`."""

    chunks: int = 0
    samples: int = 0
    skipped: int = 0
    bytes_read: int = 0
    bytes_sent: int = 0
    read_s: float = 0.0
    transform_s: float = 0.0
    head_s: float = 0.0
    encode_s: float = 0.0
    shaping_wait_s: float = 0.0
    cpu_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **deltas: float) -> None:
        """Add to counters by name; chunks of a session run concurrently."""
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def snapshot(self) -> SessionStats:
        """The counters now, as the wire reports them."""
        with self._lock:
            return SessionStats(
                **{f.name: getattr(self, f.name) for f in fields(self) if f.name != "_lock"}
            )


@dataclass
class Session:
    """One job's state on a server. Chunks of a session may run concurrently."""

    id: str
    request: SessionRequest
    info: SessionInfo
    schema: pa.Schema
    head: nn.Module | None
    transforms: Transforms
    device: torch.device
    batch_size: int
    last_used: float
    """When a chunk of this session last started (the server's clock)."""
    read_ahead: int = 16
    """Objects a chunk reads ahead of the one it decodes."""
    stats: SessionCounters = field(default_factory=SessionCounters)

    def run_chunk(
        self, ticket: ChunkTicket, store: ObjectStore
    ) -> Iterator[tuple[pa.RecordBatch, bytes | None]]:
        """Read, decode, transform and run the head over a chunk; yield wire batches.

        The last batch carries app metadata, a `ChunkReport` listing the keys skipped
        under `on_error="skip"` with the reason, so nothing is lost silently.

        Raises:
            HapiError: a missing or corrupt object under `on_error="raise"` (naming the key).
        """
        if len(ticket.labels) != len(ticket.keys):
            raise InvalidRequest(
                f"chunk {ticket.chunk} has {len(ticket.keys)} keys but {len(ticket.labels)} "
                "labels: send one label per key"
            )
        cpu0 = time.thread_time()
        skipped: list[SkippedKey] = []
        with contextlib.closing(read_objects(store, ticket.keys, ahead=self.read_ahead)) as read:
            reads = _TimedReads(read)
            batches = (
                self._raw_batches(ticket, reads, skipped)
                if self.request.cut == RAW
                else self._feature_batches(ticket, reads, skipped)
            )
            pending: pa.RecordBatch | None = None
            try:
                for batch in batches:
                    if pending is not None:
                        self.stats.add(cpu_s=time.thread_time() - cpu0)
                        yield pending, None
                        cpu0 = time.thread_time()
                    pending = batch
            finally:
                self.stats.add(read_s=reads.waited, bytes_read=reads.nbytes)
        if pending is None:
            # Every key was skipped: an empty batch still carries the report.
            pending = pa.RecordBatch.from_pylist([], schema=self.schema)
        report = ChunkReport(chunk=ticket.chunk, skipped=skipped).to_bytes()
        self.stats.add(chunks=1, skipped=len(skipped), cpu_s=time.thread_time() - cpu0)
        yield pending, report

    def _raw_batches(
        self, ticket: ChunkTicket, reads: _TimedReads, skipped: list[SkippedKey]
    ) -> Iterator[pa.RecordBatch]:
        keys: list[str] = []
        labels: list[int] = []
        data: list[bytes] = []
        size = 0
        for key, label, blob in zip(ticket.keys, ticket.labels, reads, strict=True):
            if isinstance(blob, BaseException):
                left_out = skip_or_raise(key, blob, skip=self.request.on_error == "skip")
                skipped.append(SkippedKey.of(left_out.key, left_out.error))
                continue
            keys.append(key)
            labels.append(label)
            data.append(blob)
            size += len(blob)
            if size >= _RAW_BATCH_BYTES:
                yield self._encode(keys, labels, data=data)
                keys, labels, data, size = [], [], [], 0
        if keys:
            yield self._encode(keys, labels, data=data)

    def _feature_batches(
        self, ticket: ChunkTicket, reads: _TimedReads, skipped: list[SkippedKey]
    ) -> Iterator[pa.RecordBatch]:
        samples = load_samples(
            ticket.keys,
            ticket.labels,
            reads,
            self.transforms,
            seed=self.request.seed,
            epoch=ticket.epoch,
            skip=self.request.on_error == "skip",
        )
        batch: list[Sample] = []
        while True:
            t0, waited = time.perf_counter(), reads.waited
            item = next(samples, None)
            # Decoding and transforming: the time in load_samples not spent waiting on reads.
            self.stats.add(transform_s=time.perf_counter() - t0 - (reads.waited - waited))
            if item is None:
                break
            if isinstance(item, Sample):
                batch.append(item)
            else:
                skipped.append(SkippedKey.of(item.key, item.error))
            if len(batch) == self.batch_size:
                yield self._forward(batch)
                batch = []
        if batch:
            yield self._forward(batch)

    def _forward(self, samples: list[Sample]) -> pa.RecordBatch:
        t0 = time.perf_counter()
        x = torch.stack([s.tensor for s in samples]).to(self.device)
        if self.head is not None:
            with torch.inference_mode():
                x = self.head(x)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stats.add(head_s=time.perf_counter() - t0)
        return self._encode([s.key for s in samples], [s.label for s in samples], features=x)

    def _encode(self, keys: list[str], labels: list[int], **payload: object) -> pa.RecordBatch:
        t0 = time.perf_counter()
        batch = encode_batch(self.schema, keys, labels, **payload)  # type: ignore[arg-type]
        self.stats.add(encode_s=time.perf_counter() - t0, samples=len(keys))
        return batch


class _TimedReads:
    """The objects of a chunk, counting the time spent waiting for them and their bytes."""

    def __init__(self, objects: Iterable[bytes | BaseException]) -> None:
        self._objects = iter(objects)
        self.waited = 0.0
        self.nbytes = 0

    def __iter__(self) -> Iterator[bytes | BaseException]:
        while True:
            t0 = time.perf_counter()
            data = next(self._objects, None)
            self.waited += time.perf_counter() - t0
            if data is None:
                return
            if isinstance(data, bytes):
                self.nbytes += len(data)
            yield data
