"""The server on a loopback port: features, raw bytes, and bad input that fails only itself."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.flight as flight
import pydantic
import pytest
import torch

from hapi.client import Connection, connect
from hapi.data import (
    DatasetManifest,
    load_sample,
    open_store,
    sample_seed,
)
from hapi.errors import (
    CorruptObject,
    InvalidCut,
    InvalidRequest,
    ObjectNotFound,
    SessionNotFound,
    StoreUnavailable,
    StreamRecalled,
    Unauthenticated,
    UnknownModel,
)
from hapi.graph import INPUT, RAW, build_model, trace
from hapi.server import HapiServer, ServerConfig, serve
from hapi.server import server as server_module
from hapi.server.chunks import session as session_module
from hapi.wire import (
    ActionType,
    ChunkReport,
    ChunkTicket,
    ServerStats,
    SessionInfo,
    SessionStats,
    decode_error,
    raw_schema,
)
from hapi.wire import messages as wire_messages
from hapi.wire.messages import parse

from .conftest import EVAL, SIZE, SPEC, chunk_ticket, session_request


def test_features_are_the_head_of_the_model(conn: Connection, store_dir: Path) -> None:
    manifest = conn.manifest("train")
    assert len(manifest) == 12 and len(manifest.classes) == 3
    info = conn.open_session(session_request(cut=5))
    keys = list(manifest.keys[:7])
    result = conn.fetch(chunk_ticket(info.session, keys))
    assert [k for b in result.batches for k in b.keys] == keys
    got = torch.cat([b.features for b in result.batches if b.features is not None])
    model = build_model(SPEC)
    graph = trace(model, input_shape=(3, SIZE, SIZE))
    store = open_store(store_dir)
    x = torch.stack([load_sample(store.get(k), k, EVAL, sample_seed(0, 0, k)) for k in keys])
    with torch.inference_mode():
        expected = graph.head(5)(x)
    assert list(got.shape[1:]) == info.feature_shape
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert result.nbytes >= info.bytes_per_sample * len(keys)


class ManifestRequest(pydantic.BaseModel):
    """The manifest request of a server from before `format` (named as the server's)."""

    model_config = pydantic.ConfigDict(extra="forbid")
    prefix: str = ""


@dataclasses.dataclass(eq=False)
class _OlderServer(Connection):
    """A server that answers its manifest in JSON only, refusing `format` as it did."""

    asked: list[bytes] = dataclasses.field(default_factory=list)

    def action(self, name: str, body: bytes = b"") -> bytes:
        if name == ActionType.MANIFEST:
            self.asked.append(body)
            parse(ManifestRequest, body)
        return super().action(name, body)


def test_the_manifest_comes_as_arrow_and_as_json_from_an_older_server(
    conn: Connection, server: HapiServer
) -> None:
    body = wire_messages.ManifestRequest(prefix="train").to_bytes()
    as_json = DatasetManifest.from_dict(json.loads(conn.action(ActionType.MANIFEST, body)))
    as_arrow = conn.manifest("train")
    assert as_arrow == as_json and list(as_arrow.versions) == list(as_json.versions)
    assert len(as_arrow.versions) == len(as_arrow) == 12
    older = _OlderServer(address=server.address)
    assert older.manifest("train") == as_arrow
    assert [b'"arrow"' in b for b in older.asked] == [True, False]


def test_raw_cut_sends_the_objects_bytes(conn: Connection, store_dir: Path) -> None:
    manifest = conn.manifest("train")
    info = conn.open_session(session_request(cut=RAW))
    keys = list(manifest.keys[:3])
    result = conn.fetch(chunk_ticket(info.session, keys))
    store = open_store(store_dir)
    assert [d for b in result.batches for d in (b.data or [])] == [store.get(k) for k in keys]


@pytest.mark.parametrize("window", [4096, "grpc"])
def test_a_chunk_larger_than_a_held_window_streams_whole(
    server: HapiServer, store_dir: Path, window: int | str
) -> None:
    # 4 KiB held (far under the chunk's bytes), and gRPC's own probe: the same bytes.
    with connect(server.address, receive_window=window) as held:  # type: ignore[arg-type]
        manifest = held.manifest("train")
        info = held.open_session(session_request(cut=RAW))
        keys = list(manifest.keys[:6])
        result = held.fetch(chunk_ticket(info.session, keys))
    store = open_store(store_dir)
    assert result.nbytes > 4 * 4096
    assert [d for b in result.batches for d in (b.data or [])] == [store.get(k) for k in keys]


def test_input_cut_sends_transformed_inputs(conn: Connection) -> None:
    info = conn.open_session(session_request(cut=INPUT, wire_dtype="fp16"))
    assert info.feature_shape == [3, SIZE, SIZE]
    key = conn.manifest("train").keys[0]
    (batch,) = conn.fetch(chunk_ticket(info.session, [key])).batches
    assert batch.features is not None and batch.features.dtype == torch.float16


def test_a_corrupt_object_fails_its_chunk_and_names_the_key(conn: Connection) -> None:
    info = conn.open_session(session_request())
    with pytest.raises(CorruptObject, match="bad/cat/broken.jpg"):
        conn.fetch(chunk_ticket(info.session, ["bad/cat/fine.jpg", "bad/cat/broken.jpg"]))
    # The server goes on serving the same session.
    assert len(conn.fetch(chunk_ticket(info.session, ["bad/cat/fine.jpg"])).batches) == 1


def test_skip_mode_reports_what_it_skipped(conn: Connection) -> None:
    info = conn.open_session(session_request(on_error="skip"))
    result = conn.fetch(chunk_ticket(info.session, ["bad/cat/broken.jpg", "bad/cat/fine.jpg"]))
    assert [k for b in result.batches for k in b.keys] == ["bad/cat/fine.jpg"]
    assert [s.key for s in result.skipped] == ["bad/cat/broken.jpg"]
    assert result.skipped[0].error == "CorruptObject"
    assert isinstance(result.skipped[0].exception(), CorruptObject)
    assert "bad/cat/broken.jpg" in result.skipped[0].message


def test_a_missing_object_is_named(conn: Connection) -> None:
    info = conn.open_session(session_request())
    with pytest.raises(ObjectNotFound, match="train/nope.jpg"):
        conn.fetch(chunk_ticket(info.session, ["train/nope.jpg"]))


def test_unknown_model_is_refused(conn: Connection) -> None:
    with pytest.raises(UnknownModel, match="no_such_net"):
        conn.open_session(session_request(model={"name": "no_such_net"}))


@pytest.mark.parametrize(("cut", "freeze", "needle"), [(6, 5, "freeze"), (99, None, "cut")])
def test_cut_past_freeze_or_model_is_refused(
    conn: Connection, cut: int, freeze: int | None, needle: str
) -> None:
    with pytest.raises(InvalidCut, match=needle):
        conn.open_session(session_request(cut=cut, freeze=freeze))


def test_malformed_requests_are_refused(conn: Connection, server: HapiServer) -> None:
    raw = flight.connect(server.address)
    with pytest.raises(flight.FlightServerError) as action_error:
        list(raw.do_action(flight.Action(ActionType.OPEN_SESSION, b'{"model": 3}')))
    assert json.loads(action_error.value.extra_info)["type"] == "InvalidRequest"
    with pytest.raises(flight.FlightServerError) as get_error:
        raw.do_get(flight.Ticket(b"\x80\x04pickle")).read_all()
    assert isinstance(decode_error(get_error.value), InvalidRequest)
    with pytest.raises(InvalidRequest, match="unknown action"):
        conn.action("format_disk")
    with pytest.raises(SessionNotFound, match="open a new session"):
        conn.fetch(chunk_ticket("0" * 32, ["train/a.jpg"]))


def test_sessions_share_heads_and_close_with_stats(conn: Connection) -> None:
    first = conn.open_session(session_request(cut=4))
    second = conn.open_session(session_request(cut=4, wire_dtype="bf16"))
    cached = conn.stats().heads_cached
    conn.open_session(session_request(cut=4))
    assert conn.stats().heads_cached == cached
    key = conn.manifest("train").keys[0]
    result = conn.fetch(chunk_ticket(first.session, [key]))
    stats = conn.close_session(first.session)
    assert isinstance(stats, SessionStats)
    assert stats.chunks == stats.samples == 1 and stats.skipped == 0
    assert stats.bytes_sent == result.nbytes > 0 and stats.bytes_read > 0
    with pytest.raises(SessionNotFound):
        conn.close_session(first.session)
    server_stats = conn.stats()
    assert isinstance(server_stats, ServerStats)
    assert second.session in server_stats.sessions
    assert server_stats.closed_sessions[first.session] == stats
    assert server_stats.bytes_sent >= stats.bytes_sent
    # The process's CPU time, every thread's: it has served a chunk, and it only grows.
    assert 0 < server_stats.cpu_s <= conn.stats().cpu_s


def test_egress_limit_shapes_what_is_sent(store_dir: Path) -> None:
    with (
        serve(store=str(store_dir), egress_limit="2mbit") as server,
        connect(server.address) as conn,
    ):
        info = conn.open_session(session_request(cut=RAW))
        keys = list(conn.manifest("train").keys)
        result = conn.fetch(chunk_ticket(info.session, keys))
        stats = conn.stats().sessions[info.session]
    # 2 Mbit/s is 250 kB/s: what the chunk sent beyond the burst had to wait for the link.
    assert stats.bytes_sent == result.nbytes
    assert stats.shaping_wait_s >= (result.nbytes - 4 * 1024) / 250_000 * 0.9


@contextlib.contextmanager
def _slow_raw_session(
    store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[HapiServer, Connection, SessionInfo, list[str]]]:
    """A RAW session on a server whose egress limit holds each object's wire batch ~0.1 s:
    the server, a connection, the session and the train keys."""
    monkeypatch.setattr(session_module, "RAW_BATCH_BYTES", 1)
    with (
        serve(store=str(store_dir), egress_limit="240kbit") as server,
        connect(server.address) as conn,
    ):
        info = conn.open_session(session_request(cut=RAW))
        yield server, conn, info, list(conn.manifest("train").keys)


def test_a_connections_streams_send_in_chunk_order(
    store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One object a wire batch, each held ~0.1 s by the egress limit: read at once, two
    # streams sent together would interleave their batches on the link. In order, chunk
    # 1 sends nothing until chunk 0 has sent its report, and so takes the link whole.
    with _slow_raw_session(store_dir, monkeypatch) as (_, conn, info, keys):
        arrivals: dict[int, list[tuple[float, bool]]] = {0: [], 1: []}
        streams = {
            c: conn.stream(
                ChunkTicket(
                    session=info.session, chunk=c, epoch=0, keys=keys[4 * c : 4 * c + 4],
                    labels=[0] * 4,
                )
            )
            for c in (0, 1)
        }  # fmt: skip

        def read(chunk: int) -> None:
            for part in streams[chunk]:
                arrivals[chunk].append((time.perf_counter(), part.report is not None))

        readers = [threading.Thread(target=read, args=(c,)) for c in (1, 0)]
        for thread in readers:
            thread.start()
        for thread in readers:
            thread.join(30)
    assert [report for _, report in arrivals[0]] == [False] * 4 + [True]
    assert len(arrivals[1]) == 5
    chunk0_done = arrivals[0][-1][0]
    assert all(t > chunk0_done for t, _ in arrivals[1])


def _established_to(port: int) -> int:
    """TCP connections established to `port` on this machine (the kernel's own table)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "01" and int(fields[2].rsplit(":", 1)[1], 16) == port:
                count += 1
    return count


def test_a_recall_cuts_the_streams_in_flight_and_their_connection(
    store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One object a wire batch, held back by the egress limit: the streams are mid-chunk
    # when they are recalled.
    with _slow_raw_session(store_dir, monkeypatch) as (server, conn, info, keys):
        port = int(server.address.rsplit(":", 1)[1])
        list(conn.stream(chunk_ticket(info.session, keys[8:10])))
        # The actions' connection and the streams' own, which stays with no stream open.
        assert _established_to(port) == 2
        assert not conn.recall()
        opened = [conn.stream(chunk_ticket(info.session, keys[4 * c : 4 * c + 4])) for c in (0, 1)]
        first = next(iter(opened[0]))
        assert first.batch is not None
        assert _established_to(port) == 2
        assert conn.recall()
        with pytest.raises(StreamRecalled, match="was recalled"):
            list(opened[0])
        with pytest.raises(StreamRecalled):
            list(opened[1])
        deadline = time.monotonic() + 5
        while _established_to(port) > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _established_to(port) == 1  # closed, though its streams are still held
        assert not conn.recall()  # nothing open to cut
        parts = list(conn.stream(chunk_ticket(info.session, keys[4:8])))
        assert [k for p in parts if p.batch is not None for k in p.batch.keys] == keys[4:8]
        assert _established_to(port) == 2  # on a new connection


class _LateEnd(flight.FlightServerBase):
    """A server whose streams end (their trailers) 2 s after their report, as a stream's
    end does when it queues behind the next stream's bytes on a slow connection."""

    def do_get(
        self, context: flight.ServerCallContext, ticket: flight.Ticket
    ) -> flight.FlightDataStream:
        chunk = ChunkTicket.model_validate_json(ticket.ticket)
        report = ChunkReport(chunk=chunk.chunk).to_bytes()

        def parts() -> Iterator[tuple[pa.RecordBatch, pa.Buffer]]:
            yield pa.RecordBatch.from_pylist([], schema=raw_schema()), pa.py_buffer(report)
            time.sleep(2)

        return flight.GeneratorStream(raw_schema(), parts())


def test_a_chunk_is_read_at_its_report_not_at_its_streams_end() -> None:
    with _LateEnd("grpc://127.0.0.1:0") as late, connect(f"grpc://127.0.0.1:{late.port}") as conn:
        t0 = time.perf_counter()
        ticket = ChunkTicket(session="s", chunk=3, epoch=0, keys=["k"], labels=[0])
        parts = list(conn.stream(ticket))
        took = time.perf_counter() - t0
    assert [p.report.chunk for p in parts if p.report is not None] == [3]
    assert took < 1.0


def test_a_token_is_required_when_set(store_dir: Path) -> None:
    with serve(store=str(store_dir), token="s3cret") as server:
        with pytest.raises(Unauthenticated, match="token"):
            connect(server.address).stats()
        with pytest.raises(Unauthenticated):
            connect(server.address, token="wrong").stats()
        assert connect(server.address, token="s3cret").stats().bytes_sent == 0


def test_a_store_that_is_down_is_named(tmp_path: Path) -> None:
    from hapi.data import StoreOptions

    config = ServerConfig(
        store="s3://nobucket",
        store_options=StoreOptions(
            endpoint="http://127.0.0.1:9", access_key_id="k", secret_access_key="s"
        ),
    )
    with serve(config) as server, connect(server.address) as conn:
        with pytest.raises(StoreUnavailable, match="127.0.0.1:9|nobucket"):
            conn.manifest("train")
        info = conn.open_session(session_request(cut=RAW))
        with pytest.raises(StoreUnavailable):
            conn.fetch(chunk_ticket(info.session, ["train/a.jpg"]))
        # Still serving: the session is there, and the failed chunk delivered nothing.
        stats = conn.stats()
        assert stats.store == "s3://nobucket"
        assert stats.sessions[info.session].samples == 0 == stats.bytes_sent


def test_heads_no_session_holds_are_dropped_beyond_the_idle_limit(store_dir: Path) -> None:
    with (
        serve(ServerConfig(store=str(store_dir), idle_heads=1)) as server,
        connect(server.address) as conn,
    ):
        held = conn.open_session(session_request(cut=3))
        sessions = [conn.open_session(session_request(cut=cut)) for cut in (5, 7)]
        assert len(server.heads) == 3
        full = conn.stats().heads_bytes
        for info in reversed(sessions):
            conn.close_session(info.session)
        # The held head stays, and of the released ones only the most recent (cut 5:
        # the deeper head's extra layers are freed; heads of one model share the rest).
        assert len(server.heads) == 2 and conn.stats().heads_bytes < full
        conn.close_session(held.session)
        assert len(server.heads) == 1
        # A dropped head is loaded again when a session needs it; it computes the same.
        again = conn.open_session(session_request(cut=5))
        key = conn.manifest("train").keys[0]
        (batch,) = conn.fetch(chunk_ticket(again.session, [key])).batches
        assert batch.features is not None and list(batch.features.shape[1:]) == again.feature_shape
        assert len(server.heads) == 2


class _Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_session_its_job_abandoned_is_closed_and_frees_its_head(store_dir: Path) -> None:
    clock = _Clock()
    config = ServerConfig(store=str(store_dir), idle_heads=0, session_idle_s=60)
    with serve(config, clock=clock) as server, connect(server.address) as conn:
        abandoned = conn.open_session(session_request(cut=6))
        used = conn.open_session(session_request(cut=6))
        key = conn.manifest("train").keys[0]
        clock.now += 50
        conn.fetch(chunk_ticket(used.session, [key]))  # a chunk keeps its session alive
        clock.now += 20
        conn.open_session(session_request(cut=2))  # opening a session closes the abandoned ones
        stats = conn.stats()
        assert abandoned.session in stats.closed_sessions
        assert used.session in stats.sessions
        assert len(server.heads) == 2  # the used session's head, and the new one's
        with pytest.raises(SessionNotFound, match="unused for too long"):
            conn.fetch(chunk_ticket(abandoned.session, [key]))


def test_a_long_running_server_forgets_old_closed_sessions_but_not_their_bytes(
    store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server_module, "CLOSED_KEPT", 2)
    with serve(ServerConfig(store=str(store_dir))) as server, connect(server.address) as conn:
        key = conn.manifest("train").keys[0]
        ids, sent = [], 0
        for _ in range(4):
            session = conn.open_session(session_request(cut=RAW)).session
            conn.fetch(chunk_ticket(session, [key]))
            sent += conn.close_session(session).bytes_sent
            ids.append(session)
        stats = conn.stats()
        assert list(stats.closed_sessions) == ids[2:]
        assert stats.bytes_sent == sent > 0
        assert len(server._owners) == 2
