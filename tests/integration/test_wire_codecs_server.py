"""Compressed, int8 and fp8 feature streams from a real server: jobs train on them, every
key arrives once, compression is bit-exact, and 8-bit features are refused where exactness
is asked."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch

from hapi.client import FeatureLoader, TransferJob, connect
from hapi.data import open_store, synth_dataset
from hapi.errors import InvalidRequest
from hapi.server import HapiServer, serve
from hapi.wire import ActionType, SessionRequest

SIZE = 64
KEYS = 24


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HapiServer]:
    root = tmp_path_factory.mktemp("store")
    synth_dataset(open_store(root), "train", classes=3, per_class=8, size=80, seed=2)
    with serve(store=str(root), batch_size=7) as running:
        yield running


def _job(server: HapiServer, **options: object) -> TransferJob:
    settings: dict[str, object] = {
        "freeze": "layer3",
        "cut": None,  # the freeze point: a fixed plan, so jobs compare like for like
        "image_size": SIZE,
        "batch_size": 8,
        "chunk_size": 5,
        "prefetch": 3,
        "seed": 7,
        "reuse_profiles": False,
    }
    settings.update(options)
    return TransferJob({"name": "resnet18", "num_classes": 3}, "train", server.address, **settings)


def _bytes_sent(server: HapiServer) -> int:
    with connect(server.address) as conn:
        return conn.stats().bytes_sent


def test_zstd_trains_bit_for_bit_as_uncompressed_with_fewer_bytes(server: HapiServer) -> None:
    before = _bytes_sent(server)
    plain = _job(server, exact=True)
    plain.fit(2, lr=0.05)
    between = _bytes_sent(server)
    packed = _job(server, exact=True, wire_compression="zstd")
    packed.fit(2, lr=0.05)
    after = _bytes_sent(server)
    assert plain.history.losses == packed.history.losses  # exact: equal, not close
    for epoch in packed.history.epochs:
        assert epoch.samples == KEYS  # the loader checks each key arrived once
    # layer3's features after a ReLU: many zeros, which ZSTD squeezes out.
    assert 0 < after - between < 0.9 * (between - before)


def test_int8_trains_close_to_fp32_on_a_quarter_of_the_bytes(server: HapiServer) -> None:
    fp32 = _job(server)
    fp32.fit(2, lr=0.05)
    int8 = _job(server, wire_dtype="int8", wire_compression="zstd")
    int8.fit(2, lr=0.05)
    assert [e.samples for e in int8.history.epochs] == [KEYS, KEYS]
    # The first step's loss, before training amplifies the rounding: within 1%.
    first_int8, first_fp32 = int8.history.losses[0], fp32.history.losses[0]
    assert first_int8 != first_fp32  # rounded, as int8 is
    assert abs(first_int8 - first_fp32) < 0.01 * first_fp32
    # Bytes received as they crossed: one byte an element and a scale and offset a
    # sample (0.24-0.3 of fp32's), which ZSTD squeezes further.
    ratio = int8.history.epochs[0].bytes_received / fp32.history.epochs[0].bytes_received
    assert 0.1 < ratio < 0.24


def test_fp8_trains_close_to_fp32_on_a_quarter_of_the_bytes(server: HapiServer) -> None:
    fp32 = _job(server)
    fp32.fit(1, lr=0.05)
    fp8 = _job(server, wire_dtype="fp8", wire_compression="zstd")
    fp8.fit(1, lr=0.05)
    assert [e.samples for e in fp8.history.epochs] == [KEYS]
    first_fp8, first_fp32 = fp8.history.losses[0], fp32.history.losses[0]
    assert first_fp8 != first_fp32  # rounded to 8-bit floats
    assert abs(first_fp8 - first_fp32) < 0.01 * first_fp32
    # One byte an element and a scale a sample, which ZSTD squeezes further.
    ratio = fp8.history.epochs[0].bytes_received / fp32.history.epochs[0].bytes_received
    assert 0.1 < ratio < 0.26


@pytest.mark.parametrize("wire_dtype", ["int8", "fp8"])
def test_every_key_of_an_8_bit_zstd_stream_arrives_once(
    server: HapiServer, wire_dtype: str
) -> None:
    request = SessionRequest(
        model={"name": "resnet18"},
        cut=3,
        freeze=3,
        transforms=_job(server).config.train_transforms.to_dict(),
        image_size=SIZE,
        wire_dtype=wire_dtype,
        compression="zstd",
    )
    with connect(server.address) as conn:
        info = conn.open_session(request)
        assert (info.wire_dtype, info.compression) == (wire_dtype, "zstd")
        manifest = conn.manifest("train")
        loader = FeatureLoader(conn, info.session, manifest, batch_size=4, chunk_size=5)
        batches = list(loader.batches(0))
        delivered = [k for b in batches for k in b.keys]
        assert sorted(delivered) == sorted(manifest.keys) and len(delivered) == KEYS
        assert all(b.features.dtype == torch.float32 for b in batches)
        # Packed once: what the server counted is what its batches hold compressed.
        stats = conn.close_session(info.session)
        assert 0 < stats.bytes_sent < 0.9 * KEYS * info.bytes_per_sample


@pytest.mark.parametrize("wire_dtype", ["int8", "fp8"])
def test_exact_refuses_8_bits_at_the_job_and_at_the_server(
    server: HapiServer, wire_dtype: str
) -> None:
    with pytest.raises(InvalidRequest, match="exact=True needs wire_dtype='fp32'"):
        _job(server, exact=True, wire_dtype=wire_dtype)
    with pytest.raises(InvalidRequest, match="exact=True refuses lossy_wire=True"):
        _job(server, exact=True, lossy_wire=True)
    body = {
        "model": {"name": "resnet18"},
        "cut": 3,
        "transforms": {},
        "wire_dtype": wire_dtype,
        "exact": True,
    }
    rounds = f"{wire_dtype} rounds"
    with connect(server.address) as conn, pytest.raises(InvalidRequest, match=rounds):
        conn.action(ActionType.OPEN_SESSION, json.dumps(body).encode())
