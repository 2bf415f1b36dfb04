"""TransferJob and FeatureLoader against a real server: pushdown trains what local trains."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from hapi.client import (
    Connection,
    DataConfig,
    FeatureLoader,
    FetchConfig,
    JobConfig,
    PlanningConfig,
    TrainingConfig,
    TransferJob,
    WireConfig,
    connect,
)
from hapi.data import open_store, synth_dataset
from hapi.errors import CorruptObject, InvalidCut
from hapi.graph import RAW, ModelSpec
from hapi.server import HapiServer, serve
from hapi.wire import SessionInfo, SessionRequest

SIZE = 64


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HapiServer]:
    root = tmp_path_factory.mktemp("store")
    store = open_store(root)
    synth_dataset(store, "train", classes=3, per_class=8, size=80, seed=2)
    synth_dataset(store, "val", classes=3, per_class=3, size=80, seed=3)
    synth_dataset(store, "dirty", classes=2, per_class=3, size=80, seed=4)
    store.put("dirty/class_0/zz-corrupt.jpg", b"\xff\xd8\xff\xe0 truncated")
    with serve(store=str(root), batch_size=7) as running:
        yield running


def _job(
    server: HapiServer, dataset: str = "train", classes: int = 3, **options: object
) -> TransferJob:
    defaults: dict[str, object] = {
        "freeze": "layer3",
        "cut": None,  # the freeze point: these tests compare fixed plans
        "image_size": SIZE,
        "batch_size": 8,
        "chunk_size": 5,
        "prefetch": 3,
        "seed": 7,
    }
    defaults.update(options)
    return TransferJob(
        {"name": "resnet18", "num_classes": classes}, dataset, server.address, **defaults
    )


def _open_session(conn: Connection, job: TransferJob) -> SessionInfo:
    """A session at the job's cut, for a FeatureLoader of the test's own."""
    return conn.open_session(
        SessionRequest(
            model=job.spec.to_dict(),
            cut=job.cut,
            freeze=job.freeze,
            transforms=job.config.train_transforms.to_dict(),
            image_size=SIZE,
        )
    )


def test_pushdown_and_local_training_give_the_same_losses(server: HapiServer) -> None:
    local = _job(server, mode="local")
    pushdown = _job(server)
    assert pushdown.cut == pushdown.freeze > 0 and local.cut == RAW
    local.fit(2, lr=0.05)
    pushdown.fit(2, lr=0.05)
    assert len(local.history.losses) == len(pushdown.history.losses) == 2 * 3
    torch.testing.assert_close(
        torch.tensor(pushdown.history.losses),
        torch.tensor(local.history.losses),
        rtol=1e-4,
        atol=1e-4,
    )
    # Training changed the trainable layers, identically, and left frozen ones alone.
    for (name, a), b in zip(
        pushdown.model.state_dict().items(), local.model.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4, msg=name)
    assert pushdown.evaluate("val").accuracy == pytest.approx(local.evaluate("val").accuracy)


def test_pushdown_past_the_convolutions_moves_fewer_bytes_than_raw_objects(
    server: HapiServer,
) -> None:
    # At layer3 a 64 px input gives 256x4x4 features (16 KB in fp32), more than these 4 KB
    # JPEGs; past the convolutions a sample is 512 values, and fp16 halves them again.
    local = _job(server, mode="local", freeze="avgpool")
    pushdown = _job(server, freeze="avgpool", wire_dtype="fp16")
    local.fit(1)
    pushdown.fit(1)
    (raw,) = local.history.epochs
    (features,) = pushdown.history.epochs
    assert raw.samples == features.samples == 24
    assert features.bytes_received < 0.5 * raw.bytes_received
    assert features.bytes_received >= 24 * 512 * 2  # and it did send every feature


def test_fp16_wire_trains_close_to_fp32(server: HapiServer) -> None:
    fp32 = _job(server)
    fp16 = _job(server, wire_dtype="fp16")
    fp32.fit(1)
    fp16.fit(1)
    torch.testing.assert_close(
        torch.tensor(fp16.history.losses), torch.tensor(fp32.history.losses), rtol=2e-2, atol=2e-2
    )
    assert fp16.history.epochs[0].bytes_received < 0.6 * fp32.history.epochs[0].bytes_received


def test_a_job_of_nested_parts_is_the_flat_one_and_trains_as_it_does(
    server: HapiServer,
) -> None:
    flat = _job(server, wire_dtype="fp16")
    config = JobConfig(
        model=ModelSpec(name="resnet18", num_classes=3),
        dataset="train",
        server=server.address,
        training=TrainingConfig(freeze="layer3", batch_size=8, seed=7),
        data=DataConfig(image_size=SIZE),
        planning=PlanningConfig(cut=None),
        wire=WireConfig(dtype="fp16"),
        fetch=FetchConfig(chunk_size=5, prefetch=3),
    )
    nested = TransferJob.from_config(config)
    assert nested.config == flat.config and nested.cut == flat.cut == flat.freeze
    flat.fit(1)
    nested.fit(1)
    assert len(nested.history.losses) == 3
    torch.testing.assert_close(
        torch.tensor(nested.history.losses), torch.tensor(flat.history.losses)
    )


def test_loader_delivers_every_key_once_per_epoch_in_a_seeded_order(server: HapiServer) -> None:
    conn = connect(server.address)
    manifest = conn.manifest("train")
    info = _open_session(conn, _job(server))
    loader = FeatureLoader(
        conn, info.session, manifest, batch_size=5, chunk_size=4, prefetch=3, seed=1
    )
    sizes = [len(y) for _, y in loader.epoch(0)]
    assert sizes == [5, 5, 5, 5, 4]
    assert loader.stats.samples == len(manifest) == 24
    assert loader.stats.chunks == 6
    orders = [loader.order(e).tolist() for e in (0, 1, 0)]
    assert orders[0] == orders[2] != orders[1]
    assert sorted(orders[1]) == list(range(24))


def test_the_loader_reads_ahead_while_a_batch_trains_up_to_its_window(
    server: HapiServer,
) -> None:
    """Chunk j+K is issued when chunk j is read, not when it is trained: while the
    trainer holds its first batch the server works on, up to K chunks plus those a batch
    spans plus one beyond the trained ones, and no further."""
    conn = connect(server.address)
    info = _open_session(conn, _job(server))
    delivered: list[str] = []
    loader = FeatureLoader(
        conn,
        info.session,
        conn.manifest("train"),  # 24 keys: 12 chunks of 2
        batch_size=4,
        chunk_size=2,
        prefetch=2,
        on_part=lambda _, keys: delivered.extend(keys),
    )
    batches = loader.epoch(0)
    next(batches)  # the trainer holds batch 0 (chunks 0 and 1; chunk 0 done with)
    deadline = time.monotonic() + 10
    window = 1 + 2 + (-(-4 // 2) + 1)  # trained + K + (chunks a batch spans + 1)
    while len(delivered) < 2 * window and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # were it unbounded, more would come now
    assert len(delivered) == 2 * window  # issued at training, it stopped at 3 chunks
    assert sum(len(y) for _, y in batches) == 20  # the rest of the epoch, every key once


def test_the_next_epoch_is_fetched_while_this_one_drains(server: HapiServer) -> None:
    """Told the epoch that comes next, the loader fetches its first chunks before it is
    asked for, within the windows, and it then delivers the same batches, each key once."""
    conn = connect(server.address)
    info = _open_session(conn, _job(server))
    delivered: list[str] = []
    options: dict[str, Any] = {"batch_size": 4, "chunk_size": 2, "prefetch": 2, "seed": 3}
    loader = FeatureLoader(
        conn,
        info.session,
        conn.manifest("train"),  # 24 keys: 12 chunks of 2
        on_part=lambda _, keys: delivered.extend(keys),
        **options,
    )
    assert sum(len(b.labels) for b in loader.batches(0, then=1)) == 24
    deadline = time.monotonic() + 10
    while len(delivered) == 24 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # were it unbounded, the whole next epoch would come now
    ahead = len(delivered) - 24
    assert 0 < ahead <= 2 * (2 + (-(-4 // 2) + 1))  # K + (chunks a batch spans + 1)
    assert delivered[24:] == [loader.manifest.keys[j] for j in loader.order(1)[:ahead]]

    batches = list(loader.batches(1))
    assert sorted(k for b in batches for k in b.keys) == sorted(loader.manifest.keys)
    assert len(delivered) == 48  # nothing fetched ahead was fetched again
    fresh = FeatureLoader(conn, info.session, conn.manifest("train"), **options)
    for got, want in zip(batches, fresh.batches(1), strict=True):
        assert got.keys == want.keys
        torch.testing.assert_close(got.features, want.features)


def test_an_epoch_fetched_ahead_and_not_asked_for_is_dropped(server: HapiServer) -> None:
    conn = connect(server.address)
    info = _open_session(conn, _job(server))
    manifest = conn.manifest("train")
    loader = FeatureLoader(conn, info.session, manifest, batch_size=4, chunk_size=2, prefetch=2)
    assert sum(len(b.labels) for b in loader.batches(0, then=1)) == 24
    # Asked for another epoch, it fetches that one's keys, each once.
    assert sorted(k for b in loader.batches(2, then=3) for k in b.keys) == sorted(manifest.keys)
    # An epoch left before its end drops the next one it started.
    batches = loader.batches(3, then=4)
    for _ in range(5):  # of 6: its last chunks are issued once read, then epoch 4's
        next(batches)
    deadline = time.monotonic() + 10
    while loader.ahead is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert loader.ahead is not None and loader.ahead.epoch == 4
    batches.close()
    assert loader.ahead is None
    assert sum(len(b.labels) for b in loader.batches(4, then=5)) == 24
    loader.close()
    assert loader.ahead is None
    loader.close()


def test_a_corrupt_image_fails_the_epoch_naming_the_key(server: HapiServer) -> None:
    job = _job(server, "dirty", 2, batch_size=4)
    with pytest.raises(CorruptObject, match="zz-corrupt.jpg"):
        job.fit(1)


@pytest.mark.parametrize("mode", ["pushdown", "local"])
def test_skip_mode_trains_on_the_rest_and_reports_the_bad_key(
    server: HapiServer, mode: str
) -> None:
    job = _job(server, "dirty", 2, batch_size=4, on_error="skip", mode=mode)
    (epoch,) = job.fit(1).epochs
    assert epoch.samples == 6
    assert [s.key for s in epoch.skipped] == ["dirty/class_0/zz-corrupt.jpg"]
    assert epoch.skipped[0].error == "CorruptObject"


def test_a_cut_past_the_freeze_point_is_refused_before_any_work(server: HapiServer) -> None:
    probe = _job(server)
    with pytest.raises(InvalidCut, match="freeze"):
        _job(server, cut=probe.freeze + 1)
    # RAW is allowed: the trainer then runs the whole model on the objects' bytes.
    assert _job(server, cut=RAW).cut == RAW
