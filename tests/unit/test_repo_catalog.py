"""The catalog cache: one file per store, and never answering for a store that changed."""

from __future__ import annotations

import shutil
import sqlite3
import threading
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

from hapi.data import StoreOptions, open_store
from hapi.errors import RefNotFound
from hapi.repo import ModelRepo, default_catalog_path
from hapi.repo.index.catalog import Catalog


def state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4,), value), "b": torch.zeros(2)}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HAPI_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("AWS_ENDPOINT_URL", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "cache"


def test_the_catalog_path_names_the_endpoint_too(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://minio-a:9000")
    on_a = default_catalog_path("s3://models/team")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://minio-b:9000")
    on_b = default_catalog_path("s3://models/team")
    assert on_a != on_b and Path(on_a).parent == cache
    assert ModelRepo.open("s3://models/team").catalog.path == on_b  # opening connects nothing
    # An explicit endpoint wins over the variable; spelling variants name one store.
    assert on_a == default_catalog_path(
        "s3://models/team/", StoreOptions(endpoint="HTTP://Minio-A:9000/")
    )
    assert on_b == default_catalog_path("s3://models/team/")
    assert (
        len({on_b, default_catalog_path("s3://models/x"), default_catalog_path("s3://m/team")}) == 3
    )
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    # Without an endpoint, the region picks AWS's endpoint (and partition).
    assert default_catalog_path("s3://models/team") != default_catalog_path(
        "s3://models/team", StoreOptions(region="cn-north-1")
    )


def test_a_directory_has_one_catalog_however_it_is_named(cache: Path, tmp_path: Path) -> None:
    path = default_catalog_path(str(tmp_path / "repo"))
    assert path == default_catalog_path(f"file://{tmp_path}/repo")
    assert path == default_catalog_path(str(tmp_path / "x" / ".." / "repo"))
    assert path != default_catalog_path(str(tmp_path / "other"))
    assert default_catalog_path("memory://r") == ":memory:"


def test_a_repository_recreated_in_place_is_answered_from_the_store(
    cache: Path, tmp_path: Path
) -> None:
    uri = tmp_path / "repo"
    first = ModelRepo.open(uri)
    first.push(state(1.0), "net")
    first.push(state(2.0), "net")
    first.push(state(3.0), "other")
    # Two readers with catalogs built before the wipe, one per way of syncing.
    by_name = ModelRepo.open(uri, catalog=tmp_path / "by_name.sqlite")
    by_listing = ModelRepo.open(uri, catalog=tmp_path / "by_listing.sqlite")
    assert by_name.resolve("net").version == 2 and len(by_listing.ls()) == 2

    shutil.rmtree(uri)
    assert ModelRepo.open(uri).ls() == []  # the default catalog, shared with `first`
    with pytest.raises(RefNotFound, match="holds no models yet"):
        by_name.resolve("other")

    new = ModelRepo.open(uri, catalog=tmp_path / "new.sqlite").push(state(9.0), "net")
    assert new.version == 1
    assert by_name.resolve("net").id == new.id
    assert torch.equal(by_name.pull("net")["w"], state(9.0)["w"])
    assert [(v.ref, v.id) for v in by_listing.ls()] == [("net@1", new.id)]
    assert [v.id for v in by_listing.log("net")] == [new.id]
    with pytest.raises(RefNotFound, match="net has versions 1"):
        by_listing.resolve("net@2")


def test_a_store_restored_from_an_older_copy_is_detected_by_its_refs() -> None:
    """Same epoch (the copy has it), but version 2 now names another model."""
    uri = f"memory://{uuid.uuid4().hex}"
    repo = ModelRepo.open(uri)
    repo.push(state(1.0), "net")
    store = open_store(uri)
    backup = {k: store.get(k) for k in store.list()}
    repo.push(state(2.0), "net")
    readers = [ModelRepo.open(uri), ModelRepo.open(uri)]
    assert all(r.resolve("net").version == 2 for r in readers)
    for key in list(store.list()):
        store.delete(key)
    for key, data in backup.items():
        store.put(key, data)
    other = ModelRepo.open(uri).push(state(7.0), "net")
    assert other.version == 2
    by_name, by_listing = readers
    assert by_name.resolve("net").id == other.id  # found its manifest gone, then its ref moved
    assert torch.equal(by_name.pull("net")["w"], state(7.0)["w"])
    assert [v.id for v in by_listing.ls()] == [other.id]


class CountingStore:
    """Counts manifest reads: a rebuilt catalog reads every manifest again."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.uri, self.manifest_reads = inner, inner.uri, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def get_many(self, keys: Iterable[str]) -> list[bytes | BaseException]:
        keys = list(keys)
        self.manifest_reads += sum(k.startswith("manifests/") for k in keys)
        return list(self.inner.get_many(keys))


def test_another_processes_removal_is_not_taken_for_a_stale_catalog(tmp_path: Path) -> None:
    uri = tmp_path / "repo"
    writer = ModelRepo.open(uri, catalog=tmp_path / "w.sqlite")
    counting = CountingStore(open_store(uri))
    reader = ModelRepo(counting, catalog=tmp_path / "r.sqlite")
    for i in range(3):
        writer.push(state(float(i)), "net")
    assert [v.version for v in reader.ls()] == [3] and counting.manifest_reads == 3
    writer.rm("net@3")
    assert reader.resolve("net").version == 2
    assert [v.version for v in reader.log("net")] == [2, 1]
    assert len(reader.ls()) == 1 and counting.manifest_reads == 3  # nothing read again


def test_a_catalog_file_another_connection_holds_opens_once_it_is_let_go(
    tmp_path: Path,
) -> None:
    """Switching a new catalog file to WAL takes its exclusive lock, and while another
    connection holds the write lock SQLite refuses at once, without the busy timeout: a
    shared catalog opened by two processes together failed with "database is locked"."""
    path = tmp_path / "shared.sqlite"
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    other.execute("CREATE TABLE t (x)")
    other.execute("BEGIN IMMEDIATE")  # another process, mid-way through its own opening
    other.execute("INSERT INTO t VALUES (1)")
    threading.Timer(0.5, lambda: other.execute("COMMIT")).start()
    catalog = Catalog(str(path))
    assert catalog.query("PRAGMA journal_mode") == [("wal",)]
    other.close()
