"""Every guarantee of the ImageFolder path, for every dataset format, on a real server over
a local directory and over SeaweedFS: each key once per epoch, a seeded order, resume mid-
epoch, a corrupt sample named in the error, a shard member's version the shard's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hapi.client import FeatureLoader, TransferJob, connect
from hapi.client.servers.sessions import Sessions
from hapi.data import (
    DatasetManifest,
    ObjectStore,
    StoreOptions,
    Transforms,
    import_folder,
    open_store,
    synth_dataset,
)
from hapi.data.shard_writer import import_shards
from hapi.errors import CorruptObject
from hapi.server import HapiServer, serve
from hapi.wire import SessionRequest

FORMATS = ["imagefolder", "webdataset", "parquet", "keylist"]
CORRUPT = b"\xff\xd8\xff\xe0 truncated"


def _write(store: ObjectStore, source: Path, name: str, fmt: str) -> str:
    """Write the local tree `source` under `name` in `fmt`; the dataset string to name it."""
    if fmt == "imagefolder":
        import_folder(source, store, name)
        return name
    if fmt == "keylist":
        manifest = import_folder(source, store, f"{name}/img")
        rows = [
            f"{k[len(name) + 1 :]},{manifest.classes[v]}"
            for k, v in zip(manifest.keys, manifest.labels, strict=True)
        ]
        store.put(f"{name}/list.csv", ("key,label\n" + "\n".join(rows)).encode())
        return f"{name}/list.csv"
    # Shards of about 5 samples: several shards, runs that cross shard ends.
    import_shards(source, store, name, format=fmt, shard_size=5 * 2500)  # type: ignore[arg-type]
    return name


def _datasets(store: ObjectStore, tmp: Path) -> dict[str, tuple[str, str]]:
    clean, dirty = tmp / "clean", tmp / "dirty"
    synth_dataset(open_store(clean), classes=3, per_class=6, size=40, seed=2)
    synth_dataset(open_store(dirty), classes=2, per_class=3, size=40, seed=4)
    (dirty / "class_0" / "zz-corrupt.jpg").write_bytes(CORRUPT)
    return {
        fmt: (_write(store, clean, f"{fmt}-train", fmt), _write(store, dirty, f"{fmt}-dirty", fmt))
        for fmt in FORMATS
    }


@pytest.fixture(scope="module", params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[HapiServer, ObjectStore, dict[str, tuple[str, str]]]]:
    options: StoreOptions | None = None
    if request.param == "local":
        uri = str(tmp_path_factory.mktemp("store"))
    else:
        seaweed = request.getfixturevalue("seaweed")
        uri, options = seaweed.new_bucket(), seaweed.options
    store = open_store(uri, options)
    names = _datasets(store, tmp_path_factory.mktemp("sources"))
    with serve(store=uri, store_options=options, batch_size=4) as running:
        yield running, store, names


def _loader(conn: Any, sessions: Sessions, manifest: DatasetManifest, **kw: Any) -> FeatureLoader:
    return FeatureLoader(conn, sessions, manifest, batch_size=4, chunk_size=3, seed=11, **kw)


def _request(cut: int) -> SessionRequest:
    model = {"name": "resnet18", "num_classes": 3}
    return SessionRequest(
        model=model, cut=cut, transforms=Transforms.eval(32).to_dict(), image_size=32
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_key_once_per_epoch_in_a_seeded_order_and_resumed_mid_epoch(
    served: tuple[HapiServer, ObjectStore, dict[str, tuple[str, str]]], fmt: str
) -> None:
    server, store, names = served
    conn = connect(server.address)
    with conn, Sessions(conn, _request) as sessions:
        manifest = conn.manifest(names[fmt][0])
        assert len(manifest) == 18 and manifest.counts() == {f"class_{i}": 6 for i in range(3)}
        assert manifest == DatasetManifest.from_store(store, names[fmt][0])  # the server's
        loader = _loader(conn, sessions, manifest)
        whole = [b.keys for b in loader.batches(1)]
        delivered = [k for keys in whole for k in keys]
        assert sorted(delivered) == sorted(manifest.keys)  # each key, once
        again = _loader(conn, sessions, manifest)
        assert again.order(1).tolist() == loader.order(1).tolist() != loader.order(2).tolist()
        assert delivered == [manifest.keys[i] for i in loader.order(1)]
        rest = [b.keys for b in again.batches(1, start=2 * 4)]
        assert rest == whole[2:]  # the same batches from there on, not one key before
    # A sample's version is its object's (a shard's), as listed: what caches key it by.
    for key, version in list(zip(manifest.keys, manifest.versions, strict=True))[:3]:
        assert store.get_versioned(key)[1] == version


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_corrupt_sample_fails_the_epoch_naming_its_key(
    served: tuple[HapiServer, ObjectStore, dict[str, tuple[str, str]]], fmt: str
) -> None:
    server, store, names = served
    manifest = DatasetManifest.from_store(store, names[fmt][1])
    (bad,) = [
        k
        for k, blob in zip(manifest.keys, store.get_many(manifest.keys), strict=True)
        if blob == CORRUPT
    ]
    job = TransferJob(
        {"name": "resnet18", "num_classes": 2},
        names[fmt][1],
        server.address,
        freeze="layer3",
        cut=None,
        image_size=32,
        batch_size=4,
        chunk_size=3,
    )
    with pytest.raises(CorruptObject, match=bad.replace(".", r"\.")):
        job.fit(1)
