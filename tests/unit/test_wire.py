"""The wire format: messages, Arrow batches and errors round-trip, and golden schemas hold."""

from __future__ import annotations

import pickle

import pyarrow as pa
import pyarrow.flight as flight
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hapi.errors import CorruptObject, HapiError, InvalidRequest, ServerUnavailable
from hapi.wire import (
    WIRE_DTYPES,
    ActionType,
    ChunkReport,
    ChunkTicket,
    CloseSessionRequest,
    ServerStats,
    SessionRequest,
    SessionStats,
    SkippedKey,
    check_wire_dtype,
    decode_batch,
    decode_error,
    dtype_width,
    encode_batch,
    encode_error,
    feature_schema,
    parse,
    raw_schema,
)


def test_feature_schema_is_the_documented_one() -> None:
    schema = feature_schema((512, 7, 7), "fp16")
    assert schema.names == ["key", "label", "features"]
    assert schema.field("key").type == pa.string()
    assert schema.field("label").type == pa.int64()
    features = schema.field("features").type
    assert isinstance(features, pa.FixedShapeTensorType)
    assert features.value_type == pa.float16()
    assert list(features.shape) == [512, 7, 7]
    assert schema.metadata == {b"hapi.wire_dtype": b"fp16"}


def test_raw_schema_carries_bytes() -> None:
    assert raw_schema().names == ["key", "label", "data"]
    assert raw_schema().field("data").type == pa.binary()


@pytest.mark.parametrize(
    ("wire_dtype", "torch_dtype"),
    [("fp32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)],
)
def test_features_round_trip_in_their_wire_dtype(wire_dtype: str, torch_dtype: torch.dtype) -> None:
    x = torch.randn(5, 3, 4, 2)
    schema = feature_schema((3, 4, 2), wire_dtype)
    batch = encode_batch(schema, list("abcde"), [0, 1, 2, 3, 4], features=x)
    # Through Arrow IPC, as Flight sends it.
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        writer.write_batch(batch)
    received = pa.ipc.open_stream(sink.getvalue()).read_next_batch()
    decoded = decode_batch(received)
    assert decoded.keys == list("abcde")
    assert decoded.labels.tolist() == [0, 1, 2, 3, 4]
    assert decoded.features is not None
    assert decoded.features.dtype == torch_dtype
    assert torch.equal(decoded.features, x.to(torch_dtype))
    assert batch.nbytes >= x.numel() * torch.finfo(torch_dtype).bits // 8


def test_raw_batch_round_trips() -> None:
    batch = encode_batch(raw_schema(), ["k1", "k2"], [3, 4], data=[b"\xff\xd8jpeg", b""])
    decoded = decode_batch(batch)
    assert decoded.data == [b"\xff\xd8jpeg", b""]
    assert decoded.features is None


def test_unknown_wire_dtype_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="fp32, fp16, bf16, int8 or fp8"):
        feature_schema((4,), "int4")


@given(
    keys=st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=8),
    epoch=st.integers(0, 1000),
)
def test_ticket_json_round_trips(keys: list[str], epoch: int) -> None:
    ticket = ChunkTicket(session="s", chunk=3, epoch=epoch, keys=keys, labels=[0] * len(keys))
    assert parse(ChunkTicket, ticket.to_bytes()) == ticket


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"not json", "not valid JSON"),
        (b'{"session": "s", "chunk": 0, "keys": []}', "keys"),
        (b'{"session": "s", "chunk": -1, "keys": ["a"], "labels": [0]}', "chunk"),
        (b'{"session": "s", "chunk": 0, "keys": ["a"], "labels": [0], "pickle": 1}', "pickle"),
        (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
        (b'{"session": "s", "chunk": 0, "keys": ["a"], "labels": [' + b"9" * 30 + b"]}", "labels"),
        (b'{"session": "s", "chunk": 0, "keys": ["' + b"k" * 2000 + b'"], "labels": [0]}', "keys"),
    ],
)
def test_malformed_tickets_name_the_problem(body: bytes, needle: str) -> None:
    with pytest.raises(InvalidRequest, match=needle):
        parse(ChunkTicket, body)


def test_session_request_refuses_unknown_dtype() -> None:
    body = b'{"model": {"name": "resnet18"}, "cut": 3, "transforms": {}, "wire_dtype": "int4"}'
    with pytest.raises(InvalidRequest, match="wire_dtype"):
        parse(SessionRequest, body)


def test_errors_cross_the_wire_as_their_class() -> None:
    sent = encode_error(CorruptObject("object 'a/b.jpg' is not an image"))
    # What the client sees: gRPC's decoration around the text, the JSON in extra_info.
    received = flight.FlightServerError(
        f"{sent}. Detail: Failed. gRPC client debug context: x", extra_info=sent.extra_info
    )
    error = decode_error(received)
    assert type(error) is CorruptObject
    assert str(error) == "object 'a/b.jpg' is not an image"


def test_error_text_alone_is_not_decoded() -> None:
    # The class comes from extra_info only: a message that merely mentions one is not it.
    received = flight.FlightServerError('hapi-error:{"type": "CorruptObject", "message": "x"}')
    assert decode_error(received) is received


def test_unreachable_server_becomes_server_unavailable() -> None:
    error = decode_error(flight.FlightUnavailableError("failed to connect"), "grpc://h:1")
    assert isinstance(error, ServerUnavailable)
    assert "grpc://h:1" in str(error)


def test_errors_pickle() -> None:
    error = pickle.loads(pickle.dumps(CorruptObject("bad key k")))
    assert isinstance(error, CorruptObject) and isinstance(error, HapiError)
    assert str(error) == "bad key k"


def test_wire_dtypes_know_their_width() -> None:
    assert WIRE_DTYPES == ("fp32", "fp16", "bf16", "int8", "fp8")
    assert [dtype_width(d) for d in WIRE_DTYPES] == [4, 2, 2, 1, 1]
    with pytest.raises(InvalidRequest, match="fp32, fp16, bf16, int8 or fp8"):
        check_wire_dtype("fp64")


def test_action_names_are_the_documented_ones() -> None:
    # A golden list: renaming an action breaks every client already deployed.
    assert [a.value for a in ActionType] == [
        "open_session",
        "close_session",
        "manifest",
        "stats",
        "profile",
        "has_head",
        "keepalive",
        "locate",
    ]
    assert all(a.description for a in ActionType)


def test_replies_ignore_fields_a_newer_server_adds() -> None:
    stats = SessionStats.model_validate_json(b'{"chunks": 2, "gpu_s": 1.5}')
    assert stats.chunks == 2 and stats.samples == 0
    # Requests are strict: a typo must not be ignored.
    with pytest.raises(InvalidRequest, match="session_id"):
        parse(CloseSessionRequest, b'{"session_id": "x"}')


def test_server_stats_round_trip() -> None:
    stats = ServerStats(
        store="memory://x",
        heads_cached=1,
        heads_bytes=10,
        bytes_sent=5,
        sessions={"a": SessionStats(chunks=1, bytes_sent=5)},
    )
    again = ServerStats.model_validate_json(stats.to_bytes())
    assert again == stats
    assert again.heads_cached == 1 and again.sessions["a"].bytes_sent == 5


def test_a_chunk_report_lists_its_skipped_keys() -> None:
    report = ChunkReport(
        chunk=3, skipped=[SkippedKey.of("a.jpg", CorruptObject("object 'a.jpg' is broken"))]
    )
    again = ChunkReport.model_validate_json(report.to_bytes())
    assert again == report
    assert isinstance(again.skipped[0].exception(), CorruptObject)


@given(st.lists(st.binary(max_size=300), max_size=12), st.integers(0, 40))
def test_a_raw_batch_of_views_and_bytes_decodes_to_the_same_bytes(
    blobs: list[bytes], gap: int
) -> None:
    # Shard members arrive as views of one response with bytes between them (a tar's
    # headers); whole objects as bytes. Both are copied into the batch's one buffer.
    span = b"".join(b"\x00" * gap + b for b in blobs)
    view, parts, at = memoryview(span), [], 0
    for i, b in enumerate(blobs):
        at += gap
        parts.append(view[at : at + len(b)] if i % 2 else b)
        at += len(b)
    keys = [f"k{i}" for i in range(len(blobs))]
    batch = encode_batch(raw_schema(), keys, list(range(len(blobs))), data=parts)
    assert decode_batch(batch).data == blobs
