"""The `ObjectStore` contract, checked the same way on every backend (memory, local, S3)."""

from __future__ import annotations

import os
import pickle

import pytest

from hapi.data import ObjectStore
from hapi.errors import InvalidRequest, ObjectNotFound

__all__ = ["INVALID_KEYS", "check_store_contract"]

INVALID_KEYS = ["", "/abs", "a//b", "a/../b", "./a", "a/", "a\x00b", "a/b\nc", "a\x7f"]


def check_store_contract(store: ObjectStore) -> None:
    """Exercise every `ObjectStore` method on an empty store; fail on any deviation."""
    assert isinstance(store, ObjectStore)
    assert list(store.list()) == []
    blob = os.urandom(300_000)
    store.put("a/b/one.bin", b"1")
    store.put("a/two.bin", b"22")
    store.put("ab.bin", blob)
    store.put("empty.bin", b"")
    assert store.get("a/b/one.bin") == b"1"
    assert store.get("ab.bin") == blob
    assert store.get("empty.bin") == b""
    assert store.size("a/two.bin") == 2 and store.size("ab.bin") == len(blob)
    # A prefix is a folder: "a" does not match "ab.bin".
    assert sorted(store.list("a")) == ["a/b/one.bin", "a/two.bin"]
    assert sorted(store.list("a/")) == ["a/b/one.bin", "a/two.bin"]
    assert sorted(store.list()) == ["a/b/one.bin", "a/two.bin", "ab.bin", "empty.bin"]
    assert list(store.list("nothing")) == []

    store.put("ab.bin", b"overwritten")
    assert store.get("ab.bin") == b"overwritten"
    assert store.put_if_absent("d.bin", b"first") is True
    assert store.put_if_absent("d.bin", b"second") is False
    assert store.get("d.bin") == b"first"

    got = store.get_many(["a/two.bin", "missing.bin", "ab.bin"])
    assert got[0] == b"22" and got[2] == b"overwritten"
    assert isinstance(got[1], ObjectNotFound) and "missing.bin" in str(got[1])
    assert store.get_many([]) == []

    store.delete("a/two.bin")
    store.delete("a/two.bin")  # deleting a missing object is not an error
    assert not store.exists("a/two.bin") and store.exists("a/b/one.bin")
    with pytest.raises(ObjectNotFound, match="a/two.bin"):
        store.get("a/two.bin")
    with pytest.raises(FileNotFoundError, match="a/two.bin"):  # for stdlib-only callers
        store.size("a/two.bin")
    for key in INVALID_KEYS:
        with pytest.raises(InvalidRequest, match="invalid object key"):
            store.put(key, b"x")

    # A store pickles (into DataLoader workers) and works after unpickling.
    again = pickle.loads(pickle.dumps(store))
    assert again.get("a/b/one.bin") == b"1"
    again.put("from-copy.bin", b"c")
    assert store.get("from-copy.bin") == b"c"
