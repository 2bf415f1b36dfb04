"""fsck reports every finding in one run, and repairs only what it can."""

from __future__ import annotations

import hashlib
import json
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from hapi.cli import main
from hapi.data.store import ObjectStore
from hapi.errors import InvalidRequest
from hapi.repo import ModelRepo
from hapi.repo.storage.layout import manifest_key, tensor_key
from hapi.repo.storage.tensors import encode_blob, tensor_hash


def tensors(*values: float) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((8,), v) for i, v in enumerate(values)}


def key_of(t: torch.Tensor) -> str:
    return tensor_key(tensor_hash(t))


def test_fsck_reports_every_problem_without_stopping() -> None:
    repo = ModelRepo.open(f"memory://{uuid.uuid4().hex}")
    a, b, c, d = tensors(1, 2), tensors(3, 4), tensors(5), tensors(6)
    repo.push(a, "a")
    repo.push(b, "b")
    unreadable = repo.push(c, "c")
    repo.push(d, "d")
    repo.rm("d")  # leaves d's blob unreferenced
    store = repo.store
    flipped, truncated = key_of(a["t0"]), key_of(b["t0"])
    data = store.get(flipped)
    store.put(flipped, data[:-1] + bytes([data[-1] ^ 1]))
    store.put(truncated, store.get(truncated)[:10])
    store.delete(key_of(b["t1"]))
    store.put(manifest_key(unreadable.id), b'{"format": "hapi.repo.manifest/1"')
    stray = torch.full((8,), 7.0)
    store.put(key_of(stray), encode_blob(stray)[:-4])  # corrupt, and no version needs it

    report = repo.fsck()
    assert not report.ok and not report.repaired
    assert list(report.bad_manifests) == [manifest_key(unreadable.id)]
    assert "malformed" in report.bad_manifests[manifest_key(unreadable.id)]
    assert sorted(report.corrupt) == sorted([flipped, truncated, key_of(stray)])
    assert report.missing == {key_of(b["t1"]): ["b:t1"]}
    # c's blob counts as unreferenced: its only manifest cannot be read.
    orphans = [key_of(c["t0"]), key_of(d["t0"]), key_of(stray)]
    assert sorted(report.unreferenced) == sorted(orphans)
    assert report.unreferenced_bytes == sum(store.size(k) for k in orphans)
    assert report.manifests == 2 and report.checked == 6  # a:2, b:1, c, d, stray

    repaired = repo.fsck(repair=True)
    assert repaired.repaired and sorted(repaired.corrupt) == sorted(report.corrupt)
    assert not any(store.exists(k) for k in report.corrupt)
    assert store.exists(key_of(d["t0"])) and store.exists(manifest_key(unreadable.id))

    after = repo.fsck()
    assert not after.corrupt
    assert sorted(after.unreferenced) == sorted([key_of(c["t0"]), key_of(d["t0"])])
    assert sorted(after.missing) == sorted([flipped, truncated, key_of(b["t1"])])
    repo.push(a, "a")
    repo.push(b, "b")
    store.delete(manifest_key(unreadable.id))
    clean = repo.fsck()
    assert clean.ok and sorted(clean.unreferenced) == sorted([key_of(c["t0"]), key_of(d["t0"])])


def _craft(store: ObjectStore, body: dict[str, Any]) -> str:
    """Write a manifest whose id is its true digest: crafted, yet it hashes correctly."""
    mid = hashlib.sha256(
        json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    ).hexdigest()
    store.put(manifest_key(mid), json.dumps({**body, "id": mid}).encode())
    return mid


def _hostile(store: ObjectStore, good: str) -> dict[str, str]:
    """Crafted manifests beside a good one (`good`'s id), by id -> a word its reason holds."""
    body = json.loads(store.get(manifest_key(good)))
    del body["id"]
    entry = body["tensors"][0]
    crafted = {
        _craft(store, {**body, "tensors": [{**entry, "key": "../../etc/passwd"}]}): "tensor key",
        _craft(store, {**body, "tensors": [{**entry, "hash": "../../" + "0" * 58}]}): "SHA-256",
        _craft(store, {**body, "tensors": [{**entry, "hash": "/etc/passwd"}]}): "SHA-256",
        _craft(store, {**body, "tensors": [{**entry, "shape": "4"}]}): "must be a list",
        _craft(store, {**body, "tensors": {"w": entry}}): "must be a list",
        _craft(store, {**body, "name": "../up"}): "invalid model name",
        _craft(store, {**body, "metrics": {"acc": [1]}}): "must be a number",
        _craft(store, {**body, "parent": "../x"}): "SHA-256",
    }
    not_json, not_object = "b" * 64, "c" * 64
    store.put(manifest_key(not_json), b'{"format": ')
    store.put(manifest_key(not_object), b"[1, 2]")
    return {**crafted, not_json: "malformed", not_object: "must be an object"}


def test_fsck_reports_crafted_manifests_and_checks_everything_else(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "repo"
    repo = ModelRepo.open(root, catalog=tmp_path / "catalog.sqlite")
    versions = [repo.push(tensors(i, 100 + i), f"m{i}") for i in range(8)]
    store = repo.store
    hostile = _hostile(store, versions[0].id)
    # A corrupt blob of the last version: found only if fsck goes on past the manifests.
    flipped = key_of(tensors(7, 107)["t1"])
    data = store.get(flipped)
    store.put(flipped, data[:-1] + bytes([data[-1] ^ 1]))

    report = repo.fsck()
    assert report.manifests == 8 and report.checked == 16
    assert sorted(report.bad_manifests) == sorted(manifest_key(i) for i in hostile)
    for mid, reason in hostile.items():
        assert mid[:12] in report.bad_manifests[manifest_key(mid)]
        assert reason in report.bad_manifests[manifest_key(mid)]
    assert list(report.corrupt) == [flipped] and not report.missing and not report.ok
    assert not (tmp_path / "etc").exists()

    monkeypatch.setenv("COLUMNS", "400")
    monkeypatch.setattr(
        sys, "argv", ["hapi", "repo", "fsck", "--repo", str(root), "--catalog", ":memory:"]
    )
    with pytest.raises(SystemExit) as exited:
        main()
    out = capsys.readouterr().out
    assert exited.value.code == 1
    assert all(f"unreadable manifest {manifest_key(i)}" in out for i in hostile)
    assert f"corrupt {flipped}" in out
    assert f"checked 16 tensors: 1 corrupt, 0 missing; 8 manifests read, {len(hostile)}" in out


def test_push_refuses_a_key_no_reader_would_accept() -> None:
    repo = ModelRepo.open(f"memory://{uuid.uuid4().hex}")
    for key in ("a..b", "../x", "/abs", ".lead", "", "tab\there"):
        with pytest.raises(InvalidRequest, match="invalid tensor key"):
            repo.push({key: torch.ones(2)}, "m")
    assert repo.ls() == []
