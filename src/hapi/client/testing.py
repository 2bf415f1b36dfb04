"""`MemorySource`: a `ChunkSource` in memory, for testing code that drives a loader.

It serves a dataset whose features are a function of the key (`feature_of`), in batches,
with a report at each chunk's end, as a server does - and fails on request: a stream cut
after some parts (`ServerUnavailable`), a store away (`StoreUnavailable`), a session lost
(`SessionNotFound`), a stream recalled (`StreamRecalled`). It records every ticket, so a
test can assert what was asked of it, when, and how many streams were open at once.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from hapi.client.connection import ChunkPart
from hapi.errors import (
    HapiError,
    ServerUnavailable,
    SessionNotFound,
    StreamRecalled,
)
from hapi.wire import (
    ChunkReport,
    ChunkTicket,
    FeatureBatch,
    ServerStats,
    SessionInfo,
    SessionRequest,
    SessionStats,
    SkippedKey,
)

__all__ = ["MemorySource", "feature_of"]


def feature_of(key: str, width: int = 4) -> torch.Tensor:
    """The feature a `MemorySource` serves for `key`: distinct per key, the same every time."""
    seed = sum(ord(c) * (i + 1) for i, c in enumerate(key))
    return torch.arange(width, dtype=torch.float32) + float(seed % 10_007)


@dataclass
class _Fault:
    """A failure a stream meets after `after` parts (0: as it opens)."""

    error: HapiError
    after: int = 0


@dataclass
class MemorySource:
    """A server in memory.

    Args:
        address: its name in events and errors.
        batch_size: keys per part.
        cut: the cut its sessions report.
        part_delay_s: seconds before each part (a slow server or link).
        on_part: called with (ticket, part index) before each part, in the reading
            thread (to block, count or recall at a precise moment).
    """

    address: str = "memory://0"
    batch_size: int = 4
    cut: int = 1
    part_delay_s: float = 0.0
    on_part: Callable[[ChunkTicket, int], None] | None = None
    tickets: list[ChunkTicket] = field(default_factory=list)
    """Every ticket streamed, in order."""
    opened: list[str] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)
    keepalives: int = 0
    max_open: int = 0
    """The most streams open at once."""
    skip: set[str] = field(default_factory=set)
    """Keys it reports skipped (a corrupt object under `on_error="skip"`)."""
    _faults: list[_Fault] = field(default_factory=list)
    _sessions: set[str] = field(default_factory=set)
    _streams: list[_MemoryStream] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _ids: Iterator[int] = field(default_factory=itertools.count)

    def fail_next(self, error: HapiError, *, after: int = 0, times: int = 1) -> None:
        """The next `times` streams fail with `error` after `after` parts."""
        with self._lock:
            self._faults.extend(_Fault(error, after) for _ in range(times))

    def forget_sessions(self) -> None:
        """Lose every session, as a restarted server does."""
        with self._lock:
            self._sessions.clear()

    @property
    def open_streams(self) -> int:
        with self._lock:
            return len(self._streams)

    # ChunkSource -------------------------------------------------------------------------

    def open_session(self, request: SessionRequest) -> SessionInfo:
        with self._lock:
            session = f"mem-{next(self._ids)}"
            self._sessions.add(session)
            self.opened.append(session)
        return SessionInfo(
            session=session,
            cut=request.cut,
            freeze=request.freeze if isinstance(request.freeze, int) else request.cut,
            num_cuts=max(request.cut, 1) + 1,
            feature_shape=[4],
            wire_dtype=request.wire_dtype,
            bytes_per_sample=16,
        )

    def close_session(self, session: str) -> SessionStats:
        with self._lock:
            self._sessions.discard(session)
            self.closed.append(session)
        return SessionStats()

    def keepalive(self, session: str) -> None:
        with self._lock:
            self.keepalives += 1
            if session not in self._sessions:
                raise SessionNotFound(f"no session {session} on {self.address}")

    def stream(self, ticket: ChunkTicket) -> _MemoryStream:
        with self._lock:
            if ticket.session not in self._sessions:
                raise SessionNotFound(f"no session {ticket.session} on {self.address}")
            self.tickets.append(ticket)
            fault = self._faults.pop(0) if self._faults else None
            stream = _MemoryStream(self, ticket, fault)
            self._streams.append(stream)
            self.max_open = max(self.max_open, len(self._streams))
        if fault is not None and fault.after == 0:
            stream.close()
            raise fault.error
        return stream

    def recall(self) -> bool:
        with self._lock:
            streams, self._streams = self._streams, []
        for stream in streams:
            stream.recalled = True
        return bool(streams)

    def stats(self) -> ServerStats:
        return ServerStats(
            store="memory://", heads_cached=0, heads_bytes=0, bytes_sent=0, cpu_s=0.0
        )

    def _closed(self, stream: _MemoryStream) -> None:
        with self._lock:
            if stream in self._streams:
                self._streams.remove(stream)


class _MemoryStream:
    """One chunk's parts, computed as they are read."""

    def __init__(self, source: MemorySource, ticket: ChunkTicket, fault: _Fault | None) -> None:
        self.source, self.ticket, self.fault = source, ticket, fault
        self.cancelled = threading.Event()
        self.recalled = False

    def __iter__(self) -> Iterator[ChunkPart]:
        source, ticket = self.source, self.ticket
        keys = [k for k in ticket.keys if k not in source.skip]
        label = dict(zip(ticket.keys, ticket.labels, strict=True))
        try:
            for index, start in enumerate(range(0, max(len(keys), 1), source.batch_size)):
                self._check(index)
                part = keys[start : start + source.batch_size]
                last = start + source.batch_size >= len(keys)
                report = (
                    ChunkReport(
                        chunk=ticket.chunk,
                        skipped=[
                            SkippedKey(key=k, error="CorruptObject", message="skipped")
                            for k in ticket.keys
                            if k in source.skip
                        ],
                    )
                    if last
                    else None
                )
                batch = None
                if part:
                    features = torch.stack([feature_of(k) for k in part])
                    labels = torch.tensor([label[k] for k in part], dtype=torch.int64)
                    batch = FeatureBatch(part, labels, features=features)
                yield ChunkPart(batch, 16 * len(part), report)
        finally:
            self.close()

    def _check(self, index: int) -> None:
        source = self.source
        if source.on_part is not None:
            source.on_part(self.ticket, index)
        if source.part_delay_s and self.cancelled.wait(source.part_delay_s):
            pass
        if self.recalled:
            raise StreamRecalled(f"chunk {self.ticket.chunk}'s stream was recalled")
        if self.cancelled.is_set():
            raise ServerUnavailable(f"chunk {self.ticket.chunk}'s stream was cancelled")
        if self.fault is not None and index >= self.fault.after:
            raise self.fault.error

    def cancel(self) -> None:
        self.cancelled.set()

    def close(self) -> None:
        self.source._closed(self)
