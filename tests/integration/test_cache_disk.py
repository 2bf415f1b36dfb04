"""A feature cache on a disk that fills or is read-only, on both tiers, for real (a tiny
tmpfs): the job and the server go on, read what the cache holds, stop writing with one
warning, and count what they could not keep."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from hapi.client import TransferJob, connect
from hapi.data import DatasetManifest, open_store, synth_dataset
from hapi.server import ServerConfig, serve
from tests.integration.test_server_feature_cache import request, run, ticket, tier
from tests.tmpfs import full, read_only, tmpfs


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    synth_dataset(open_store(root), "train", classes=2, per_class=6, size=72, seed=5)
    return root


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """128 KiB: room for the first chunk's entries below (5 of 16 KiB), not the next."""
    with tmpfs(tmp_path / "disk", "128k") as where:
        yield where


def _job(address: str, cache_dir: Path, **options: object) -> TransferJob:
    settings: dict[str, object] = {
        "freeze": "layer3",
        "cut": None,
        "image_size": 64,
        "batch_size": 4,
        "chunk_size": 5,
        "seed": 3,
        "augment": False,
        "exact": True,
        "cache_dir": str(cache_dir),
    }
    settings.update(options)
    return TransferJob({"name": "resnet18", "num_classes": 2}, "train", address, **settings)


def _refusals(records: list[logging.LogRecord]) -> list[logging.LogRecord]:
    return [r for r in records if "refused a write" in r.getMessage()]


def test_a_trainer_cache_on_a_disk_that_fills_keeps_the_job_going(
    store_dir: Path, disk: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="hapi.cache")
    with serve(store=str(store_dir), batch_size=4) as server:
        history = _job(server.address, disk).fit(epochs=2, lr=0.05)
        plain = _job(server.address, tmp_path / "unused", cache=False).fit(epochs=2, lr=0.05)
    first, second = history.epochs
    assert first.samples == second.samples == 12
    assert 0 < first.cache_write_failures < 12, "some entries fit, the rest were refused"
    assert "not cached (the cache's disk refused)" in history.explain().splitlines()[0]
    # What was not written stayed in the process's memory tier: epoch 2 moved nothing.
    assert second.cached == 12 and second.bytes_received == 0
    assert second.cache_write_failures == 0
    # Nothing lost, nothing twice: the same losses as a job without a cache.
    assert [e.loss for e in history.epochs] == [e.loss for e in plain.epochs]
    assert len(_refusals(caplog.records)) == 1, "one warning, not one per entry"


def test_a_read_only_trainer_cache_serves_what_it_holds(
    store_dir: Path, disk: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="hapi.cache")
    with (
        tmpfs(tmp_path / "big", "8m") as cache_dir,
        serve(store=str(store_dir), batch_size=4) as server,
    ):
        filled = _job(server.address, cache_dir).fit(epochs=1)
        assert filled.epochs[0].cache_write_failures == 0
        read_only(cache_dir)
        again = _job(server.address, cache_dir).fit(epochs=1).epochs[0]
        assert again.cached == 12 and again.bytes_received == 0
        assert again.cache_write_failures == 0 and not _refusals(caplog.records)
        # Another freeze point is another space: nothing to read, and nothing written.
        other = _job(server.address, cache_dir, freeze="layer2").fit(epochs=1).epochs[0]
    assert other.cached == 0 and other.samples == 12
    assert other.cache_write_failures == 12
    assert len(_refusals(caplog.records)) == 1


def _server(store_dir: Path, cache_dir: Path) -> ServerConfig:
    return ServerConfig(store=str(store_dir), batch_size=4, feature_cache=str(cache_dir))


@pytest.mark.parametrize("how", ["full", "read-only"])
def test_a_server_cache_that_refuses_writes_keeps_serving(
    store_dir: Path, disk: Path, how: str
) -> None:
    (full if how == "full" else read_only)(disk)
    manifest = DatasetManifest.from_store(open_store(store_dir), "train")
    with serve(_server(store_dir, disk)) as server, connect(server.address) as conn:
        first = run(conn, request(), ticket("-", manifest))
        tier(server).flush()
        second = run(conn, request(), ticket("-", manifest))
        cache = conn.stats().feature_cache
        metrics = server.metrics.render().decode()
    assert first.keys == second.keys == list(manifest.keys)
    assert first.features.equal(second.features) and second.report.cached == 0
    assert cache is not None and cache.writes == 0
    assert cache.write_failures == 24, "every computed feature of both chunks, counted"
    expected = "No space left" if how == "full" else "Read-only file system"
    assert cache.write_error is not None and expected in cache.write_error
    assert "hapi_feature_cache_write_failures_total 24.0" in metrics
