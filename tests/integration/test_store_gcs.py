"""The store facade on a real GCS emulator (fake-gcs-server): reads, listings and settings.

The emulator answers every request obstore makes except its uploads (see `tests/fake_gcs.py`),
so objects are written through the emulator's JSON API and the rest of the store contract is
checked through hapi's store.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator
from pathlib import Path

import pytest

from hapi.data import DatasetManifest, StoreOptions, open_store, synth_dataset
from hapi.errors import InvalidRequest, ObjectNotFound

from ..fake_gcs import FakeGCS
from ..store_contract import INVALID_KEYS


@pytest.fixture(scope="module")
def gcs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeGCS]:
    """fake-gcs-server on 127.0.0.1, stopped by its pid."""
    server = FakeGCS(Path(tmp_path_factory.mktemp("fake-gcs")))
    try:
        server.start()
    except RuntimeError as exc:
        pytest.fail(f"cannot start fake-gcs-server for the GCS tests: {exc}", pytrace=False)
    try:
        yield server
    finally:
        server.stop()


def test_the_store_contract_but_writes(gcs: FakeGCS) -> None:
    uri = f"{gcs.new_bucket()}/root"
    blob = os.urandom(300_000)
    for key, data in (("a/b/one.bin", b"1"), ("a/two.bin", b"22"), ("ab.bin", blob)):
        gcs.upload(uri, key, data)
    gcs.upload(uri, "empty.bin", b"")
    store = open_store(uri, gcs.options)
    assert store.get("a/b/one.bin") == b"1" and store.get("ab.bin") == blob
    assert store.get("empty.bin") == b""
    assert store.size("a/two.bin") == 2 and store.size("ab.bin") == len(blob)
    # A prefix is a folder: "a" does not match "ab.bin"; keys are relative to the URI's.
    assert sorted(store.list("a")) == ["a/b/one.bin", "a/two.bin"]
    assert sorted(store.list()) == ["a/b/one.bin", "a/two.bin", "ab.bin", "empty.bin"]
    assert list(store.list("nothing")) == []
    got = store.get_many(["a/two.bin", "missing.bin"])
    assert got[0] == b"22" and isinstance(got[1], ObjectNotFound) and "missing.bin" in str(got[1])
    store.delete("a/two.bin")
    store.delete("a/two.bin")  # deleting a missing object is not an error
    assert not store.exists("a/two.bin") and store.exists("a/b/one.bin")
    with pytest.raises(FileNotFoundError, match="a/two.bin"):
        store.size("a/two.bin")
    for key in INVALID_KEYS:
        with pytest.raises(InvalidRequest, match="invalid object key"):
            store.get(key)
    assert pickle.loads(pickle.dumps(store)).get("a/b/one.bin") == b"1"
    store.check()


def test_a_dataset_is_read_from_gcs(gcs: FakeGCS, tmp_path: Path) -> None:
    local = open_store(tmp_path)
    written = synth_dataset(local, "train", classes=2, per_class=3)
    uri = gcs.new_bucket()
    for key in local.list():
        gcs.upload(uri, key, local.get(key))
    assert DatasetManifest.from_store(open_store(uri, gcs.options), "train") == written


def test_the_service_account_comes_from_the_usual_variable(
    gcs: FakeGCS, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri = gcs.new_bucket()
    gcs.upload(uri, "k", b"v")
    for name, value in gcs.client_env.items():
        monkeypatch.setenv(name, value)
    assert open_store(uri).get("k") == b"v"


def test_a_missing_service_account_file_is_named(tmp_path: Path) -> None:
    options = StoreOptions(service_account=str(tmp_path / "nope.json"))
    with pytest.raises(InvalidRequest, match=r"service_account .*nope.json.* is not a file"):
        open_store("gs://bucket", options).get("x")


def test_a_uri_without_a_bucket_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="names no bucket"):
        open_store("gs://", StoreOptions()).get("x")
