"""`Connection`: the trainer's handle on one hapi server."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import pyarrow as pa
import pyarrow.flight as flight

from hapi.client.servers._chunk_part import ChunkPart, ChunkResult
from hapi.client.servers._chunk_stream import ChunkStream, Lane, recalled_error, stream_error
from hapi.client.servers._tls import flight_tls_options, tls_address
from hapi.client.servers._window import Window, check_window, grpc_options, held_window
from hapi.data import DatasetManifest
from hapi.errors import InvalidRequest
from hapi.graph.export import HeadArtifact
from hapi.wire import (
    ActionType,
    ChunkReport,
    ChunkTicket,
    CloseSessionRequest,
    FeatureBatch,
    LocateReply,
    LocateRequest,
    ManifestRequest,
    ProfileReply,
    ProfileRequest,
    ServerStats,
    SessionInfo,
    SessionRequest,
    SessionStats,
    SkippedKey,
    decode_batch,
    decode_error,
)
from hapi.wire.heads import head_batches, head_descriptor, head_schema
from hapi.wire.messages import HasHeadRequest, KeepaliveRequest
from hapi.wire.replies import HasHeadReply
from hapi.wire.tables import table_from_ipc

__all__ = ["ChunkPart", "ChunkResult", "ChunkStream", "Connection", "connect"]


@dataclass(eq=False)
class Connection:
    """A connection to a hapi server. Create it with `connect`.

    The Flight client is made lazily, once per process, so a `Connection` can be pickled
    into DataLoader workers (each process reads the TLS files); it is thread-safe, so K
    chunks can be in flight at once.
    """

    address: str
    token: str | None = field(default=None, repr=False)
    timeout: float | None = None
    tls_ca: str | None = None
    """PEM file of the CA that signed the server's certificate; None: the system's CAs."""
    tls_cert: str | None = None
    """PEM file of a client certificate, for a server that asks for one (mutual TLS)."""
    tls_key: str | None = field(default=None, repr=False)
    """PEM file of `tls_cert`'s private key."""
    receive_window: Window = "grpc"
    """Each stream's HTTP/2 receive window: "grpc" leaves it to gRPC's probe, "auto" sizes
    it from the round trip, an int holds it at that many bytes (`connect`)."""
    _client: Any = field(default=None, init=False, repr=False)
    _lane: Lane | None = field(default=None, init=False, repr=False)
    _window: int | Literal["unset"] | None = field(default="unset", init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __getstate__(self) -> dict[str, Any]:
        names = ("address", "token", "timeout", "tls_ca", "tls_cert", "tls_key", "receive_window")
        return {name: getattr(self, name) for name in names}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    @property
    def client(self) -> flight.FlightClient:
        """The Flight client for actions (chunk streams have a connection of their own)."""
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._client = self._connect([])
        return self._client

    def _connect(self, options: list[tuple[str, int]]) -> flight.FlightClient:
        tls = flight_tls_options(self.tls_ca, self.tls_cert, self.tls_key)
        if self._window == "unset":
            self._window = held_window(self.address, self.receive_window)
        return flight.connect(
            self.address, **tls, generic_options=grpc_options(self._window) + options
        )

    def _streams(self) -> Lane:
        """The connection chunk streams open on now (a new one after `recall`)."""
        with self._lock:
            if self._lane is None:
                self._lane = Lane(self._connect([("grpc.use_local_subchannel_pool", 1)]))
            return self._lane

    def recall(self) -> bool:
        """Cut every chunk stream open now, with what the server has sent ahead on them.

        A stream's cancel stops the server writing it, but what the server has written
        still crosses: up to the flow-control windows, megabytes after a fast link, in
        the server's socket buffer. After a drop from 1 Gbit/s to 10 Mbit/s a re-plan's
        first chunk waited 1 s behind the cancelled streams' bytes (`hapi.client.servers._window`).
        Closing the streams' connection drops them with it; the next stream opens a new
        one. Their readers fail with `StreamRecalled`.

        Returns: whether any stream was open to cut (with none, the connection stays).
        """
        with self._lock:
            lane = self._lane
            if lane is None or not lane.busy:
                return False
            self._lane = None
        lane.recall()
        return True

    def _options(self) -> flight.FlightCallOptions:
        headers = [(b"authorization", f"Bearer {self.token}".encode())] if self.token else []
        return flight.FlightCallOptions(headers=headers, timeout=self.timeout)

    def action(self, name: str, body: bytes = b"") -> bytes:
        """Run a Flight action (an `ActionType`) and return its reply's bytes."""
        try:
            results = list(self.client.do_action(flight.Action(name, body), self._options()))
        except flight.FlightError as exc:
            raise decode_error(exc, self.address) from None
        return results[0].body.to_pybytes() if results else b""

    def open_session(self, request: SessionRequest) -> SessionInfo:
        """Open a session on the server; its head is loaded (or reused) there.

        A server older than wire compression refuses a request that asks for it: the
        session is then opened uncompressed (`SessionInfo.compression` says which).
        """
        try:
            reply = self.action(ActionType.OPEN_SESSION, request.to_bytes())
        except InvalidRequest:
            if request.compression == "none":
                raise
            # Any other refusal comes back the same from the plain request.
            plain = request.model_copy(update={"compression": "none"})
            reply = self.action(ActionType.OPEN_SESSION, plain.to_bytes())
        return SessionInfo.model_validate_json(reply)

    def close_session(self, session: str) -> SessionStats:
        """Close a session; returns the server's stats for it."""
        body = CloseSessionRequest(session=session).to_bytes()
        return SessionStats.model_validate_json(self.action(ActionType.CLOSE_SESSION, body))

    def keepalive(self, session: str) -> None:
        """Renew a session's lease, so the server does not close it as abandoned.

        Raises:
            SessionNotFound: the server does not hold it (closed, or the server restarted).
        """
        self.action(ActionType.KEEPALIVE, KeepaliveRequest(session=session).to_bytes())

    def manifest(self, prefix: str = "") -> DatasetManifest:
        """The dataset under `prefix` in the server's store (as Arrow; as JSON from a
        server older than `ManifestRequest.format`)."""
        try:
            body = ManifestRequest(prefix=prefix, format="arrow").to_bytes()
            return DatasetManifest.from_arrow(
                table_from_ipc(self.action(ActionType.MANIFEST, body))
            )
        except InvalidRequest as exc:
            if "format" not in str(exc):
                raise
        body = ManifestRequest(prefix=prefix).to_bytes()
        return DatasetManifest.from_dict(json.loads(self.action(ActionType.MANIFEST, body)))

    def stats(self) -> ServerStats:
        """The server's settings and counters."""
        return ServerStats.model_validate_json(self.action(ActionType.STATS))

    def profile(self, request: ProfileRequest) -> ProfileReply:
        """The server's own timing of a session's cuts on some of its keys.

        Raises:
            InvalidRequest: a server without the `profile` action (an older one).
            OverBudget: the keys do not fit the server's memory.
        """
        reply = self.action(ActionType.PROFILE, request.to_bytes())
        return ProfileReply.model_validate_json(reply)

    def locate(self, keys: Sequence[str]) -> LocateReply:
        """Each key's bytes on the server's own storage node, and in all (`Server.locate`)."""
        body = LocateRequest(keys=list(keys)).to_bytes()
        return LocateReply.model_validate_json(self.action(ActionType.LOCATE, body))

    def has_head(self, digest: str) -> HasHeadReply:
        """Whether the server holds the uploaded head with `digest`, and its size limit."""
        body = HasHeadRequest(digest=digest).to_bytes()
        return HasHeadReply.model_validate_json(self.action(ActionType.HAS_HEAD, body))

    def put_head(self, artifact: HeadArtifact) -> None:
        """Upload a head (`hapi.graph.export_head`) unless the server has it already.

        Raises:
            IntegrityError: the server received other bytes than the digest names.
            InvalidRequest: the artifact is larger than the server accepts.
        """
        status = self.has_head(artifact.digest)
        if status.present:
            return
        size = len(artifact.program) + len(artifact.weights)
        if status.max_bytes and size > status.max_bytes:
            raise InvalidRequest(
                f"this head is {size} bytes, more than the {status.max_bytes} bytes server "
                f"{self.address} accepts for an uploaded head: cut earlier (a smaller head), "
                "or ask its operator to raise the limit"
            )
        try:
            writer, _ = self.client.do_put(
                head_descriptor(artifact.digest),
                head_schema(artifact.input_shape),
                self._options(),
            )
            with writer:
                for batch in head_batches(artifact):
                    writer.write_batch(batch)
        except flight.FlightError as exc:
            raise decode_error(exc, self.address) from None

    def fetch(self, ticket: ChunkTicket) -> ChunkResult:
        """Run one chunk and read it whole.

        A chunk is all or nothing: its batches are returned only when the stream ended
        cleanly, so a failed chunk can be retried without delivering any key twice.
        """
        batches: list[FeatureBatch] = []
        skipped: list[SkippedKey] = []
        nbytes = 0
        try:
            reader = self.client.do_get(flight.Ticket(ticket.to_bytes()), self._options())
            while True:
                try:
                    chunk = reader.read_chunk()
                except StopIteration:
                    break
                if chunk.data is not None and chunk.data.num_rows:
                    nbytes += chunk.data.nbytes
                    batches.append(decode_batch(chunk.data))
                if chunk.app_metadata is not None:
                    report = ChunkReport.model_validate_json(chunk.app_metadata.to_pybytes())
                    skipped += report.skipped
                    nbytes = nbytes if report.sent_bytes is None else report.sent_bytes
        except flight.FlightError as exc:
            raise decode_error(exc, self.address) from None
        return ChunkResult(batches, skipped, nbytes)

    def stream(self, ticket: ChunkTicket) -> ChunkStream:
        """Start one chunk; read its batches from the returned stream as they arrive.

        The request goes out now, so the server starts on the chunk while the caller
        reads other streams. Unlike `fetch`, batches come before the chunk is complete: a
        caller that retries a failed stream asks again only for the keys it has not
        received (chunks are idempotent per key).

        Raises:
            HapiError: the server's error for the chunk; `ServerUnavailable` when the server
                cannot be reached; `StreamRecalled` when `recall` cut it as it opened.
        """
        lane = self._streams()
        lane.opening()
        stream = None
        try:
            reader = lane.client.do_get(flight.Ticket(ticket.to_bytes()), self._options())
            stream = ChunkStream(reader, ticket, self.address, lane)
        except (flight.FlightError, pa.ArrowInvalid) as exc:  # ArrowInvalid: closed
            if lane.recalled:
                raise recalled_error(ticket, self.address) from None
            if not isinstance(exc, flight.FlightError):
                raise
            raise stream_error(exc, ticket, self.address) from None
        finally:
            lane.opened(stream)
        assert stream is not None  # or the call raised
        if stream.recalled:
            raise recalled_error(ticket, self.address)
        return stream

    def close(self) -> None:
        """Close the Flight clients (a later call opens new ones)."""
        with self._lock:
            lane, self._lane = self._lane, None
            if lane is not None:
                lane.recall()
            if self._client is not None:
                self._client.close()
                self._client = None

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(
    address: str,
    *,
    token: str | None = None,
    timeout: float | None = None,
    tls_ca: str | os.PathLike[str] | None = None,
    tls_cert: str | os.PathLike[str] | None = None,
    tls_key: str | os.PathLike[str] | None = None,
    receive_window: Window = "grpc",
) -> Connection:
    """Connect to a hapi server (nothing is opened until the first call).

    Args:
        address: `grpc://host:port`, or `grpc+tls://host:port` for a server with a
            certificate (`host` must be a name the certificate holds); a bare `host:port`
            is grpc, or grpc+tls when a TLS option is given.
        token: the server's bearer token (your tenant's), if it has one.
        timeout: seconds before a call fails with `ServerUnavailable`; None waits.
        tls_ca: PEM file of the CA that signed the server's certificate; None trusts the
            system's CAs.
        tls_cert: PEM file of a client certificate, for a server that asks for one.
        tls_key: PEM file of `tls_cert`'s private key.
        receive_window: how far ahead of the trainer's reading the server may send on
            each stream. "grpc": gRPC's own bandwidth-delay probe, which lets streams
            waiting for their turn fill ahead; "auto": the link's bandwidth-delay product
            at 4 Gbit/s from the round trip measured on connecting, at least 64 KiB, which
            costs a hybrid whose link is nearly full 11-16% (`_window`); an int: that many
            bytes. Under either, a re-plan that moves the chunks in flight recalls what
            the server sent ahead on them (`recall`): a drop from 1 Gbit/s to 10 Mbit/s
            costs 0.94x a plan made for 10 Mbit/s with the probe, 0.85x held.

    Raises:
        InvalidRequest: TLS options with a `grpc://` address, `tls_cert` without
            `tls_key` (or the reverse), or a `receive_window` that is none of those.
    """
    ca, cert, key = (None if p is None else os.fspath(p) for p in (tls_ca, tls_cert, tls_key))
    address = tls_address(address, ca=ca, cert=cert, key=key)
    check_window(receive_window)
    return Connection(
        address,
        token,
        timeout,
        tls_ca=ca,
        tls_cert=cert,
        tls_key=key,
        receive_window=receive_window,
    )
