"""The error vocabulary: every error pickles, crosses the wire as itself, and stays short."""

from __future__ import annotations

import json
import pickle

import pyarrow.flight as flight
import pytest

import hapi.errors
from hapi.client import FeatureLoader, JobConfig, connect
from hapi.data import DatasetManifest
from hapi.errors import (
    ECHO_LIMIT,
    HapiError,
    InternalError,
    InvalidRequest,
    SessionNotFound,
    Unauthenticated,
    error_class,
    shorten,
)
from hapi.graph import ModelSpec
from hapi.server import ServerConfig
from hapi.wire import MAX_ERROR_MESSAGE, SkippedKey, decode_error, encode_error

ERRORS = sorted(
    (
        obj
        for obj in vars(hapi.errors).values()
        if isinstance(obj, type) and issubclass(obj, HapiError)
    ),
    key=lambda cls: cls.__name__,
)


def _received(sent: flight.FlightError) -> flight.FlightError:
    """What a Flight client gets for `sent`: the text decorated by gRPC, the same extra_info."""
    return type(sent)(f"{sent}. Detail: Failed", extra_info=sent.extra_info)


def test_the_vocabulary_is_exported() -> None:
    assert {cls.__name__ for cls in ERRORS} <= set(hapi.errors.__all__)
    assert len(ERRORS) >= 18


@pytest.mark.parametrize("cls", ERRORS, ids=lambda cls: cls.__name__)
def test_every_error_crosses_the_wire_as_its_class_and_message(cls: type[HapiError]) -> None:
    error = decode_error(_received(encode_error(cls("what went wrong, and what to do"))))
    assert type(error) is cls
    assert str(error) == "what went wrong, and what to do"


@pytest.mark.parametrize("cls", ERRORS, ids=lambda cls: cls.__name__)
def test_every_error_pickles(cls: type[HapiError]) -> None:
    error = pickle.loads(pickle.dumps(cls("bad key k")))
    assert type(error) is cls
    assert str(error) == "bad key k"


def test_errors_subclass_the_builtin_they_mean() -> None:
    assert issubclass(hapi.errors.ObjectNotFound, FileNotFoundError)
    assert issubclass(hapi.errors.InvalidRequest, ValueError)
    assert issubclass(hapi.errors.NothingToTrain, ValueError)
    assert issubclass(hapi.errors.NotDecoded, TypeError)
    assert issubclass(hapi.errors.DuplicateDelivery, RuntimeError)
    assert issubclass(hapi.errors.IncompleteEpoch, RuntimeError)
    assert issubclass(InternalError, RuntimeError)


def test_an_unknown_class_arrives_as_a_hapi_error() -> None:
    sent = flight.FlightServerError(
        "x", extra_info=json.dumps({"type": "FromANewerServer", "message": "m"}).encode()
    )
    error = decode_error(sent)
    assert type(error) is HapiError and str(error) == "m"
    # Not a HapiError subclass: a name that happens to be in hapi.errors is no class.
    assert error_class("shorten") is HapiError and error_class("__builtins__") is HapiError


@pytest.mark.parametrize(
    "extra_info", [b"", b"not json", b"[1, 2]", b'{"type": 3, "message": "m"}', b'{"type": "X"}']
)
def test_extra_info_that_is_not_a_hapi_error_is_left_alone(extra_info: bytes) -> None:
    sent = flight.FlightServerError("plain", extra_info=extra_info)
    assert decode_error(sent) is sent


def test_unauthenticated_is_a_flight_unauthenticated_error() -> None:
    sent = encode_error(Unauthenticated("wrong token"))
    assert isinstance(sent, flight.FlightUnauthenticatedError)
    assert type(decode_error(_received(sent))) is Unauthenticated


def test_an_internal_error_carries_its_id_through_pickle_and_the_wire() -> None:
    error = InternalError.new()
    assert error.error_id is not None and len(error.error_id) == 12
    assert InternalError.new().error_id != error.error_id
    assert error.error_id in str(error)
    pickled = pickle.loads(pickle.dumps(error))
    assert pickled.error_id == error.error_id
    received = decode_error(_received(encode_error(error)))
    assert isinstance(received, InternalError) and received.error_id == error.error_id
    assert InternalError("some other message").error_id is None


def test_session_not_found_reads_as_a_sentence() -> None:
    assert (
        str(SessionNotFound("no session 'x': open a new one")) == "no session 'x': open a new one"
    )


def test_shorten_keeps_short_text_and_cuts_long_text() -> None:
    assert shorten("abc") == "abc"
    assert shorten("x" * ECHO_LIMIT) == "x" * ECHO_LIMIT
    cut = shorten("y" * 10_000_000)
    assert cut.startswith("y" * ECHO_LIMIT) and len(cut) < ECHO_LIMIT + 50
    assert "9999800 more characters" in cut


@pytest.mark.parametrize("char", ["x", "\u00e9", "\U0001f600"])
def test_a_huge_message_is_cut_to_fit_grpc_metadata(char: str) -> None:
    sent = encode_error(InvalidRequest(f"unknown model {char * 10_000_000}"))
    body = json.loads(sent.extra_info)
    assert body["type"] == "InvalidRequest"
    assert body["message"].startswith("unknown model " + char * 100)
    assert len(body["message"]) <= MAX_ERROR_MESSAGE + 50
    # gRPC refuses metadata over 16 KiB; text and extra_info together stay far below.
    assert len(sent.extra_info) + len(str(sent).encode()) < 8 * 1024


def test_skipped_key_gives_back_its_error() -> None:
    skipped = SkippedKey.of("a/b.jpg", hapi.errors.CorruptObject("not an image"))
    again = SkippedKey.model_validate_json(skipped.to_bytes())
    assert again == skipped and again.error == "CorruptObject"
    error = again.exception()
    assert type(error) is hapi.errors.CorruptObject and str(error) == "not an image"


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"port": 70000}, "port"),
        ({"port": -1}, "port"),
        ({"batch_size": 0}, "batch_size"),
        ({"threads": 0}, "threads"),
        ({"device": "tpu"}, "device"),
        ({"device": "cudax"}, "device"),
        ({"session_idle_s": 0}, "session_idle_s"),
        ({"idle_heads": -1}, "idle_heads"),
        ({"egress_limit": "50"}, "rate|unit"),
    ],
)
def test_bad_server_settings_are_invalid_requests(options: dict[str, object], needle: str) -> None:
    with pytest.raises(InvalidRequest, match=needle):
        ServerConfig(store=".", **options)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"mode": "remote"}, "mode"),
        ({"cut": -2}, "cut"),
        ({"num_classes": 0}, "num_classes"),
        ({"batch_size": 0}, "batch_size"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"prefetch": 0}, "prefetch"),
        ({"image_size": 0}, "image_size"),
        ({"wire_dtype": "int4"}, "fp32, fp16, bf16, int8 or fp8"),
        ({"wire_compression": "gzip"}, "none, lz4 or zstd"),
        ({"wire_dtype": "int8", "exact": True}, "exact=True needs"),
        ({"on_error": "ignore"}, "on_error"),
        ({"model": "repo://m"}, "repo="),
    ],
)
def test_bad_job_settings_are_invalid_requests(options: dict[str, object], needle: str) -> None:
    fields: dict[str, object] = {
        "model": ModelSpec(name="resnet18"),
        "dataset": "train",
        "server": "grpc://127.0.0.1:1",
    }
    fields.update(options)
    with pytest.raises(InvalidRequest, match=needle):
        JobConfig.from_options(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": 4, "chunk_size": 0}, "chunk_size"),
        ({"batch_size": 4, "prefetch": 0}, "prefetch"),
        ({"batch_size": 4, "retries": -1}, "retries"),
    ],
)
def test_bad_loader_settings_are_invalid_requests(options: dict[str, int], needle: str) -> None:
    manifest = DatasetManifest(prefix="", keys=["a"], labels=[0], classes=["c"])
    with pytest.raises(InvalidRequest, match=needle):
        FeatureLoader(connect("127.0.0.1:1"), "s", manifest, **options)  # type: ignore[arg-type]
