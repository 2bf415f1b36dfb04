"""Staging files of killed writes to a local directory store: which ones obstore's listing
hides, and that `sweep_partial` and `gc` remove exactly the old ones among them."""

from __future__ import annotations

import io
import os
import tarfile
import time
from pathlib import Path

import pytest
import torch

from hapi.data import open_store
from hapi.data.store.partial import is_partial_name, sweep_partial
from hapi.errors import InvalidRequest
from hapi.repo import ModelRepo, RepoConfig

HOUR = 3600.0


def _tar(members: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, body in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    return out.getvalue()


def _write(path: Path, data: bytes, age_s: float) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    stamp = time.time() - age_s
    os.utime(path, (stamp, stamp))
    return path


def _files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A store whose visible objects (some named with `#`, a tar shard with a member named
    by digits alone) are all old, beside two old staging files and a young one."""
    root = tmp_path / "store"
    store = open_store(root)
    store.put("tensors/ab/abcd.safetensors", b"blob")
    store.put("shards/a.tar", _tar({"0001.jpg": b"member", "0001.cls": b"3"}))
    store.put("shards/a.tar#k1", b"a real object named like a shard member")
    store.put("notes/x#abc", b"visible: the part after # is not all digits")
    store.put("notes/y#7#1", b"visible: obstore splits at the first #")
    for key in list(store.list()):
        _write(root / key, (root / key).read_bytes(), HOUR)
    _write(root / "tensors/ab/abcd.safetensors#1", b"half a blob", HOUR)
    _write(root / "notes/x#abc#2", b"what", 2 * HOUR)  # visible, so never swept
    _write(root / "shards/b.tar#12", b"half a shard", HOUR)
    _write(root / "tensors/cd/cdef.safetensors#1", b"being written", 1.0)
    return root


def test_the_partial_names_are_exactly_those_obstore_does_not_list(root: Path) -> None:
    listed = set(open_store(root).list())
    for path in _files(root):
        assert is_partial_name(path.rpartition("/")[2]) == (path not in listed), path
    assert {"shards/a.tar#k1", "notes/x#abc#2", "notes/y#7#1"} <= listed


def test_sweep_removes_old_staging_files_only(root: Path) -> None:
    store = open_store(root)
    # Read from disk: `get` of `shards/a.tar#k1` reads a member of the shard.
    before = {k: (root / k).read_bytes() for k in store.list()}
    member = store.get("shards/a.tar#0001")
    assert sweep_partial(store, "", older_than_s=600, dry_run=True) == 2
    assert (root / "tensors/ab/abcd.safetensors#1").exists()

    assert sweep_partial(store, "", older_than_s=600) == 2
    gone = {"tensors/ab/abcd.safetensors#1", "shards/b.tar#12"}
    assert not gone & _files(root)
    assert (root / "tensors/cd/cdef.safetensors#1").exists()  # young: may be being written
    assert {k: (root / k).read_bytes() for k in store.list()} == before
    assert store.get("shards/a.tar#0001") == member
    assert sweep_partial(store, "", older_than_s=600) == 0


def test_sweep_stays_under_its_prefix_and_never_follows_links(root: Path, tmp_path: Path) -> None:
    outside = _write(tmp_path / "elsewhere" / "t.safetensors#1", b"not the store's", HOUR)
    os.symlink(outside, root / "tensors" / "link.safetensors#3")
    os.symlink(outside.parent, root / "tensors" / "linked")
    os.symlink(outside.parent, root / "escape")
    store = open_store(root)
    assert sweep_partial(store, "escape", older_than_s=0) == 0
    assert sweep_partial(store, "tensors", older_than_s=600) == 1
    assert (root / "shards/b.tar#12").exists()
    assert outside.exists() and (root / "tensors" / "link.safetensors#3").is_symlink()


def test_stores_without_staging_files_sweep_nothing(tmp_path: Path) -> None:
    store = open_store("memory://partial-sweep")
    store.put("tensors/a#1", b"a memory store writes whole objects")
    assert sweep_partial(store, "", older_than_s=0) == 0
    assert store.get("tensors/a#1")
    with pytest.raises(InvalidRequest, match="older_than_s"):
        sweep_partial(open_store(tmp_path), "", older_than_s=-1)


def test_gc_sweeps_the_repository_prefixes_after_the_lock_ttl(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    repo = ModelRepo.open(root, catalog=":memory:")
    repo.push({"w": torch.arange(4.0)}, "m")
    old = [
        _write(root / "tensors/ff/ffff.safetensors#1", b"half", HOUR),
        _write(root / "manifests/abc.json#1", b"{", HOUR),
        _write(root / "locks/push-1.json#2", b"{", HOUR),
    ]
    young = _write(root / "tensors/ee/eeee.safetensors#1", b"half", 1.0)
    dataset = _write(root / "images/a.jpg#1", b"not the repository's", HOUR)

    assert repo.gc(dry_run=True).removed_partial == len(old)
    assert all(p.exists() for p in old)
    report = repo.gc()
    assert report.removed_partial == len(old) and report.removed_blobs == 0
    assert not any(p.exists() for p in old)
    assert young.exists() and dataset.exists()
    assert torch.equal(repo.pull("m")["w"], torch.arange(4.0))

    eager = ModelRepo.open(root, catalog=":memory:", config=RepoConfig(partial_age_s=0))
    assert eager.gc().removed_partial == 1 and not young.exists()
    with pytest.raises(InvalidRequest, match="partial_age_s"):
        RepoConfig(partial_age_s=-1)
