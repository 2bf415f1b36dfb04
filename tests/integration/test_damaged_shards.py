"""Shards that break off - a WebDataset `.tar` cut mid-member or before its first member, a
Parquet file without its footer - on a real server: `hapi data ls` names each one, a job
under `on_error="skip"` trains every complete sample and reports the lost ones, and under
`"raise"` it stops naming the shard and the fix."""

from __future__ import annotations

import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from hapi.client import TransferJob
from hapi.data import DatasetManifest, open_store, synth_dataset
from hapi.data.shard_writer import import_shards
from hapi.errors import CorruptObject
from hapi.server import HapiServer, serve
from tests.cli_runner import hapi


def _shards(tmp_path: Path, fmt: str) -> tuple[Path, list[Path]]:
    """A store whose `data` holds 18 samples in shards of `fmt`, sorted by name."""
    source, root = tmp_path / "src", tmp_path / "store"
    synth_dataset(open_store(source), classes=3, per_class=6, size=40, seed=2)
    import_shards(source, open_store(root), "data", format=fmt, shard_size=6 * 2500)  # type: ignore[arg-type]
    ext = ".tar" if fmt == "webdataset" else ".parquet"
    shards = sorted((root / "data").glob(f"*{ext}"))
    assert len(shards) >= 3, "the test needs three shards or more"
    return root, shards


def _cut(path: Path, size: int) -> None:
    path.write_bytes(path.read_bytes()[:size])


@pytest.fixture
def webdataset(tmp_path: Path) -> tuple[Path, list[Path], int, str]:
    """18 samples in shards; the second cut inside its second sample's image, the third cut
    before its first whole header. Returns the store, the shards, the samples still whole
    and the key of the sample cut."""
    root, shards = _shards(tmp_path, "webdataset")
    whole = len(DatasetManifest.from_store(open_store(root), "data"))
    before = {
        p: len(DatasetManifest.from_store(open_store(root), f"data/{p.name}")) for p in shards
    }
    with tarfile.open(shards[1]) as tar:
        members = tar.getmembers()
    image = members[2]  # the second sample's image (each sample: KEY.jpg, KEY.cls)
    assert image.name.endswith(".jpg") and members[0].name.endswith(".jpg")
    _cut(shards[1], image.offset_data + 100)
    _cut(shards[2], 300)
    kept = whole - before[shards[1]] - before[shards[2]] + 1
    return root, shards, kept, image.name.split(".")[0]


@pytest.fixture
def server(webdataset: tuple[Path, list[Path], int, str]) -> Iterator[HapiServer]:
    with serve(store=str(webdataset[0]), batch_size=4) as running:
        yield running


def _job(address: str, **options: object) -> TransferJob:
    settings: dict[str, object] = {
        "freeze": "layer3",
        "cut": None,
        "image_size": 64,  # layer4 then sees 2x2: a last batch of one still trains
        "batch_size": 4,
        "chunk_size": 4,
        "augment": False,
        "cache": False,
    }
    settings.update(options)
    return TransferJob({"name": "resnet18", "num_classes": 3}, "data", address, **settings)


def test_ls_counts_the_whole_samples_and_names_each_damaged_shard(
    webdataset: tuple[Path, list[Path], int, str],
) -> None:
    root, shards, kept, _ = webdataset
    done = hapi("data", "ls", str(root), "--dataset", "data")
    assert done.code == 0, done.stderr
    text = " ".join(done.stdout.split())
    assert f"{kept} images" in text and f"in {len(shards)} shards; 2 damaged" in text
    second, third = shards[1], shards[2]
    assert f"data/{second.name}: cut short (member" in text
    assert f"of {second.stat().st_size}; lost 1 sample(s)" in text
    assert f"data/{third.name}: cut short (a partial tar header) at byte 0 of 300" in text


def test_a_job_that_skips_trains_every_whole_sample_and_reports_the_lost(
    server: HapiServer, webdataset: tuple[Path, list[Path], int, str]
) -> None:
    _, shards, kept, cut = webdataset
    history = _job(server.address, on_error="skip").fit(epochs=2)
    for epoch in history.epochs:
        assert epoch.samples == kept
        lost = {s.key for s in epoch.skipped}
        assert lost == {f"data/{shards[1].name}#{cut}", f"data/{shards[2].name}@bytes=0-300"}
        assert all(s.error == "CorruptObject" and "cut short" in s.message for s in epoch.skipped)


def test_a_job_that_raises_names_the_shard_and_the_fix(server: HapiServer) -> None:
    with pytest.raises(CorruptObject, match=r"shard data/.*cut short.*upload it again whole"):
        _job(server.address).fit(epochs=1)


@pytest.mark.parametrize("damage", ["footer", "half"])
def test_a_parquet_file_without_its_footer_is_named_and_the_others_train(
    tmp_path: Path, damage: str
) -> None:
    root, files = _shards(tmp_path, "parquet")
    rows = {p: len(DatasetManifest.from_store(open_store(root), f"data/{p.name}")) for p in files}
    bad = files[1]
    size = bad.stat().st_size
    _cut(bad, size - 20 if damage == "footer" else size // 2)
    listed = DatasetManifest.from_store(open_store(root), "data")
    assert len(listed) == sum(rows.values()) - rows[bad]
    assert [d.shard for d in listed.damaged] == [f"data/{bad.name}"]
    done = hapi("data", "ls", str(root), "--dataset", "data")
    assert done.code == 0 and f"data/{bad.name}: unreadable" in " ".join(done.stdout.split())
    with serve(store=str(root), batch_size=4) as server:
        epoch = _job(server.address, on_error="skip").fit(epochs=1).epochs[0]
        assert epoch.samples == len(listed)
        assert [s.key for s in epoch.skipped] == [f"data/{bad.name}@bytes=0-{bad.stat().st_size}"]
        with pytest.raises(CorruptObject, match=rf"data/{bad.name}.*upload it again whole"):
            _job(server.address).fit(epochs=1)
