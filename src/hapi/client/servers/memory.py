"""`MemorySource`: a `Server` in memory, for testing code that drives a loader or a plan.

It serves features that are a function of the key (`feature_of`), in batches with a report
at each chunk's end, as a server does - and fails on request: a stream cut after some parts
(`ServerUnavailable`), a store away (`StoreUnavailable`), a session lost (`SessionNotFound`),
a stream recalled (`StreamRecalled`). It records every ticket: what was asked, when, and
how many streams were open at once. Given a store of objects, its RAW sessions send their
bytes, so a local share runs as against a server; given the server's pipeline too
(`compute`, a `LocalCompute`), its other sessions send the features it computes.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from hapi.client.servers.connection import ChunkPart
from hapi.data import DatasetManifest, ObjectStore
from hapi.errors import (
    HapiError,
    InvalidRequest,
    ServerUnavailable,
    SessionNotFound,
    StreamRecalled,
)
from hapi.graph import RAW, HeadArtifact
from hapi.wire import (
    ChunkReport,
    ChunkTicket,
    FeatureBatch,
    LocateReply,
    ProfileReply,
    ProfileRequest,
    ServerStats,
    SessionInfo,
    SessionRequest,
    SessionStats,
    SkippedKey,
)

__all__ = ["Compute", "MemorySource", "feature_of"]

Compute = Callable[[FeatureBatch, int, int], tuple[FeatureBatch, list[SkippedKey]]]
"""A server's pipeline: a raw batch, its epoch and a cut to features (`LocalCompute`)."""


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
        store: the objects; RAW sessions send their bytes. None: RAW is not served.
        compute: with `store`, the features of the other sessions' cuts, computed from
            the objects' bytes (None: `feature_of(key)` at every cut).
        open_delay_s: seconds an opening session takes (a server tracing a model).
        server_s_per_key: the server time each key reports, and adds to its session's
            CPU counter in `stats`.
        reports_time: whether chunk reports carry that time (older servers' do not).
    """

    address: str = "memory://0"
    batch_size: int = 4
    cut: int = 1
    part_delay_s: float = 0.0
    on_part: Callable[[ChunkTicket, int], None] | None = None
    store: ObjectStore | None = None
    compute: Compute | None = None
    open_delay_s: float = 0.0
    server_s_per_key: float = 0.0
    reports_time: bool = True
    tickets: list[ChunkTicket] = field(default_factory=list)
    """Every ticket streamed, in order."""
    requested: list[float] = field(default_factory=list)
    """When each ticket was streamed (`time.perf_counter()`), in the order of `tickets`."""
    cuts: dict[str, int] = field(default_factory=dict)
    """Each session's cut."""
    stats_calls: int = 0
    opened: list[str] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)
    keepalives: int = 0
    max_open: int = 0
    """The most streams open at once."""
    max_open_raw: int = 0
    """The most streams of RAW sessions open at once (a trainer's local chunks)."""
    faults_fired: int = 0
    """Faults of `fail_next` that failed a stream so far."""
    skip: set[str] = field(default_factory=set)
    """Keys it reports skipped (a corrupt object under `on_error="skip"`)."""
    heads: dict[str, HeadArtifact] = field(default_factory=dict)
    """The heads given to it (`put_head`), by digest."""
    local_keys: frozenset[str] | None = None
    """Keys whose (one) byte lies on its node, for `locate`; None: it does not say."""
    _faults: list[_Fault] = field(default_factory=list)
    _sessions: set[str] = field(default_factory=set)
    _streams: list[_MemoryStream] = field(default_factory=list)
    _cpu_s: dict[str, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _ids: Iterator[int] = field(default_factory=itertools.count)

    def fail_next(self, error: HapiError, *, after: int = 0, times: int = 1) -> None:
        """The next `times` streams fail with `error` after `after` parts.

        A fault is spent only when it fires: a stream recalled, cancelled or ended before
        its part `after` hands it to the next stream, so a test that recalls does not race
        the failure it asked for.
        """
        with self._lock:
            self._faults.extend(_Fault(error, after) for _ in range(times))

    def forget_sessions(self) -> None:
        """Lose every session, as a restarted server does."""
        with self._lock:
            self._sessions.clear()

    # Server -------------------------------------------------------------------------

    def open_session(self, request: SessionRequest) -> SessionInfo:
        if request.cut == RAW and self.store is None:
            raise ValueError("a MemorySource serves RAW sessions only with a store")
        time.sleep(self.open_delay_s)
        with self._lock:
            session = f"mem-{next(self._ids)}"
            self._sessions.add(session)
            self.opened.append(session)
            self.cuts[session] = request.cut
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
            self.requested.append(time.perf_counter())
            fault = self._faults.pop(0) if self._faults else None
            stream = _MemoryStream(self, ticket, self.cuts[ticket.session], fault)
            self._streams.append(stream)
            self.max_open = max(self.max_open, len(self._streams))
            raw = sum(s.cut == RAW for s in self._streams)
            self.max_open_raw = max(self.max_open_raw, raw)
        if fault is not None and fault.after == 0:
            stream.fire()
            stream.close()
            raise fault.error
        return stream

    def recall(self) -> bool:
        with self._lock:
            streams, self._streams = self._streams, []
        for stream in streams:
            stream.recalled = True
        return bool(streams)

    def manifest(self, prefix: str = "") -> DatasetManifest:
        """The dataset under `prefix` in its store, laid out as a server lists it.

        Raises:
            InvalidRequest: it was given no store.
        """
        if self.store is None:
            raise InvalidRequest(f"{self.address} has no store to list: give it one")
        return DatasetManifest.from_store(self.store, prefix)

    def profile(self, request: ProfileRequest) -> ProfileReply:
        """Refused, as by a server older than the `profile` action: a planner then scales
        the trainer's own heads."""
        raise InvalidRequest(f"{self.address} does not know the action 'profile'")

    def locate(self, keys: Sequence[str]) -> LocateReply:
        if self.local_keys is None:
            raise InvalidRequest(f"{self.address} does not know where objects lie")
        return LocateReply(local=[int(k in self.local_keys) for k in keys], total=[1] * len(keys))

    def put_head(self, artifact: HeadArtifact) -> None:
        with self._lock:
            self.heads.setdefault(artifact.digest, artifact)

    def stats(self) -> ServerStats:
        with self._lock:
            self.stats_calls += 1
            sessions = {s: SessionStats(cpu_s=cpu) for s, cpu in self._cpu_s.items()}
        return ServerStats(
            store="memory://",
            heads_cached=0,
            heads_bytes=0,
            bytes_sent=0,
            cpu_s=sum(s.cpu_s for s in sessions.values()),
            sessions=sessions,
        )

    def _served(self, session: str, keys: int) -> float:
        """Count `keys` served on `session`; the server time they report."""
        spent = keys * self.server_s_per_key
        with self._lock:
            self._cpu_s[session] = self._cpu_s.get(session, 0.0) + spent
        return spent if self.reports_time else 0.0

    def _part(self, keys: list[str], labels: list[int], epoch: int, cut: int) -> FeatureBatch:
        """The batch a server sends for `keys` on a session at `cut`."""
        targets = torch.tensor(labels, dtype=torch.int64)
        if self.store is None or (cut != RAW and self.compute is None):
            return FeatureBatch(keys, targets, features=torch.stack([feature_of(k) for k in keys]))
        blobs = self.store.get_many(keys)
        for blob in blobs:
            if isinstance(blob, HapiError):
                raise blob  # a store away fails the chunk, as a server's read does
        raw = FeatureBatch(keys, targets, data=blobs)  # type: ignore[arg-type]
        if cut == RAW:
            return raw
        assert self.compute is not None  # checked above
        features, _ = self.compute(raw, epoch, cut)
        return features

    def _closed(self, stream: _MemoryStream) -> None:
        with self._lock:
            if stream in self._streams:
                self._streams.remove(stream)
            if stream.fault is not None and not stream.fired:
                self._faults.insert(0, stream.fault)
                stream.fault = None


class _MemoryStream:
    """One chunk's parts, computed as they are read."""

    def __init__(
        self, source: MemorySource, ticket: ChunkTicket, cut: int, fault: _Fault | None
    ) -> None:
        self.source, self.ticket, self.cut, self.fault = source, ticket, cut, fault
        self.cancelled = threading.Event()
        self.recalled = False
        self.fired = False

    def __iter__(self) -> Iterator[ChunkPart]:
        source, ticket = self.source, self.ticket
        keys = [k for k in ticket.keys if k not in source.skip]
        label = dict(zip(ticket.keys, ticket.labels, strict=True))
        server_s = 0.0
        try:
            for index, start in enumerate(range(0, max(len(keys), 1), source.batch_size)):
                self._check(index)
                part = keys[start : start + source.batch_size]
                last = start + source.batch_size >= len(keys)
                server_s += source._served(ticket.session, len(part))
                report = (
                    ChunkReport(
                        chunk=ticket.chunk,
                        server_s=server_s,
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
                    batch = source._part(part, [label[k] for k in part], ticket.epoch, self.cut)
                yield ChunkPart(batch, _nbytes(batch), report)
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
            self.fire()
            raise self.fault.error

    def fire(self) -> None:
        """Its fault fails it now: spent, and counted."""
        self.fired = True
        with self.source._lock:
            self.source.faults_fired += 1

    def cancel(self) -> None:
        self.cancelled.set()

    def close(self) -> None:
        self.source._closed(self)


def _nbytes(batch: FeatureBatch | None) -> int:
    """A batch's bytes on the wire: its objects', or its features'."""
    if batch is None:
        return 0
    if batch.data is not None:
        return sum(len(b) for b in batch.data)
    assert batch.features is not None  # a batch holds one or the other
    return batch.features.nbytes
