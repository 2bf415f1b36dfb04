"""A chunk's stream as it arrives (`ChunkStream`), and the connection that carries a
`Connection`'s streams until a change of plan recalls them (`Lane`)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pyarrow.flight as flight

from hapi.client.servers._chunk_part import ChunkPart
from hapi.errors import HapiError, ServerUnavailable, StreamRecalled, shorten
from hapi.wire import ChunkReport, ChunkTicket, decode_batch, decode_error

__all__ = ["ChunkStream", "Lane", "recalled_error", "stream_error"]


class ChunkStream:
    """An open chunk stream: iterate its parts as they arrive; `cancel` from any thread."""

    def __init__(
        self,
        reader: flight.FlightStreamReader,
        ticket: ChunkTicket,
        address: str,
        lane: Lane | None = None,
    ):
        self._reader: flight.FlightStreamReader | None = reader
        self._ticket, self._address, self._lane = ticket, address, lane

    def __iter__(self) -> Iterator[ChunkPart]:
        """The chunk's parts, the `ChunkReport` with the last; they end with it.

        Raises:
            HapiError: the server's error; `ServerUnavailable` when the stream was cut,
                `StreamRecalled` when `Connection.recall` cut it.
        """
        counted = 0
        while True:
            reader = self._reader
            if reader is None:
                raise recalled_error(self._ticket, self._address)
            try:
                chunk = reader.read_chunk()
            except StopIteration:
                self._ended()
                if self.recalled:  # a closed connection can end a read without an error
                    raise recalled_error(self._ticket, self._address) from None
                return
            except flight.FlightError as exc:
                self._ended()
                if self.recalled:
                    raise recalled_error(self._ticket, self._address) from None
                raise stream_error(exc, self._ticket, self._address) from None
            batch = None
            if chunk.data is not None and chunk.data.num_rows:
                batch = decode_batch(chunk.data)
            report = None
            if chunk.app_metadata is not None:
                report = ChunkReport.model_validate_json(chunk.app_metadata.to_pybytes())
                self._ended()
            nbytes = chunk.data.nbytes if chunk.data is not None else 0
            if report is not None and report.sent_bytes is not None:
                nbytes = report.sent_bytes - counted  # the link's rate is of what crossed it
            counted += nbytes
            yield ChunkPart(batch, nbytes, report)
            if report is not None:
                # The report is the stream's last message, and the chunk is read: the
                # stream's end (its trailers) can queue behind the next stream's bytes on
                # the connection, a whole raw chunk's at 10 Mbit/s (1.1 s), and the next
                # chunk's turn would wait for it.
                return

    def _ended(self) -> None:
        """Its last message came (or its read failed): a recall has nothing to cut."""
        if self._lane is not None:
            self._lane.discard(self)

    @property
    def recalled(self) -> bool:
        """Whether `Connection.recall` cut it."""
        return self._lane is not None and self._lane.recalled

    def cancel(self) -> None:
        """Stop the stream; a read in progress fails."""
        reader = self._reader
        if reader is not None:
            reader.cancel()

    def _recall(self) -> None:
        """Cancel it and let go of its call: the connection closes only once no call
        holds it, and a stream waiting for its turn would hold it until then."""
        self.cancel()
        self._reader = None


class Lane:
    """The connection that carries a `Connection`'s chunk streams, until it is recalled.

    Its own TCP connection (a local subchannel pool: gRPC would otherwise share one with
    the actions' client), so that closing it drops what the server has written to it.
    """

    def __init__(self, client: flight.FlightClient) -> None:
        self.client = client
        self.recalled = False
        self._open: set[ChunkStream] = set()
        self._opening = 0
        self._closed = False
        self._lock = threading.Lock()

    def opening(self) -> None:
        """A stream is about to be opened on it: it is not closed under the call."""
        with self._lock:
            self._opening += 1

    def opened(self, stream: ChunkStream | None) -> None:
        """The stream `opening` announced is open (None: its opening failed). Recalled
        meanwhile, the lane cancels it (the caller raises `StreamRecalled`) and closes
        once no other stream is being opened."""
        with self._lock:
            self._opening -= 1
            if stream is not None and not self.recalled:
                self._open.add(stream)
                return
            close = self._closing()
        if stream is not None:
            stream._recall()
        if close:
            self.client.close()

    def _closing(self) -> bool:
        """Whether the caller closes it now: recalled, no stream being opened on it, and
        not closed already (under its lock)."""
        close = self.recalled and not self._opening and not self._closed
        self._closed |= close
        return close

    def discard(self, stream: ChunkStream) -> None:
        with self._lock:
            self._open.discard(stream)

    @property
    def busy(self) -> bool:
        """Whether a stream is open on it, or being opened."""
        with self._lock:
            return bool(self._open) or self._opening > 0

    def recall(self) -> None:
        """Cancel its streams and close it (once no stream is being opened on it)."""
        with self._lock:
            self.recalled = True
            streams, self._open = list(self._open), set()
            close = self._closing()
        # Cancelled before the close, their reads fail rather than end as if complete.
        for stream in streams:
            stream._recall()
        if close:
            self.client.close()


def recalled_error(ticket: ChunkTicket, address: str) -> StreamRecalled:
    """The error of a stream `Connection.recall` cut."""
    return StreamRecalled(
        f"the stream of chunk {ticket.chunk} from {address} was recalled: the plan moved it"
    )


def stream_error(exc: Exception, ticket: ChunkTicket, address: str) -> Exception:
    """The error a chunk's failed stream raises: the server's, or the cut's."""
    error = decode_error(exc, address)
    if isinstance(error, HapiError):
        return error
    # A reset or broken stream without a hapi error in it: the server went away.
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ServerUnavailable(
        f"the stream of chunk {ticket.chunk} from {address} was cut ({shorten(first)})"
    )
