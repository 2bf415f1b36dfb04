"""A local store never reads or writes outside its root, symlinks included."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from hapi.data import open_store
from hapi.errors import Forbidden, ObjectNotFound


@pytest.fixture
def linked(tmp_path: Path) -> Path:
    """A store with a file, a symlink to a file outside, a symlinked directory outside,
    and a symlink that stays inside."""
    root, outside = tmp_path / "store", tmp_path / "outside"
    (root / "ds" / "a").mkdir(parents=True)
    (outside / "sub").mkdir(parents=True)
    (outside / "secret.txt").write_bytes(b"secret")
    (outside / "sub" / "x.txt").write_bytes(b"also secret")
    (root / "ds" / "a" / "ok.txt").write_bytes(b"ok")
    os.symlink(outside / "secret.txt", root / "ds" / "a" / "leak.txt")
    os.symlink(outside / "sub", root / "ds" / "linkdir")
    os.symlink("a/ok.txt", root / "ds" / "alias.txt")  # relative, inside the root
    return root


ESCAPING = ["ds/a/leak.txt", "ds/linkdir/x.txt"]


@pytest.mark.parametrize("key", ESCAPING)
def test_reads_through_a_symlink_out_of_the_root_are_refused(linked: Path, key: str) -> None:
    store = open_store(linked, create=False)
    for call in (store.get, store.size, store.exists):
        with pytest.raises(Forbidden, match="symlink leaves the store's root") as info:
            call(key)
        assert str(linked.parent / "outside") not in str(info.value)  # the target stays unsaid
    (result,) = store.get_many([key])
    assert isinstance(result, Forbidden)


def test_writes_through_a_symlinked_directory_are_refused(linked: Path) -> None:
    store = open_store(linked, create=False)
    with pytest.raises(Forbidden):
        store.put("ds/linkdir/new.txt", b"x")
    with pytest.raises(Forbidden):
        store.put_if_absent("ds/linkdir/new.txt", b"x")
    with pytest.raises(Forbidden):
        store.delete("ds/linkdir/x.txt")
    assert not (linked.parent / "outside" / "sub" / "new.txt").exists()
    assert (linked.parent / "outside" / "sub" / "x.txt").exists()


def test_listing_leaves_escaping_keys_out(linked: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = open_store(linked, create=False)
    with caplog.at_level(logging.WARNING, logger="hapi.data"):
        keys = sorted(store.list())
    assert "ds/a/ok.txt" in keys
    assert not set(ESCAPING) & set(keys)
    assert "left out 2 key(s)" in caplog.text
    assert list(store.list("ds/linkdir")) == []


def test_links_inside_the_root_and_plain_files_still_work(linked: Path) -> None:
    store = open_store(linked, create=False)
    assert store.get("ds/a/ok.txt") == b"ok"
    assert store.get("ds/alias.txt") == b"ok"
    store.put("ds/a/new.txt", b"new")
    assert store.get_many(["ds/a/new.txt", "ds/alias.txt"]) == [b"new", b"ok"]


def test_a_root_reached_through_a_symlink_is_its_target(linked: Path, tmp_path: Path) -> None:
    alias = tmp_path / "alias-of-store"
    os.symlink(linked, alias)
    store = open_store(alias, create=False)
    assert store.get("ds/a/ok.txt") == b"ok"
    with pytest.raises(Forbidden):
        store.get("ds/a/leak.txt")


def test_plain_reads_of_a_local_store_give_every_byte_and_name_what_is_missing(
    tmp_path: Path,
) -> None:
    # Plain files are read without obstore (`read_plain`); the rest takes the checked path.
    store = open_store(tmp_path)
    blobs = {"a/b/c.bin": os.urandom(200_000), "top.bin": b"x", "empty.bin": b""}
    for key, data in blobs.items():
        store.put(key, data)
    for key, data in blobs.items():
        assert store.get(key) == data
    with pytest.raises(ObjectNotFound, match="a/b/nope.bin"):
        store.get("a/b/nope.bin")
    with pytest.raises(ObjectNotFound):
        store.get("a/nope/c.bin")
