"""`ChunkStreams`: a chunk's Flight stream from its request to its last batch."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator

import pyarrow as pa
import pyarrow.flight as flight

from hapi.data import ObjectStore
from hapi.graph import RAW
from hapi.server.chunks._order import SendOrder
from hapi.server.chunks.session import Session
from hapi.server.metrics import Metrics
from hapi.server.security.tenants import Tenant
from hapi.server.shaping import TokenBucket
from hapi.wire import ChunkTicket
from hapi.wire.packed import Packer
from hapi.wire.replies import ChunkReport

__all__ = ["ChunkStreams"]

log = logging.getLogger("hapi.server")

Guard = Callable[[str, Tenant], contextlib.AbstractContextManager[Tenant]]
"""The server's guard of a call (`tenant_call`): its errors sent back, its metrics kept."""


class ChunkStreams:
    """Sends chunks: each stream in its connection's order, shaped to the egress limit,
    counted in its session and the metrics, and stopped within a batch once its client
    leaves.

    Args:
        store: what the chunks read.
        sending: each client connection's order of streams.
        shaper: the egress limit, if any.
        metrics: the server's metrics.
        clock: monotonic seconds (a session's last use).
        guard: the server's guard of a call.
    """

    def __init__(
        self,
        *,
        store: ObjectStore,
        sending: SendOrder,
        shaper: TokenBucket | None,
        metrics: Metrics,
        clock: Callable[[], float],
        guard: Guard,
    ) -> None:
        self._store, self._sending, self._shaper = store, sending, shaper
        self._metrics, self._clock, self._guard = metrics, clock, guard

    def stream(
        self,
        session: Session,
        chunk: ChunkTicket,
        tenant: Tenant,
        started: float,
        context: flight.ServerCallContext,
    ) -> Iterator[tuple[pa.RecordBatch, pa.Buffer | None] | None]:
        """A chunk's stream; its first item, None, is taken by `HapiServer.do_get`:
        started so, the chunk runs from the request on, not from the stream's first read,
        and is closed (its thread stopped, its place given up) however its stream ends.

        A client that cancels or disconnects stops the chunk within a batch: this thread
        (the call's own, the only one that may ask its context) watches for it wherever it
        waits - for its turn, for the chunk's next batch, for the link - and closes the
        outbox, which the chunk's thread checks before each batch and while queued."""
        # Its errors need their own guard: the stream runs after do_get returned. One lane
        # per connection: its streams share one TCP stream, first in, first out.
        lane = (tenant.name, context.peer())
        gone = context.is_cancelled
        with (
            self._guard(f"chunk {chunk.chunk} of session {session.id}", tenant),
            self._sending.stream(lane, chunk.epoch, chunk.chunk, gone=gone) as send,
        ):
            out = session.run_chunk(chunk, self._store)
            ended = False
            try:
                yield None
                samples = sent = 0
                pack = Packer(session.info.compression)
                for encoded, report in out.items(gone=gone):
                    batch = pack(encoded)  # once, before its turn: counted and shaped as sent
                    self._await_turn(session, batch, send, gone)
                    if gone():
                        break  # left while this stream waited for its turn or the link
                    self._count_sent(session, encoded.num_rows, batch.nbytes)
                    samples, sent = samples + encoded.num_rows, sent + batch.nbytes
                    if report is not None:  # the chunk's last batch: its bytes are all counted
                        report = ChunkReport.with_sent_bytes(report, sent, packing_s=pack.seconds)
                    yield batch, (pa.py_buffer(report) if report is not None else None)
                    ended = report is not None
                if ended:
                    self._metrics.chunk_done(
                        tenant.name,
                        session.id,
                        samples=samples,
                        nbytes=sent,
                        seconds=time.perf_counter() - started,
                    )
            except Exception:
                ended = True  # failed, not abandoned: the guard sends the error
                raise
            finally:
                out.close()
                if not ended:
                    # The client left before the chunk's end (a cancel, a disconnect, or
                    # a write to a call already gone, which ends the generator here).
                    self._count_abandoned(session, chunk, tenant)

    def _await_turn(
        self,
        session: Session,
        batch: pa.RecordBatch,
        send: Callable[[], None],
        gone: Callable[[], bool],
    ) -> None:
        """Wait for the batch's turn on the connection, then for the link's egress limit."""
        send()  # the first waits for the streams before it on the connection
        if self._shaper is not None:
            waited = self._shaper.consume(batch.nbytes, gone=gone)
            session.stats.add(shaping_wait_s=waited)

    def _count_sent(self, session: Session, rows: int, nbytes: int) -> None:
        """Count a batch that is about to be sent in the session's stats and the metrics."""
        session.stats.add(bytes_sent=nbytes)
        # A chunk streaming longer than the idle time is use, not abandonment.
        session.last_used = self._clock()
        if session.request.cut != RAW and rows:
            # A feature session sends each batch its head ran as one wire batch.
            self._metrics.observe_batch(rows)

    def _count_abandoned(self, session: Session, chunk: ChunkTicket, tenant: Tenant) -> None:
        """Count a chunk whose client left before its end."""
        session.stats.add(abandoned=1)
        self._metrics.chunk_abandoned(tenant.name)
        log.info("chunk %d of session %s: the client left", chunk.chunk, session.id)
