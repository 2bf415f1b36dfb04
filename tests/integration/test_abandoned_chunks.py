"""A chunk whose client cancels or disconnects stops within a batch: no work for nobody.

The server counts what it computed (`SessionStats.samples`) and the streams whose client
left (`SessionStats.abandoned`); the tests compare them with what the client read.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from hapi.client import connect
from hapi.data import Transforms, open_store, synth_dataset
from hapi.graph import ModelSpec
from hapi.server import HapiServer, ServerConfig, serve
from hapi.server.chunks.session import AHEAD_BATCHES
from hapi.server.memory.budget import MemoryModel
from hapi.server.memory.scheduler import Demand
from hapi.wire import ChunkTicket, SessionRequest, SessionStats

SIZE = 64
BATCH = 4
KEYS = 48
# resnet18 to layer1 at 64 px: 64 KiB of fp32 features a sample, 256 KiB a batch, so at
# this rate each batch takes the link more than a second: the client's cancel, sent as
# soon as it has read its first batch, reaches the server while the link paces the next.
RATE = "200KiB"


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("store")
    synth_dataset(open_store(root), "train", classes=3, per_class=KEYS // 3, size=80, seed=1)
    return root


def _request() -> SessionRequest:
    return SessionRequest(
        model=ModelSpec(name="resnet18", num_classes=3).to_dict(),
        cut=5,
        freeze=8,
        transforms=Transforms.eval(SIZE).to_dict(),
        image_size=SIZE,
    )


def _ticket(session: str, keys: list[str], chunk: int = 0) -> ChunkTicket:
    return ChunkTicket(session=session, chunk=chunk, keys=keys, labels=[0] * len(keys))


def _eventually(condition: Callable[[], bool], what: str) -> None:
    """Wait for the server to get somewhere (a bound against hanging, not a timing)."""
    deadline = time.monotonic() + 120
    while not condition():
        assert time.monotonic() < deadline, f"the server never {what}"
        time.sleep(0.01)


def _stats(server: HapiServer, session: str) -> SessionStats:
    return server.stats().sessions[session]


def _released(server: HapiServer) -> bool:
    """Whether no batch holds or waits for the budget: only heads hold memory."""
    budget = server.scheduler.stats()
    return budget.running == budget.waiting == 0 and budget.used == budget.reserved


def test_a_cancelled_stream_stops_within_a_batch_and_frees_its_memory(store_dir: Path) -> None:
    config = ServerConfig(store=str(store_dir), batch_size=BATCH, egress_limit=RATE)
    with serve(config) as server, connect(server.address) as conn:
        info = conn.open_session(_request())
        keys = list(conn.manifest("train").keys)
        assert len(keys) == KEYS
        stream = conn.stream(_ticket(info.session, keys))
        first = next(iter(stream))
        assert first.batch is not None
        read = len(first.batch.keys)
        stream.cancel()
        _eventually(lambda: _stats(server, info.session).abandoned == 1, "saw the cancel")
        _eventually(lambda: _released(server), "released the chunk's memory")
        stats = _stats(server, info.session)
        sent = stats.bytes_sent // first.nbytes  # batches that left, equal in size
        # What was computed, stated exactly: the batches sent (the one read; one more only
        # if the cancel came after the link had paced it), the one the stream had taken
        # to send when the client left, and the AHEAD_BATCHES the chunk computes ahead of
        # its stream, the last perhaps finishing after the cancel. No batch started after
        # it. Before the fix the chunk's thread computed one more with the outbox full.
        assert read == BATCH and sent >= 1
        assert stats.samples <= (sent + 1 + AHEAD_BATCHES) * BATCH < KEYS
        assert stats.chunks == 0 and server.sending.lanes() == 0
        # The server goes on serving: the same session, every key.
        assert sum(len(b.keys) for b in conn.fetch(_ticket(info.session, keys[:6])).batches) == 6


def test_a_queued_chunk_whose_client_disconnects_is_dropped_without_computing(
    store_dir: Path,
) -> None:
    config = ServerConfig(store=str(store_dir), batch_size=BATCH, compute_slots=1)
    with serve(config) as server, connect(server.address) as conn:
        info = conn.open_session(_request())
        keys = list(conn.manifest("train").keys)
        hold = Demand(model=MemoryModel(fixed=0, per_sample=0), max_batch=1)
        # The one compute slot is taken: the chunk's first batch waits in the queue.
        with server.scheduler.run("test", (0, 0), hold):
            gone = connect(server.address)
            stream = gone.stream(_ticket(info.session, keys))
            _eventually(lambda: server.scheduler.stats().waiting == 1, "queued the chunk")
            gone.close()  # the client goes away, its stream never read
            # It leaves the queue while the slot is still taken: nothing ran for it.
            _eventually(lambda: server.scheduler.stats().waiting == 0, "dropped the chunk")
            _eventually(lambda: _stats(server, info.session).abandoned == 1, "saw it leave")
            del stream
        _eventually(lambda: _released(server), "released the chunk's memory")
        stats = _stats(server, info.session)
        assert stats.samples == 0 and stats.bytes_sent == 0 and stats.chunks == 0
        # Another client's chunk runs to its end.
        result = conn.fetch(_ticket(info.session, keys[:5], chunk=1))
        assert sum(len(b.keys) for b in result.batches) == 5
        assert _stats(server, info.session).samples == 5


def test_streams_cancelled_at_once_leave_nothing_running(store_dir: Path) -> None:
    # The shape, small: several clients open large chunks, read one batch each
    # and leave; the server computes a few batches each, not their chunks.
    config = ServerConfig(store=str(store_dir), batch_size=BATCH, egress_limit=RATE)
    clients = 4
    with serve(config) as server, connect(server.address) as conn:
        info = conn.open_session(_request())
        keys = list(conn.manifest("train").keys)
        read: list[int] = []
        nbytes: list[int] = []

        def one(chunk: int) -> None:
            with connect(server.address) as own:
                stream = own.stream(_ticket(info.session, keys, chunk))
                part = next(iter(stream))
                read.append(len(part.batch.keys) if part.batch is not None else 0)
                nbytes.append(part.nbytes)
                stream.cancel()

        threads = [threading.Thread(target=one, args=(c,)) for c in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert len(read) == clients
        _eventually(lambda: _stats(server, info.session).abandoned == clients, "saw them go")
        _eventually(lambda: _released(server), "released the chunks' memory")
        stats = _stats(server, info.session)
        sent = stats.bytes_sent // max(nbytes)  # batches that left, equal in size
        assert read == [BATCH] * clients and sent >= clients
        # Each stream: what it sent, the batch it held, AHEAD_BATCHES computed ahead.
        assert stats.samples <= (sent + clients * (1 + AHEAD_BATCHES)) * BATCH
        assert stats.samples < clients * KEYS // 2 and stats.chunks == 0
