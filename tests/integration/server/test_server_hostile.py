"""The server against what no client of hapi sends: unknown Flight calls, labels beyond int64,
a store that raises, 10 MB fields. It answers each with a hapi error and keeps serving."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.flight as flight
import pytest

from hapi.client import Connection, connect
from hapi.data import (
    ObjectStore,
    open_store,
)
from hapi.errors import (
    HapiError,
    InternalError,
    InvalidRequest,
    UnknownModel,
)
from hapi.graph import RAW
from hapi.server import HapiServer, ServerConfig
from hapi.wire import (
    MAX_ERROR_MESSAGE,
    ActionType,
    ChunkTicket,
    SessionRequest,
    decode_error,
)

from .conftest import chunk_ticket, session_request


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
    info = conn.open_session(session_request())
    key = conn.manifest("train").keys[0]
    # model_construct skips the client's own validation: the server must check for itself.
    ticket = ChunkTicket.model_construct(
        session=info.session, chunk=0, epoch=0, keys=[key], labels=[2**70]
    )
    with pytest.raises(InvalidRequest, match="labels") as caught:
        conn.fetch(ticket)
    assert "Traceback" not in str(caught.value)
    assert len(conn.fetch(chunk_ticket(info.session, [key])).batches) == 1


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
        info = conn.open_session(session_request(cut=RAW))
        key = conn.manifest("train").keys[0]
        errors = []
        # In the chunk's stream, and in an action.
        with pytest.raises(InternalError) as in_stream:
            conn.fetch(chunk_ticket(info.session, [key, "train/explode.jpg"]))
        errors.append(in_stream.value)
        with pytest.raises(InternalError) as in_action:
            conn.manifest("explode")
        errors.append(in_action.value)
        # The server goes on serving, the same session too.
        assert len(conn.fetch(chunk_ticket(info.session, [key])).batches) == 1
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
    request = SessionRequest.model_construct(**{**session_request().model_dump(), **overrides})
    with pytest.raises(expected) as caught:
        conn.open_session(request)
    assert len(str(caught.value)) <= MAX_ERROR_MESSAGE + 100


def test_a_10mb_key_or_session_is_an_invalid_request(conn: Connection) -> None:
    info = conn.open_session(session_request())
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
