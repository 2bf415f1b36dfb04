"""The trainer's feature cache against a real server: later epochs read what the first
computed, in the same order, and nothing stale or corrupt is ever a hit."""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from PIL import Image

from hapi.client import Connection, TransferJob
from hapi.data import (
    DatasetManifest,
    HorizontalFlip,
    Normalize,
    RandomResizedCrop,
    StoreOptions,
    Transforms,
    open_store,
    synth_dataset,
)
from hapi.graph import RAW
from hapi.server import HapiServer, serve
from tests.cache_files import flip_entries
from tests.cli_runner import hapi

SIZE = 64


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    synth_dataset(open_store(root), "train", classes=2, per_class=6, size=72, seed=5)
    return root


@pytest.fixture
def server(store_dir: Path) -> Iterator[HapiServer]:
    with serve(store=str(store_dir), batch_size=4) as running:
        yield running


@dataclass
class Listing(Connection):
    """The job's server, noting each listing the job asks of it."""

    events: list[str] = field(default_factory=list)

    def manifest(self, prefix: str = "") -> DatasetManifest:
        self.events.append(f"list {prefix}")
        return super().manifest(prefix)


def _job(server: HapiServer | Connection, cache_dir: Path, **options: object) -> TransferJob:
    defaults: dict[str, object] = {
        "freeze": "layer3",
        "cut": None,
        "image_size": SIZE,
        "batch_size": 4,
        "chunk_size": 5,
        "prefetch": 2,
        "seed": 3,
        "augment": False,
        "cache_dir": str(cache_dir),
    }
    defaults.update(options)
    where = server if isinstance(server, Connection) else server.address
    return TransferJob({"name": "resnet18", "num_classes": 2}, "train", where, **defaults)


def test_later_epochs_come_from_the_cache_bit_for_bit(server: HapiServer, tmp_path: Path) -> None:
    cached = _job(server, tmp_path / "c", exact=True)
    history = cached.fit(epochs=3, lr=0.05)
    first, *later = history.epochs
    assert first.cached == 0 and first.computed == 12 and first.bytes_received > 0
    for epoch in later:
        assert epoch.cached == epoch.samples == 12
        assert epoch.bytes_received == 0
    assert "cacheable: the transforms are deterministic" in cached.summary()
    first_line, second_line, _ = history.explain().splitlines()
    assert first_line.startswith("epoch 1:") and "12 samples: 12 computed" in first_line
    assert "0 computed, 12 from the trainer's cache" in second_line
    plain = _job(server, tmp_path / "unused", exact=True, cache=False).fit(epochs=3, lr=0.05)
    assert [e.loss for e in plain.epochs] == [e.loss for e in history.epochs]
    assert not (tmp_path / "unused").exists()


def test_a_second_job_on_the_same_head_hits_from_its_first_epoch(
    server: HapiServer, tmp_path: Path
) -> None:
    _job(server, tmp_path / "c").fit(epochs=1)
    again = _job(server, tmp_path / "c", seed=11).fit(epochs=1)  # another seed, same features
    assert again.epochs[0].cached == 12 and again.epochs[0].bytes_received == 0
    other_head = _job(server, tmp_path / "c", freeze="layer2").fit(epochs=1)
    assert other_head.epochs[0].cached == 0


def test_a_partly_cached_chunk_keeps_its_order(server: HapiServer, tmp_path: Path) -> None:
    _job(server, tmp_path / "c", exact=True).fit(epochs=1, lr=0.05)
    assert flip_entries(tmp_path / "c", every=3) == 4  # misses now
    partly = _job(server, tmp_path / "c", exact=True).fit(epochs=1, lr=0.05).epochs[0]
    assert 0 < partly.cached < 12 and partly.samples == 12
    plain = _job(server, tmp_path / "none", exact=True, cache=False).fit(epochs=1, lr=0.05)
    assert plain.epochs[0].loss == partly.loss


def test_an_object_rewritten_between_epochs_is_a_miss(
    server: HapiServer, store_dir: Path, tmp_path: Path
) -> None:
    job = _job(server, tmp_path / "c")
    job.fit(epochs=1)
    _rewrite(next(store_dir.glob("train/*/*.jpg")))
    second = job.fit(epochs=1).epochs[-1]
    assert second.cached == 11 and second.computed == 1


def _rewrite(victim: Path) -> None:
    buffer = io.BytesIO()
    Image.new("RGB", (72, 72), (200, 10, 10)).save(buffer, "JPEG")
    victim.write_bytes(buffer.getvalue())


def test_the_first_epoch_takes_the_jobs_own_listing_and_later_ones_list_again(
    server: HapiServer, tmp_path: Path
) -> None:
    _job(server, tmp_path / "c").fit(epochs=1)
    connection = Listing(address=server.address)
    job = _job(connection, tmp_path / "c")
    history = job.fit(epochs=2)
    # The job's listing (its keys) gives epoch 1's versions too; epoch 2 lists again.
    assert connection.events == ["list train", "list train"]
    assert [e.cached for e in history.epochs] == [12, 12]


def test_the_next_epochs_listing_begins_before_the_epoch_ends(
    server: HapiServer, tmp_path: Path
) -> None:
    """A listing of a million keys takes seconds: the next epoch's begins while the last
    chunks of this one train, so the next epoch starts without waiting for it."""
    connection = Listing(address=server.address)
    job = _job(connection, tmp_path / "c")
    events = connection.events  # the listings, and each step as it ends

    def slow_step(done: int, total: int) -> None:
        events.append(f"step {done}/{total}")
        time.sleep(0.5)  # a step long enough that the listing's thread has begun

    job.fit(epochs=2, progress=slow_step)
    assert events.count("list train") == 2  # the job's own (epoch 1's too), then epoch 2's
    second = [i for i, e in enumerate(events) if e == "list train"][1]
    assert second < events.index("step 3/3"), events


def test_a_job_fit_long_after_its_listing_lists_again(
    server: HapiServer, store_dir: Path, tmp_path: Path
) -> None:
    """Past `listing_fresh_s` the job's listing no longer gives the first epoch's versions:
    an object rewritten since is a miss."""
    _job(server, tmp_path / "c").fit(epochs=1)
    job = _job(server, tmp_path / "c", listing_fresh_s=0.5)
    job.manifest("train")  # listed, then the object changes before the job's first epoch
    _rewrite(next(store_dir.glob("train/*/*.jpg")))
    time.sleep(0.6)
    first = job.fit(epochs=1).epochs[0]
    assert first.cached == 11 and first.computed == 1


def test_a_corrupt_entry_is_a_miss_and_is_rewritten(server: HapiServer, tmp_path: Path) -> None:
    job = _job(server, tmp_path / "c")
    job.fit(epochs=1)
    assert flip_entries(tmp_path / "c", limit=1) == 1
    fresh = _job(server, tmp_path / "c")  # another process's view: nothing in its memory
    second = fresh.fit(epochs=1).epochs[-1]
    assert second.cached == 11 and second.computed == 1
    assert fresh.fit(epochs=1).epochs[-1].cached == 12


def test_fresh_augmentation_is_not_cached_and_says_why(server: HapiServer, tmp_path: Path) -> None:
    job = _job(server, tmp_path / "c", augment=True)
    assert "not cacheable: random_resized_crop, horizontal_flip" in job.summary()
    history = job.fit(epochs=2)
    assert all(e.cached == 0 for e in history.epochs)
    assert not (tmp_path / "c").exists()


def test_views_repeat_after_k_epochs(server: HapiServer, tmp_path: Path) -> None:
    job = _job(server, tmp_path / "c", augment=True, views=2)
    history = job.fit(epochs=4)
    assert [e.cached for e in history.epochs] == [0, 0, 12, 12]


def test_local_chunks_and_an_earlier_cut_are_kept_at_the_freeze_point(
    server: HapiServer, tmp_path: Path
) -> None:
    raw = _job(server, tmp_path / "c", cut=RAW).fit(epochs=2)
    assert [e.cached for e in raw.epochs] == [0, 12]
    earlier = _job(server, tmp_path / "c", cut="layer2").fit(epochs=1)
    assert earlier.epochs[0].cached == 12  # the same features at the freeze point
    assert Transforms((RandomResizedCrop(SIZE), HorizontalFlip(), Normalize())).is_random


def test_hapi_cache_lists_totals_and_clears_what_a_job_kept(
    server: HapiServer, tmp_path: Path
) -> None:
    directory = tmp_path / "c"
    _job(server, directory).fit(epochs=1)
    listed = hapi("cache", "ls", str(directory))
    assert listed.code == 0 and "resize+center_crop+normalize" in listed.stdout
    assert "12" in listed.stdout
    totals = hapi("cache", "stats", str(directory))
    assert "1 feature space(s), 12 entries" in totals.stdout
    wrong = hapi("cache", "clear", str(directory), "--space", "nope")
    assert wrong.code == 1 and "hapi cache ls" in wrong.error
    assert "cleared" in hapi("cache", "clear", str(directory)).stdout
    assert "empty" in hapi("cache", "ls", str(directory)).stdout
    assert _job(server, directory).fit(epochs=1).epochs[0].cached == 0
    missing = hapi("cache", "ls", str(tmp_path / "absent"))
    assert missing.code == 1 and "no feature cache at" in missing.error


def test_a_job_whose_features_are_all_cached_measures_no_plan(
    server: HapiServer, tmp_path: Path
) -> None:
    _job(server, tmp_path / "c").fit(epochs=1)
    job = _job(server, tmp_path / "c", cut="auto")
    history = job.fit(epochs=1)
    (plan,) = history.of_kind("plan")
    assert plan.data["cached"] and "no plan measured" in plan.message
    assert history.epochs[0].cached == 12 and plan.data["cut"] == job.freeze


@pytest.mark.s3
def test_an_object_rewritten_in_seaweedfs_is_a_miss(
    s3_bucket: tuple[str, StoreOptions], tmp_path: Path
) -> None:
    uri, options = s3_bucket
    store = open_store(uri, options)
    synth_dataset(store, "train", classes=2, per_class=6, size=72, seed=5)
    with serve(store=uri, store_options=options, batch_size=4) as running:
        job = _job(running, tmp_path / "c")
        assert job.fit(epochs=2).epochs[-1].cached == 12
        victim = sorted(store.list("train"))[0]
        image = Image.new("RGB", (72, 72), (10, 200, 10))
        buffer = io.BytesIO()
        image.save(buffer, "JPEG")
        store.put(victim, buffer.getvalue())
        third = job.fit(epochs=1).epochs[-1]
    assert third.cached == 11 and third.computed == 1
