"""fsck reports every finding in one run, and repairs only what it can."""

from __future__ import annotations

import uuid

import torch

from hapi.repo import ModelRepo
from hapi.repo.layout import manifest_key, tensor_key
from hapi.repo.tensors import encode_blob, tensor_hash


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
