"""The store contract on memory, a local directory and a real SeaweedFS S3 server."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from hapi.data import StoreOptions, open_store
from hapi.errors import InvalidRequest, ObjectNotFound, StoreUnavailable


@pytest.fixture(params=["memory", "local", pytest.param("s3", marks=pytest.mark.s3)])
def store_args(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, StoreOptions | None]:
    if request.param == "memory":
        return f"memory://{tmp_path.name}", None
    if request.param == "local":
        return str(tmp_path / "store"), None
    return request.getfixturevalue("s3_bucket")


def test_store_contract(store_args: tuple[str, StoreOptions | None]) -> None:
    store = open_store(*store_args)
    store.put("a/b/one.bin", b"1")
    store.put("a/two.bin", b"22")
    store.put("c.bin", b"333")
    assert store.get("a/b/one.bin") == b"1"
    assert store.size("a/two.bin") == 2
    assert sorted(store.list("a")) == ["a/b/one.bin", "a/two.bin"]
    assert sorted(store.list()) == ["a/b/one.bin", "a/two.bin", "c.bin"]
    store.put("c.bin", b"overwritten")
    assert store.get("c.bin") == b"overwritten"
    assert store.put_if_absent("d.bin", b"first") is True
    assert store.put_if_absent("d.bin", b"second") is False
    assert store.get("d.bin") == b"first"
    got = store.get_many(["a/two.bin", "missing.bin", "c.bin"])
    assert got[0] == b"22" and got[2] == b"overwritten"
    assert isinstance(got[1], ObjectNotFound) and "missing.bin" in str(got[1])
    store.delete("a/two.bin")
    store.delete("a/two.bin")  # deleting twice is not an error
    assert not store.exists("a/two.bin") and store.exists("a/b/one.bin")
    with pytest.raises(ObjectNotFound, match="a/two.bin"):
        store.get("a/two.bin")
    # A store pickles (into workers) and works after unpickling, with its own client.
    again = pickle.loads(pickle.dumps(store))
    assert again.get("a/b/one.bin") == b"1"


@pytest.mark.parametrize("key", ["", "/abs", "a//b", "a/../b", "./a"])
def test_invalid_keys_are_refused(key: str) -> None:
    with pytest.raises(InvalidRequest, match="invalid object key"):
        open_store("memory://keys").get(key)


def test_unknown_scheme_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="ftp"):
        open_store("ftp://host/x")


@pytest.mark.s3
def test_wrong_credentials_are_refused(seaweed, s3_bucket) -> None:  # type: ignore[no-untyped-def]
    uri, options = s3_bucket
    open_store(uri, options).put("x", b"1")
    bad = StoreOptions(endpoint=options.endpoint, access_key_id="nope", secret_access_key="nope")
    with pytest.raises(StoreUnavailable, match=uri.removeprefix("s3://")):
        open_store(uri, bad).get("x")


def test_a_store_that_is_down_fails_fast_and_names_itself() -> None:
    options = StoreOptions(endpoint="http://127.0.0.1:9", access_key_id="k", secret_access_key="s")
    store = open_store("s3://downbucket", options)
    with pytest.raises(StoreUnavailable, match="s3://downbucket"):
        store.get("x")
