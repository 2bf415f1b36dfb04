"""`HapiServer`: the storage-side Arrow Flight server, and `serve()` to run one."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.flight as flight
import torch

from hapi.data import DatasetManifest, ObjectStore, StoreOptions, Transforms, open_store
from hapi.errors import InvalidRequest, SessionNotFound, shorten
from hapi.graph import INPUT, RAW
from hapi.server._guard import UnusedCallsRefusal, errors_to_wire
from hapi.server.auth import TokenMiddlewareFactory
from hapi.server.config import ServerConfig
from hapi.server.head_cache import HeadCache, HeadLease
from hapi.server.session import Session
from hapi.server.shaping import TokenBucket, parse_rate
from hapi.wire import (
    ActionType,
    ChunkTicket,
    CloseSessionRequest,
    ManifestRequest,
    ServerStats,
    SessionInfo,
    SessionRequest,
    SessionStats,
    dtype_width,
    feature_schema,
    parse,
    raw_schema,
)

if TYPE_CHECKING:
    from hapi.repo import ModelRepo

__all__ = ["HapiServer", "serve"]

log = logging.getLogger("hapi.server")


class HapiServer(flight.FlightServerBase):
    """Serves chunks of features computed next to the data.

    Every handler sends a `HapiError` back as the error's class and message, and anything
    else as an `InternalError` whose id is logged with the traceback, so one bad request
    fails only itself: other sessions and chunks go on.

    Args:
        config: the server's settings.
        store: the store to serve instead of opening `config.store` (an embedding
            program's own, or a test's fake).
        clock: monotonic seconds, for session idle times (tests pass a fake clock).
    """

    def __init__(
        self,
        config: ServerConfig,
        *,
        store: ObjectStore | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        middleware: dict[str, flight.ServerMiddlewareFactory] = {}
        if config.token:
            middleware["auth"] = TokenMiddlewareFactory(config.token)
        middleware["unused"] = UnusedCallsRefusal()
        location = f"grpc://{config.host}:{config.port}"
        try:
            super().__init__(location, middleware=middleware)
        except (pa.ArrowException, OSError) as exc:
            raise InvalidRequest(
                f"cannot listen on {location} ({str(exc).splitlines()[0]}): the port may be "
                "in use; pick another with --port, or 0 for any free port"
            ) from None
        self.config = config
        self.store: ObjectStore = (
            store
            if store is not None
            # The server only reads: a mistyped directory is an error, not a new store.
            else open_store(config.store, config.store_options, create=False)
        )
        self.repo = _open_repo(config)
        self.heads = HeadCache(config.device, repo=self.repo, idle=config.idle_heads)
        self.shaper = TokenBucket(parse_rate(config.egress_limit)) if config.egress_limit else None
        self._clock = clock
        self._read_ahead = (config.store_options or StoreOptions()).concurrency
        self._sessions: dict[str, Session] = {}
        self._leases: dict[str, HeadLease] = {}
        self._closed: dict[str, SessionStats] = {}
        self._lock = threading.Lock()
        if config.threads:
            torch.set_num_threads(config.threads)

    @property
    def address(self) -> str:
        """The `grpc://host:port` clients connect to."""
        return f"grpc://{self.config.host}:{self.port}"

    # Flight handlers -------------------------------------------------------------------

    def list_actions(self, context: flight.ServerCallContext) -> list[tuple[str, str]]:
        with errors_to_wire("list_actions"):
            return [(action.value, action.description) for action in ActionType]

    def do_action(
        self, context: flight.ServerCallContext, action: flight.Action
    ) -> Iterator[bytes]:
        with errors_to_wire(f"action {shorten(repr(action.type), 100)}"):
            body = action.body.to_pybytes() if action.body is not None else b""
            result = self._action(action.type, body)
        return iter([result])

    def _action(self, name: str, body: bytes) -> bytes:
        if name == ActionType.OPEN_SESSION:
            return self.open_session(parse(SessionRequest, body)).to_bytes()
        if name == ActionType.CLOSE_SESSION:
            return self.close_session(parse(CloseSessionRequest, body).session).to_bytes()
        if name == ActionType.MANIFEST:
            prefix = parse(ManifestRequest, body).prefix
            return json.dumps(self.manifest(prefix)).encode()
        if name == ActionType.STATS:
            return self.stats().to_bytes()
        raise InvalidRequest(
            f"unknown action {shorten(repr(name), 100)}: known actions are "
            f"{[a.value for a in ActionType]}"
        )

    def do_get(
        self, context: flight.ServerCallContext, ticket: flight.Ticket
    ) -> flight.FlightDataStream:
        with errors_to_wire("do_get"):
            chunk = parse(ChunkTicket, ticket.ticket)
            session = self._session(chunk.session)
        return flight.GeneratorStream(session.schema, self._stream(session, chunk))

    def _stream(
        self, session: Session, chunk: ChunkTicket
    ) -> Iterator[tuple[pa.RecordBatch, pa.Buffer | None]]:
        # The stream runs after do_get returned: its errors need their own guard.
        with errors_to_wire(f"chunk {chunk.chunk} of session {session.id}"):
            for batch, report in session.run_chunk(chunk, self.store):
                nbytes = batch.nbytes
                if self.shaper is not None:
                    session.stats.add(shaping_wait_s=self.shaper.consume(nbytes))
                session.stats.add(bytes_sent=nbytes)
                yield batch, (pa.py_buffer(report) if report is not None else None)

    # The library API behind the handlers -------------------------------------------------

    def open_session(self, request: SessionRequest) -> SessionInfo:
        """Load (or reuse) the head a request needs and register a session for it."""
        self._close_abandoned()
        transforms = Transforms.from_dict(request.transforms)
        loaded = self.heads.model(request.model, request.image_size)
        graph = loaded.graph
        freeze = graph.resolve_freeze(request.freeze) if request.freeze is not None else None
        if freeze is None:
            freeze = graph.num_cuts
        if request.cut != RAW:
            graph.check_cut(request.cut, freeze)
        if request.cut == RAW:
            schema, shape, per_sample, head, lease = raw_schema(), [], 0, None, None
        else:
            if request.cut == INPUT:
                shape = list(graph.input_shape)
            else:
                shape = list(graph.cut_points[request.cut - 1].shape)
            lease = self.heads.acquire(loaded, request.cut) if request.cut > INPUT else None
            head = lease.module if lease is not None else None
            schema = feature_schema(shape, request.wire_dtype)
            per_sample = dtype_width(request.wire_dtype) * _numel(shape)
        info = SessionInfo(
            session=uuid.uuid4().hex,
            cut=request.cut,
            freeze=freeze,
            num_cuts=graph.num_cuts,
            feature_shape=shape,
            wire_dtype=request.wire_dtype,
            bytes_per_sample=per_sample,
        )
        session = Session(
            id=info.session,
            request=request,
            info=info,
            schema=schema,
            head=head,
            transforms=transforms,
            device=self.heads.device,
            batch_size=self.config.batch_size,
            last_used=self._clock(),
            read_ahead=self._read_ahead,
        )
        with self._lock:
            self._sessions[session.id] = session
            if lease is not None:
                self._leases[session.id] = lease
        log.info("opened session %s: cut %d of %d", session.id, request.cut, graph.num_cuts)
        return info

    def close_session(self, session_id: str) -> SessionStats:
        """Forget a session; return its final stats."""
        with self._lock:
            session = self._sessions.pop(session_id, None)
            if session is None:
                raise SessionNotFound(_unknown_session(session_id))
            lease = self._leases.pop(session_id, None)
            if lease is not None:
                self.heads.release(lease)
            stats = session.stats.snapshot()
            self._closed[session_id] = stats
            return stats

    def manifest(self, prefix: str) -> dict[str, Any]:
        """The dataset under `prefix` in this server's store."""
        return DatasetManifest.from_store(self.store, prefix).to_dict()

    def stats(self) -> ServerStats:
        """Counters of open and closed sessions, and the server's settings."""
        with self._lock:
            sessions = {sid: s.stats.snapshot() for sid, s in self._sessions.items()}
            closed = dict(self._closed)
        return ServerStats(
            store=self.store.uri,
            egress_limit_bytes_per_s=self.shaper.rate if self.shaper else None,
            heads_cached=len(self.heads),
            heads_bytes=self.heads.nbytes,
            bytes_sent=sum(s.bytes_sent for s in [*sessions.values(), *closed.values()]),
            sessions=sessions,
            closed_sessions=closed,
        )

    def _session(self, session_id: str) -> Session:
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise SessionNotFound(_unknown_session(session_id))
        session.last_used = self._clock()
        return session

    def _close_abandoned(self) -> None:
        """Close sessions unused for `session_idle_s`: their jobs died without closing
        them, and they hold heads in memory."""
        cutoff = self._clock() - self.config.session_idle_s
        with self._lock:
            abandoned = [sid for sid, s in self._sessions.items() if s.last_used < cutoff]
        for sid in abandoned:
            log.info("closing session %s: unused for %.0fs", sid, self.config.session_idle_s)
            with contextlib.suppress(SessionNotFound):
                self.close_session(sid)


@contextlib.contextmanager
def serve(
    config: ServerConfig | None = None,
    *,
    clock: Callable[[], float] = time.monotonic,
    **options: Any,
) -> Iterator[HapiServer]:
    """Run a server in a background thread for the duration of a `with` block.

    Args:
        config: the server's settings; or give them as keyword arguments (`store=...`).
        clock: monotonic seconds, for session idle times (tests pass a fake clock).
    """
    server = HapiServer(config or ServerConfig(**options), clock=clock)
    thread = threading.Thread(target=server.serve, name="hapi-serve", daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        thread.join(timeout=10)


def _open_repo(config: ServerConfig) -> ModelRepo | None:
    if config.repo is None:
        return None
    from hapi.repo import ModelRepo

    return ModelRepo.open(config.repo, config.store_options)


def _unknown_session(session_id: str) -> str:
    return (
        f"no session {shorten(repr(session_id), 100)} on this server (closed, unused for "
        "too long, or the server restarted): open a new session"
    )


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
