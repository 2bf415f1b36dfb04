"""Wire codecs: lossless compression is bit-exact and packed once, int8 stays within half a
step, fp8 within its relative precision."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hapi.errors import InvalidRequest
from hapi.wire import SessionInfo, SessionRequest, decode_batch, encode_batch, feature_schema, parse
from hapi.wire.codecs import (
    FP8_MAX,
    MIN_CHANNEL_ELEMENTS,
    check_compression,
    dequantize,
    dequantize_fp8,
    int8_groups,
    ipc_options,
    quantize,
    quantize_fp8,
    round_trip,
    sample_bytes,
)
from hapi.wire.packed import Packer, pack, unpack
from hapi.wire.replies import ChunkReport


def _through_ipc(batch: pa.RecordBatch, compression: str) -> pa.RecordBatch:
    """`batch` written and read back as Flight streams it under `compression`."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema, options=ipc_options(compression)) as writer:  # type: ignore[arg-type]
        writer.write_batch(batch)
    return pa.ipc.open_stream(sink.getvalue()).read_next_batch()


@pytest.mark.parametrize("compression", ["lz4", "zstd"])
@pytest.mark.parametrize("wire_dtype", ["fp32", "fp16", "bf16", "int8", "fp8"])
def test_compression_is_bit_exact(compression: str, wire_dtype: str) -> None:
    x = torch.relu(torch.randn(6, 16, 5, 5))  # half zeros, as after a ReLU
    schema = feature_schema((16, 5, 5), wire_dtype)  # type: ignore[arg-type]
    batch = encode_batch(schema, list("abcdef"), list(range(6)), features=x)
    plain = decode_batch(_through_ipc(batch, "none"))
    packed = decode_batch(_through_ipc(batch, compression))
    assert packed.keys == plain.keys
    assert packed.features is not None and plain.features is not None
    assert packed.features.dtype == plain.features.dtype
    assert torch.equal(packed.features.view(torch.uint8), plain.features.view(torch.uint8))


@pytest.mark.parametrize("compression", ["lz4", "zstd"])
def test_a_packed_batch_is_one_compressed_message_read_back_bit_for_bit(
    compression: str,
) -> None:
    x = torch.relu(torch.randn(32, 64, 7, 7))
    batch = encode_batch(feature_schema((64, 7, 7), "fp32"), ["k"] * 32, [0] * 32, features=x)
    assert pack(batch, "none") is batch
    packed = pack(batch, compression)  # type: ignore[arg-type]
    assert packed.num_rows == 1 and packed.schema.names == ["packed"]
    # What the server counts is what the compressed message holds: fewer bytes for
    # features half zeros, and no more than the batch's own message compressed.
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema, options=ipc_options(compression)) as writer:  # type: ignore[arg-type]
        writer.write_batch(batch)
    assert 0 < packed.nbytes < min(0.8 * batch.nbytes, sink.tell())
    # Across an uncompressed stream, as Flight sends it, and back.
    back = unpack(_through_ipc(packed, "none"))
    assert back.equals(batch)
    assert torch.equal(decode_batch(_through_ipc(packed, "none")).features, x)  # type: ignore[arg-type]
    empty = pack(pa.RecordBatch.from_pylist([], schema=batch.schema), compression)  # type: ignore[arg-type]
    assert empty.num_rows == 0 and unpack(empty).schema.equals(batch.schema)


@settings(max_examples=40, deadline=None)
@given(
    channels=st.integers(1, 8),
    side=st.integers(1, 12),
    scale=st.floats(1e-3, 1e3),
    shift=st.floats(-100, 100),
    seed=st.integers(0, 2**31 - 1),
)
def test_int8_error_is_within_half_a_step(
    channels: int, side: int, scale: float, shift: float, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, channels, side, side, generator=g) * scale + shift
    q = quantize(x)
    back = dequantize(q)
    assert back.dtype == torch.float32 and back.shape == x.shape
    groups = int8_groups((channels, side, side))
    flat = x.reshape(3, groups, -1)
    step = (flat.amax(2) - flat.amin(2)) / 255
    err = (back - x).abs().reshape(3, groups, -1).amax(2)
    # Half a step, and float32's rounding of values this large.
    assert bool((err <= step / 2 + 1e-6 * (flat.abs().amax(2) + 1)).all())


def test_int8_is_per_channel_only_where_channels_pay_for_their_scales() -> None:
    assert int8_groups((512, 7, 7)) == 1  # 49 elements a channel: one scale a sample
    assert int8_groups((64, 8, 8)) == 64
    assert int8_groups((1000,)) == 1
    assert MIN_CHANNEL_ELEMENTS == 64
    assert sample_bytes((64, 8, 8), "int8") == 64 * 64 + 64 * 8
    assert sample_bytes((64, 8, 8), "fp16") == 64 * 64 * 2


def test_int8_keeps_constant_channels_and_zeros_exact() -> None:
    x = torch.zeros(2, 4, 8, 8)
    x[0, 1] = 3.5
    x[1, 2, 0, 0] = 1.0
    back = dequantize(quantize(x))
    assert torch.equal(back[0], x[0])
    assert back[1, 2, 0, 0] == 1.0 and bool((back[1, 2].flatten()[1:] == 0).all())


def test_int8_refuses_features_that_are_not_finite() -> None:
    x = torch.ones(2, 10)
    x[1, 3] = float("nan")
    with pytest.raises(InvalidRequest, match="inf or NaN"):
        quantize(x)


def test_int8_batch_round_trips_as_the_local_path_rounds() -> None:
    x = torch.randn(4, 64, 8, 8)
    schema = feature_schema((64, 8, 8), "int8")
    assert schema.names == ["key", "label", "features", "scale", "offset"]
    batch = encode_batch(schema, list("abcd"), [1, 2, 3, 4], features=x)
    decoded = decode_batch(_through_ipc(batch, "zstd"))
    assert decoded.features is not None and decoded.features.dtype == torch.float32
    # A chunk the trainer computes itself rounds through the same codec: equal, bit for bit.
    assert torch.equal(decoded.features, round_trip(x, "int8"))
    assert not torch.equal(decoded.features, x)
    assert batch.column("features").type.value_type == pa.uint8()


@pytest.mark.parametrize("wire_dtype", ["int8", "fp8"])
def test_exact_sessions_refuse_8_bits_and_keep_lossless_compression(wire_dtype: str) -> None:
    base = {"model": {"name": "resnet18"}, "cut": 3, "transforms": {}, "exact": True}
    with pytest.raises(
        InvalidRequest, match=f"exact=True keeps features bit for bit, and {wire_dtype}"
    ):
        parse(SessionRequest, json.dumps({**base, "wire_dtype": wire_dtype}))
    request = parse(SessionRequest, json.dumps({**base, "compression": "zstd"}))
    assert parse(SessionRequest, request.to_bytes()).compression == "zstd"


def test_a_streams_packing_time_is_reported_as_the_servers() -> None:
    x = torch.relu(torch.randn(16, 64, 7, 7))
    batch = encode_batch(feature_schema((64, 7, 7), "fp32"), ["k"] * 16, [0] * 16, features=x)
    packer = Packer("zstd")
    assert packer(batch).equals(pack(batch, "zstd"))  # the same message, and its time kept
    assert packer.seconds > 0
    report = ChunkReport(chunk=3, server_s=1.5).to_bytes()
    stamped = ChunkReport.model_validate_json(
        ChunkReport.with_sent_bytes(report, 99, packing_s=0.25)
    )
    assert (stamped.sent_bytes, stamped.server_s) == (99, 1.75)


@settings(max_examples=40, deadline=None)
@given(
    channels=st.integers(1, 8),
    side=st.integers(1, 12),
    scale=st.floats(1e-3, 1e3),
    shift=st.floats(-100, 100),
    seed=st.integers(0, 2**31 - 1),
)
def test_fp8_error_is_within_e4m3s_precision(
    channels: int, side: int, scale: float, shift: float, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, channels, side, side, generator=g) * scale + shift
    q = quantize_fp8(x)
    assert q.values.dtype == torch.uint8 and q.values.shape == x.shape
    back = dequantize_fp8(q)
    assert back.dtype == torch.float32 and back.shape == x.shape
    groups = int8_groups((channels, side, side))
    flat, err = x.reshape(3, groups, -1), (back - x).abs().reshape(3, groups, -1)
    step = flat.abs().amax(2, keepdim=True) / FP8_MAX  # the group's scale
    # Half of E4M3's relative step (3 mantissa bits), or half its smallest subnormal
    # (2**-9 of the scale) near zero; float32's rounding of the scaling besides.
    bound = flat.abs() * 2**-4 + step * 2**-10 + 1e-6 * (flat.abs() + step)
    assert bool((err <= bound).all())


def test_fp8_keeps_zeros_and_each_groups_largest_exact_enough() -> None:
    x = torch.relu(torch.randn(2, 64, 8, 8, generator=torch.Generator().manual_seed(0)))
    x[1, 3] = 0.0  # an all-zero channel: scale 1, zeros back
    back = dequantize_fp8(quantize_fp8(x))
    assert bool((back[x == 0] == 0).all())
    # Unlike int8's even steps (range / 255, some 0.015 here), small values keep their
    # relative precision - down to E4M3's subnormals, below 2**-6 of the scale (~2e-4).
    small = (x > 0.005) & (x < 0.05)
    assert bool(small.any())
    assert bool((((back - x).abs() <= x * 2**-4 + 1e-7) | ~small).all())
    assert sample_bytes((64, 8, 8), "fp8") == 64 * 64 + 64 * 4


def test_fp8_batch_round_trips_as_the_local_path_rounds() -> None:
    x = torch.randn(4, 64, 8, 8)
    schema = feature_schema((64, 8, 8), "fp8")
    assert schema.names == ["key", "label", "features", "scale"]
    batch = encode_batch(schema, list("abcd"), [1, 2, 3, 4], features=x)
    decoded = decode_batch(unpack(_through_ipc(pack(batch, "zstd"), "none")))
    assert decoded.features is not None and decoded.features.dtype == torch.float32
    assert torch.equal(decoded.features, round_trip(x, "fp8"))
    assert not torch.equal(decoded.features, x)


def test_fp8_refuses_features_that_are_not_finite() -> None:
    x = torch.ones(2, 10)
    x[0, 1] = float("inf")
    with pytest.raises(InvalidRequest, match="inf or NaN"):
        quantize_fp8(x)


def test_uncompressed_requests_read_as_they_did_before_compression() -> None:
    # An older server refuses fields it does not know: "none" is left out of the JSON.
    request = SessionRequest(model={"name": "resnet18"}, cut=3, transforms={})
    assert b"compression" not in request.to_bytes()
    # An older server's reply has no compression field: none.
    info = SessionInfo.model_validate(
        {
            "session": "s",
            "cut": 3,
            "freeze": 4,
            "num_cuts": 5,
            "feature_shape": [8],
            "wire_dtype": "fp32",
            "bytes_per_sample": 32,
        }
    )
    assert info.compression == "none"


def test_unknown_compression_names_the_choices() -> None:
    with pytest.raises(InvalidRequest, match="none, lz4 or zstd"):
        check_compression("gzip")
