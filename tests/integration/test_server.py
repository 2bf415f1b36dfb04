"""The server on a loopback port: features, raw bytes, and bad input that fails only itself."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.flight as flight
import pytest
import torch

from hapi.client import Connection, connect
from hapi.data import (
    ObjectStore,
    Transforms,
    load_sample,
    open_store,
    sample_seed,
    synth_dataset,
)
from hapi.errors import (
    CorruptObject,
    HapiError,
    InternalError,
    InvalidCut,
    InvalidRequest,
    ObjectNotFound,
    SessionNotFound,
    StoreUnavailable,
    StreamRecalled,
    Unauthenticated,
    UnknownModel,
)
from hapi.graph import INPUT, RAW, ModelSpec, build_model, trace
from hapi.server import HapiServer, ServerConfig, serve
from hapi.server import server as server_module
from hapi.server import session as session_module
from hapi.wire import (
    MAX_ERROR_MESSAGE,
    ActionType,
    ChunkReport,
    ChunkTicket,
    ServerStats,
    SessionInfo,
    SessionRequest,
    SessionStats,
    decode_error,
    raw_schema,
)

SIZE = 64
SPEC = ModelSpec(name="resnet18", num_classes=3)
EVAL = Transforms.eval(SIZE)


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("store")
    synth_dataset(open_store(root), "train", classes=3, per_class=4, size=80, seed=1)
    store = open_store(root)
    store.put("bad/cat/broken.jpg", b"this is not a jpeg")
    store.put("bad/cat/fine.jpg", store.get(next(iter(sorted(store.list("train"))))))
    return root


@pytest.fixture(scope="module")
def server(store_dir: Path) -> Iterator[HapiServer]:
    with serve(ServerConfig(store=str(store_dir), batch_size=5)) as running:
        yield running


@pytest.fixture
def conn(server: HapiServer) -> Iterator[Connection]:
    with connect(server.address) as c:
        yield c


def _request(**overrides: object) -> SessionRequest:
    fields: dict[str, object] = {
        "model": SPEC.to_dict(),
        "cut": 5,
        "freeze": 8,
        "transforms": EVAL.to_dict(),
        "image_size": SIZE,
    }
    fields.update(overrides)
    return SessionRequest(**fields)  # type: ignore[arg-type]


def _ticket(session: str, keys: list[str], epoch: int = 0) -> ChunkTicket:
    return ChunkTicket(session=session, chunk=0, epoch=epoch, keys=keys, labels=[0] * len(keys))


def test_features_are_the_head_of_the_model(conn: Connection, store_dir: Path) -> None:
    manifest = conn.manifest("train")
    assert len(manifest) == 12 and len(manifest.classes) == 3
    info = conn.open_session(_request(cut=5))
    keys = list(manifest.keys[:7])
    result = conn.fetch(_ticket(info.session, keys))
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


def test_raw_cut_sends_the_objects_bytes(conn: Connection, store_dir: Path) -> None:
    manifest = conn.manifest("train")
    info = conn.open_session(_request(cut=RAW))
    keys = list(manifest.keys[:3])
    result = conn.fetch(_ticket(info.session, keys))
    store = open_store(store_dir)
    assert [d for b in result.batches for d in (b.data or [])] == [store.get(k) for k in keys]


@pytest.mark.parametrize("window", [4096, "grpc"])
def test_a_chunk_larger_than_a_held_window_streams_whole(
    server: HapiServer, store_dir: Path, window: int | str
) -> None:
    # 4 KiB held (far under the chunk's bytes), and gRPC's own probe: the same bytes.
    with connect(server.address, receive_window=window) as held:  # type: ignore[arg-type]
        manifest = held.manifest("train")
        info = held.open_session(_request(cut=RAW))
        keys = list(manifest.keys[:6])
        result = held.fetch(_ticket(info.session, keys))
    store = open_store(store_dir)
    assert result.nbytes > 4 * 4096
    assert [d for b in result.batches for d in (b.data or [])] == [store.get(k) for k in keys]


def test_input_cut_sends_transformed_inputs(conn: Connection) -> None:
    info = conn.open_session(_request(cut=INPUT, wire_dtype="fp16"))
    assert info.feature_shape == [3, SIZE, SIZE]
    key = conn.manifest("train").keys[0]
    (batch,) = conn.fetch(_ticket(info.session, [key])).batches
    assert batch.features is not None and batch.features.dtype == torch.float16


def test_a_corrupt_object_fails_its_chunk_and_names_the_key(conn: Connection) -> None:
    info = conn.open_session(_request())
    with pytest.raises(CorruptObject, match="bad/cat/broken.jpg"):
        conn.fetch(_ticket(info.session, ["bad/cat/fine.jpg", "bad/cat/broken.jpg"]))
    # The server goes on serving the same session.
    assert len(conn.fetch(_ticket(info.session, ["bad/cat/fine.jpg"])).batches) == 1


def test_skip_mode_reports_what_it_skipped(conn: Connection) -> None:
    info = conn.open_session(_request(on_error="skip"))
    result = conn.fetch(_ticket(info.session, ["bad/cat/broken.jpg", "bad/cat/fine.jpg"]))
    assert [k for b in result.batches for k in b.keys] == ["bad/cat/fine.jpg"]
    assert [s.key for s in result.skipped] == ["bad/cat/broken.jpg"]
    assert result.skipped[0].error == "CorruptObject"
    assert isinstance(result.skipped[0].exception(), CorruptObject)
    assert "bad/cat/broken.jpg" in result.skipped[0].message


def test_a_missing_object_is_named(conn: Connection) -> None:
    info = conn.open_session(_request())
    with pytest.raises(ObjectNotFound, match="train/nope.jpg"):
        conn.fetch(_ticket(info.session, ["train/nope.jpg"]))


def test_unknown_model_is_refused(conn: Connection) -> None:
    with pytest.raises(UnknownModel, match="no_such_net"):
        conn.open_session(_request(model={"name": "no_such_net"}))


@pytest.mark.parametrize(("cut", "freeze", "needle"), [(6, 5, "freeze"), (99, None, "cut")])
def test_cut_past_freeze_or_model_is_refused(
    conn: Connection, cut: int, freeze: int | None, needle: str
) -> None:
    with pytest.raises(InvalidCut, match=needle):
        conn.open_session(_request(cut=cut, freeze=freeze))


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
        conn.fetch(_ticket("0" * 32, ["train/a.jpg"]))


def test_sessions_share_heads_and_close_with_stats(conn: Connection) -> None:
    first = conn.open_session(_request(cut=4))
    second = conn.open_session(_request(cut=4, wire_dtype="bf16"))
    cached = conn.stats().heads_cached
    conn.open_session(_request(cut=4))
    assert conn.stats().heads_cached == cached
    key = conn.manifest("train").keys[0]
    result = conn.fetch(_ticket(first.session, [key]))
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
        info = conn.open_session(_request(cut=RAW))
        keys = list(conn.manifest("train").keys)
        result = conn.fetch(_ticket(info.session, keys))
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
        info = conn.open_session(_request(cut=RAW))
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
        list(conn.stream(_ticket(info.session, keys[8:10])))
        # The actions' connection and the streams' own, which stays with no stream open.
        assert _established_to(port) == 2
        assert not conn.recall()
        opened = [conn.stream(_ticket(info.session, keys[4 * c : 4 * c + 4])) for c in (0, 1)]
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
        parts = list(conn.stream(_ticket(info.session, keys[4:8])))
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
        info = conn.open_session(_request(cut=RAW))
        with pytest.raises(StoreUnavailable):
            conn.fetch(_ticket(info.session, ["train/a.jpg"]))
        # Still serving: the session is there, and the failed chunk delivered nothing.
        stats = conn.stats()
        assert stats.store == "s3://nobucket"
        assert stats.sessions[info.session].samples == 0 == stats.bytes_sent


def test_heads_no_session_holds_are_dropped_beyond_the_idle_limit(store_dir: Path) -> None:
    with (
        serve(ServerConfig(store=str(store_dir), idle_heads=1)) as server,
        connect(server.address) as conn,
    ):
        held = conn.open_session(_request(cut=3))
        sessions = [conn.open_session(_request(cut=cut)) for cut in (5, 7)]
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
        again = conn.open_session(_request(cut=5))
        key = conn.manifest("train").keys[0]
        (batch,) = conn.fetch(_ticket(again.session, [key])).batches
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
        abandoned = conn.open_session(_request(cut=6))
        used = conn.open_session(_request(cut=6))
        key = conn.manifest("train").keys[0]
        clock.now += 50
        conn.fetch(_ticket(used.session, [key]))  # a chunk keeps its session alive
        clock.now += 20
        conn.open_session(_request(cut=2))  # opening a session closes the abandoned ones
        stats = conn.stats()
        assert abandoned.session in stats.closed_sessions
        assert used.session in stats.sessions
        assert len(server.heads) == 2  # the used session's head, and the new one's
        with pytest.raises(SessionNotFound, match="unused for too long"):
            conn.fetch(_ticket(abandoned.session, [key]))


def test_a_long_running_server_forgets_old_closed_sessions_but_not_their_bytes(
    store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server_module, "CLOSED_KEPT", 2)
    with serve(ServerConfig(store=str(store_dir))) as server, connect(server.address) as conn:
        key = conn.manifest("train").keys[0]
        ids, sent = [], 0
        for _ in range(4):
            session = conn.open_session(_request(cut=RAW)).session
            conn.fetch(_ticket(session, [key]))
            sent += conn.close_session(session).bytes_sent
            ids.append(session)
        stats = conn.stats()
        assert list(stats.closed_sessions) == ids[2:]
        assert stats.bytes_sent == sent > 0
        assert len(server._owners) == 2


def test_list_actions_names_every_action(conn: Connection) -> None:
    listed = {a.type: a.description for a in conn.client.list_actions()}
    assert set(listed) == {a.value for a in ActionType}
    assert all(listed.values())


@pytest.mark.parametrize(
    "call",
    [
        lambda c: list(c.list_flights()),
        lambda c: c.get_flight_info(flight.FlightDescriptor.for_path("x")),
        lambda c: c.get_schema(flight.FlightDescriptor.for_path("x")),
        lambda c: c.do_put(flight.FlightDescriptor.for_path("x"), pa.schema([]))[0].close(),
        lambda c: c.do_exchange(flight.FlightDescriptor.for_path("x"))[0].close(),
    ],
    ids=["list_flights", "get_flight_info", "get_schema", "do_put", "do_exchange"],
)
def test_flight_calls_hapi_does_not_use_are_refused_cleanly(conn: Connection, call: object) -> None:
    # pyarrow's client raises a plain OSError for get_schema, FlightErrors for the rest.
    with pytest.raises((flight.FlightError, OSError)) as caught:
        call(conn.client)  # type: ignore[operator]
    if isinstance(caught.value, flight.FlightError):
        assert isinstance(decode_error(caught.value), InvalidRequest)
    assert "InvalidRequest: hapi servers do not answer" in str(caught.value)
    assert "Traceback" not in str(caught.value) and ".py" not in str(caught.value)


def test_a_label_beyond_int64_is_an_invalid_request(conn: Connection) -> None:
    info = conn.open_session(_request())
    key = conn.manifest("train").keys[0]
    # model_construct skips the client's own validation: the server must check for itself.
    ticket = ChunkTicket.model_construct(
        session=info.session, chunk=0, epoch=0, keys=[key], labels=[2**70]
    )
    with pytest.raises(InvalidRequest, match="labels") as caught:
        conn.fetch(ticket)
    assert "Traceback" not in str(caught.value)
    assert len(conn.fetch(_ticket(info.session, [key])).batches) == 1


class _FailingStore:
    """The server's store at the boundary, failing as no store should: with a bug's error."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self.uri = store.uri

    def get(self, key: str) -> bytes:
        if "explode" in key:
            raise RuntimeError("/srv/secret/hapi/store.py: invariant broken")
        return self.store.get(key)

    def list(self, prefix: str = "") -> Iterator[str]:
        if "explode" in prefix:
            raise RuntimeError("/srv/secret/hapi/store.py: invariant broken")
        return self.store.list(prefix)

    def list_versions(self, prefix: str = "") -> Iterator[tuple[str, str]]:
        if "explode" in prefix:
            raise RuntimeError("/srv/secret/hapi/store.py: invariant broken")
        return self.store.list_versions(prefix)

    def __getattr__(self, name: str) -> object:
        return getattr(self.store, name)


@pytest.fixture
def failing_server(store_dir: Path) -> Iterator[HapiServer]:
    config = ServerConfig(store=str(store_dir))
    server = HapiServer(config, store=_FailingStore(open_store(store_dir)))  # type: ignore[arg-type]
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        thread.join(timeout=10)


def test_an_unexpected_error_is_an_internal_error_with_a_logged_id(
    failing_server: HapiServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="hapi.server")
    with connect(failing_server.address) as conn:
        info = conn.open_session(_request(cut=RAW))
        key = conn.manifest("train").keys[0]
        errors = []
        # In the chunk's stream, and in an action.
        with pytest.raises(InternalError) as in_stream:
            conn.fetch(_ticket(info.session, [key, "train/explode.jpg"]))
        errors.append(in_stream.value)
        with pytest.raises(InternalError) as in_action:
            conn.manifest("explode")
        errors.append(in_action.value)
        # The server goes on serving, the same session too.
        assert len(conn.fetch(_ticket(info.session, [key])).batches) == 1
    for error in errors:
        assert error.error_id is not None
        for leak in ("Traceback", "/srv/secret", ".py", "invariant", "RuntimeError"):
            assert leak not in str(error)
        # The operator finds the traceback in the log by the id the user reports.
        (record,) = [r for r in caplog.records if error.error_id in r.getMessage()]
        assert record.exc_info is not None and "invariant broken" in str(record.exc_info[1])


_BIG = 10_000_000


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"model": {"name": "x" * _BIG}}, UnknownModel),
        ({"model": {"name": "resnet18", "x" * _BIG: 1}}, InvalidRequest),
        ({"transforms": {"ops": [{"op": "\U0001f600" * (_BIG // 4)}]}}, InvalidRequest),
        ({"transforms": {"ops": [{"op": "resize", "size": "s" * _BIG}]}}, InvalidRequest),
        ({"wire_dtype": "\u00e9" * (_BIG // 2)}, InvalidRequest),
    ],
    ids=["model name", "model field", "op name", "op value", "wire dtype"],
)
def test_a_10mb_field_gives_the_hapi_error_not_a_transport_error(
    conn: Connection, overrides: dict[str, object], expected: type[HapiError]
) -> None:
    request = SessionRequest.model_construct(**{**_request().model_dump(), **overrides})
    with pytest.raises(expected) as caught:
        conn.open_session(request)
    assert len(str(caught.value)) <= MAX_ERROR_MESSAGE + 100


def test_a_10mb_key_or_session_is_an_invalid_request(conn: Connection) -> None:
    info = conn.open_session(_request())
    for ticket in (
        ChunkTicket.model_construct(
            session=info.session, chunk=0, epoch=0, keys=["k" * _BIG], labels=[0]
        ),
        ChunkTicket.model_construct(
            session="s" * _BIG, chunk=0, epoch=0, keys=["train/a.jpg"], labels=[0]
        ),
    ):
        with pytest.raises(InvalidRequest) as caught:
            conn.fetch(ticket)
        assert len(str(caught.value)) <= MAX_ERROR_MESSAGE + 100
    with pytest.raises(InvalidRequest, match="unknown action"):
        conn.action("y" * _BIG)
