"""The probe chunks a job's plan is measured with, as the trainer and the server saw them.

A probe is a few of the job's own objects streamed as chunks of a session (RAW, or at
the freeze cut), timed on both ends: the stream's time and the trainer's CPU time, and
the session's counters before and after (`stats`). `hapi.client.planning.measuring` makes the
profiles from them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

from hapi.client.servers.source import Server
from hapi.errors import HapiError, InvalidRequest
from hapi.plan import LinkProfile
from hapi.wire import ChunkTicket, SessionRequest, SessionStats
from hapi.wire.replies import SessionInfo

__all__ = [
    "Probe",
    "link_of",
    "open_probe_session",
    "probe",
    "probe_raw",
    "raw_s",
    "read_all",
    "send_s",
    "tickets",
]

RAW_FIRST = 4
"""Objects in the RAW probe's first chunk. The rest follow only where the link carries
them in `RAW_REST_S`: at 10 Mbit/s the 16 objects of 90 KB took 1.2 s of a job's start,
and four tell the link's rate, the trainer's receiving and decoding as well."""
RAW_REST_S = 0.25
"""The longest the RAW probe's other objects may hold the link, at the first chunk's pace."""


@dataclass(frozen=True)
class Probe:
    """One probe chunk as the trainer and the server's counters saw it."""

    seconds: float
    nbytes: int
    samples: int
    server: SessionStats
    """The session's counters for this chunk alone."""
    blobs: list[bytes]
    round_trip_s: float
    cpu_s: float
    """The trainer process's CPU time receiving it (every thread's: gRPC's own too)."""
    reported_s: float
    """The server's time on it as its chunks' reports said (what a chunk of the job's
    reports, and the re-planner weighs against the plan)."""
    server_cpu_s: float
    """The server process's CPU time while it ran (every thread's), 0 from a server that
    does not report it."""
    requests: int = 1
    """Requests it took, one after another: each paid a round trip."""

    def __add__(self, other: Probe) -> Probe:
        """Two probes of one session, one after the other, as one."""
        return Probe(
            self.seconds + other.seconds,
            self.nbytes + other.nbytes,
            self.samples + other.samples,
            SessionStats(**{
                name: getattr(self.server, name) + getattr(other.server, name)
                for name in SessionStats.model_fields
            }),
            self.blobs + other.blobs,
            min(self.round_trip_s, other.round_trip_s),
            self.cpu_s + other.cpu_s,
            self.reported_s + other.reported_s,
            self.server_cpu_s + other.server_cpu_s,
            self.requests + other.requests,
        )  # fmt: skip


def raw_s(read_s: float, raw: Probe) -> float | None:
    """What serving an object raw costs the server per sample, from the RAW probe's
    reports (its reading and encoding), or None where it reported nothing (an older
    server): `read_s` then stands.

    The probe is a job's first read of its objects: its own wait for the store is taken
    out and `read_s`, a warm read's, put in, as an epoch's reads are (the store's cache,
    the connection pool's)."""
    if not raw.samples or raw.reported_s <= 0:
        return None
    return max(read_s, (raw.reported_s - raw.server.read_s) / raw.samples + read_s)


def send_s(raw: Probe) -> float:
    """What each byte sent costs the server's cores beyond its chunks' own threads, from
    the RAW probe: the process's CPU time less theirs, per byte (0 from a server that
    reports no process CPU). Whatever else the server's process did meanwhile counts as
    sending too - another tenant's chunks, or, in a test, a trainer in the same process -
    so a busy server reads dearer, as a busy trainer's `receive_s` does."""
    if not raw.nbytes or raw.server_cpu_s <= 0:
        return 0.0
    return max(0.0, raw.server_cpu_s - raw.server.cpu_s) / raw.nbytes


def link_of(raw: Probe) -> LinkProfile:
    """The link from the RAW probe: its bytes over the stream's time, less the server's
    wait for its store and the request's round trip."""
    busy = raw.seconds - raw.server.read_s
    try:
        return LinkProfile.observed(
            raw.nbytes, busy, requests=raw.requests, latency_s=raw.round_trip_s
        )
    except InvalidRequest:
        # The store's wait hid the link (a fast link, a slow store): the link is at least
        # as fast as the whole stream.
        return LinkProfile(bytes_per_s=raw.nbytes / max(raw.seconds, 1e-6))


def probe_raw(connection: Server, session: str, keys: list[str], labels: list[int]) -> Probe:
    """The RAW probe: `RAW_FIRST` of `keys` as one chunk, and the rest as another where the
    first chunk's pace says the link carries them within `RAW_REST_S`."""
    first = probe(connection, session, keys[:RAW_FIRST], labels[:RAW_FIRST])
    rest = len(keys) - RAW_FIRST
    if rest <= 0 or first.seconds / max(first.samples, 1) * rest > RAW_REST_S:
        return first
    return first + probe(connection, session, keys[RAW_FIRST:], labels[RAW_FIRST:])


def probe(
    connection: Server,
    session: str,
    keys: list[str],
    labels: list[int],
    chunk_size: int | None = None,
) -> Probe:
    """Run `keys` in `session` (warmed by the profile, or a first pass) and measure them: as
    one chunk, or in chunks of `chunk_size` one after another, so the server's batches are
    the size the job's are (a head's time per sample depends on its batch)."""
    chunks = tickets(session, keys, labels, chunk_size)
    before, cpu1, rtt1 = counters(connection, session)
    t0, cpu0 = time.perf_counter(), time.process_time()
    nbytes, samples, blobs, reported_s = read_all(connection, chunks)
    seconds, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    after, cpu2, rtt2 = counters(connection, session)
    delta = SessionStats(
        **{name: getattr(after, name) - getattr(before, name) for name in SessionStats.model_fields}
    )
    return Probe(
        seconds, nbytes, samples, delta, blobs, min(rtt1, rtt2), cpu_s, reported_s, cpu2 - cpu1
    )


def tickets(
    session: str, keys: list[str], labels: list[int], chunk_size: int | None
) -> list[ChunkTicket]:
    size = chunk_size or len(keys)
    return [
        ChunkTicket(session=session, chunk=i, keys=keys[i : i + size], labels=labels[i : i + size])
        for i in range(0, len(keys), size)
    ]


def read_all(connection: Server, tickets: list[ChunkTicket]) -> tuple[int, int, list[bytes], float]:
    """The chunks' bytes, samples, raw objects and the server's reported time on them."""
    nbytes = samples = 0
    reported_s = 0.0
    blobs: list[bytes] = []
    for ticket in tickets:
        n, s, b, r = read(connection, ticket)
        nbytes, samples, blobs, reported_s = nbytes + n, samples + s, blobs + b, reported_s + r
    return nbytes, samples, blobs, reported_s


def read(connection: Server, ticket: ChunkTicket) -> tuple[int, int, list[bytes], float]:
    """The chunk's bytes, samples, raw objects and the server's reported time on it."""
    nbytes = samples = 0
    reported_s = 0.0
    blobs: list[bytes] = []
    for part in connection.stream(ticket):
        nbytes += part.nbytes
        if part.batch is not None:
            samples += len(part.batch)
            blobs += part.batch.data or []
        if part.report is not None:
            reported_s += part.report.server_s
    return nbytes, samples, blobs, reported_s


def counters(connection: Server, session: str) -> tuple[SessionStats, float, float]:
    """The session's counters, the server process's CPU time, and the action's round trip
    (the request latency)."""
    t0 = time.perf_counter()
    stats = connection.stats()
    return stats.sessions.get(session, SessionStats()), stats.cpu_s, time.perf_counter() - t0


@contextlib.contextmanager
def open_probe_session(connection: Server, request: SessionRequest) -> Iterator[SessionInfo]:
    """A session for the probes, closed after them if its server still answers.

    The close is best effort: a server that died has no session left to close, and a
    failure of the probes themselves is the error to report (and retry), not the
    close's. A session nobody closes is freed by its lease (`session_idle_s`)."""
    info = connection.open_session(request)
    session = info.session
    try:
        yield info
    finally:
        with contextlib.suppress(HapiError):
            connection.close_session(session)
