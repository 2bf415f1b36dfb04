"""A session: one job's head, transforms and wire format on a server, and its chunk pipeline."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pyarrow as pa
import torch
from torch import nn

from hapi.data import ObjectStore, Transforms, load_sample, sample_seed
from hapi.errors import HapiError, InvalidRequest
from hapi.graph import RAW
from hapi.wire import ChunkTicket, SessionInfo, SessionRequest, encode_batch

__all__ = ["Session", "SessionStats"]

# RAW batches are cut at about this many bytes so shaping and memory stay smooth.
_RAW_BATCH_BYTES = 4 << 20


@dataclass
class SessionStats:
    """What a session has cost the server so far (seconds, counts, bytes)."""

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
    """CPU time of the chunk pipeline's threads (decode, transform, head, encode): what
    the server's cores spent, which wall times over-count when chunks run concurrently."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def as_dict(self) -> dict[str, float]:
        with self._lock:
            return {k: v for k, v in vars(self).items() if not k.startswith("_")}


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
    stats: SessionStats = field(default_factory=SessionStats)
    last_used: float = field(default_factory=time.monotonic)
    """When a chunk of this session last started (monotonic clock)."""

    def run_chunk(
        self, ticket: ChunkTicket, store: ObjectStore
    ) -> Iterator[tuple[pa.RecordBatch, bytes | None]]:
        """Read, decode, transform and run the head over a chunk; yield wire batches.

        Each batch may carry app metadata: the last one lists the keys skipped under
        `on_error="skip"` with the reason, so nothing is lost silently.

        Raises:
            HapiError: a missing or corrupt object under `on_error="raise"` (naming the key).
        """
        if len(ticket.labels) != len(ticket.keys):
            raise InvalidRequest(
                f"chunk {ticket.chunk} has {len(ticket.keys)} keys but {len(ticket.labels)} labels"
            )
        cpu0 = time.thread_time()
        t0 = time.perf_counter()
        blobs = store.get_many(ticket.keys)
        self.stats.add(
            read_s=time.perf_counter() - t0,
            bytes_read=sum(len(b) for b in blobs if isinstance(b, bytes)),
        )
        skipped: list[dict[str, str]] = []
        batches = (
            self._raw_batches(ticket, blobs, skipped)
            if self.request.cut == RAW
            else self._feature_batches(ticket, blobs, skipped)
        )
        pending: pa.RecordBatch | None = None
        for batch in batches:
            if pending is not None:
                self.stats.add(cpu_s=time.thread_time() - cpu0)
                yield pending, None
                cpu0 = time.thread_time()
            pending = batch
        if pending is None:
            # Every key was skipped: an empty batch still carries the report.
            pending = pa.RecordBatch.from_pylist([], schema=self.schema)
        report = json.dumps({"chunk": ticket.chunk, "skipped": skipped}).encode()
        self.stats.add(chunks=1, skipped=len(skipped), cpu_s=time.thread_time() - cpu0)
        yield pending, report

    def _raw_batches(
        self, ticket: ChunkTicket, blobs: list[bytes | BaseException], skipped: list[dict[str, str]]
    ) -> Iterator[pa.RecordBatch]:
        keys: list[str] = []
        labels: list[int] = []
        data: list[bytes] = []
        size = 0
        for key, label, blob in zip(ticket.keys, ticket.labels, blobs, strict=True):
            if isinstance(blob, BaseException):
                self._fail_or_skip(key, blob, skipped)
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
        self, ticket: ChunkTicket, blobs: list[bytes | BaseException], skipped: list[dict[str, str]]
    ) -> Iterator[pa.RecordBatch]:
        keys: list[str] = []
        labels: list[int] = []
        inputs: list[torch.Tensor] = []
        for key, label, blob in zip(ticket.keys, ticket.labels, blobs, strict=True):
            t0 = time.perf_counter()
            try:
                if isinstance(blob, BaseException):
                    raise blob
                seed = sample_seed(self.request.seed, ticket.epoch, key)
                inputs.append(load_sample(blob, key, self.transforms, seed))
            except HapiError as exc:
                self._fail_or_skip(key, exc, skipped)
                continue
            finally:
                self.stats.add(transform_s=time.perf_counter() - t0)
            keys.append(key)
            labels.append(label)
            if len(inputs) == self.batch_size:
                yield self._forward(keys, labels, inputs)
                keys, labels, inputs = [], [], []
        if inputs:
            yield self._forward(keys, labels, inputs)

    def _forward(
        self, keys: list[str], labels: list[int], inputs: list[torch.Tensor]
    ) -> pa.RecordBatch:
        t0 = time.perf_counter()
        x = torch.stack(inputs).to(self.device)
        if self.head is not None:
            with torch.inference_mode():
                x = self.head(x)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stats.add(head_s=time.perf_counter() - t0)
        return self._encode(keys, labels, features=x)

    def _encode(self, keys: list[str], labels: list[int], **payload: object) -> pa.RecordBatch:
        t0 = time.perf_counter()
        batch = encode_batch(self.schema, keys, labels, **payload)  # type: ignore[arg-type]
        self.stats.add(encode_s=time.perf_counter() - t0, samples=len(keys))
        return batch

    def _fail_or_skip(self, key: str, exc: BaseException, skipped: list[dict[str, str]]) -> None:
        if self.request.on_error == "raise" or not isinstance(exc, HapiError):
            raise exc
        skipped.append({"key": key, "error": f"{type(exc).__name__}: {exc}"})
