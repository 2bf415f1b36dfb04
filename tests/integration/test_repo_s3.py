"""The model repository on a real SeaweedFS S3 server."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hapi.data import StoreOptions
from hapi.errors import IntegrityError, RefNotFound
from hapi.graph import ModelSpec, build_model, trace
from hapi.repo import ModelRepo
from hapi.repo.storage.layout import tensor_key

pytestmark = pytest.mark.s3

SPEC = ModelSpec(name="resnet18", num_classes=4)
SHAPE = (3, 32, 32)


def test_repository_on_seaweedfs(s3_bucket: tuple[str, StoreOptions], tmp_path) -> None:  # type: ignore[no-untyped-def]
    uri, options = s3_bucket
    repo = ModelRepo.open(uri, options, catalog=tmp_path / "a.sqlite")
    base = build_model(SPEC)
    first = repo.push(base, "base", spec=SPEC)
    derived = build_model(SPEC)
    with torch.no_grad():
        derived.fc.weight.add_(1.0)
    second = repo.push(derived, "ft", parent="base", spec=SPEC, metrics={"acc": 0.9})
    assert second.uploaded_tensors == 1 and second.uploaded_bytes < first.uploaded_bytes / 100

    # Another process's view: a fresh catalog, synced from the bucket alone.
    other = ModelRepo.open(uri, options, catalog=tmp_path / "b.sqlite")
    assert [v.ref for v in other.descendants("base")] == ["ft@1"]
    pulled = other.pull("repo://ft@1")
    assert all(torch.equal(pulled[k], v) for k, v in derived.state_dict().items())
    head, info = other.load_head("ft", 4, input_shape=SHAPE)
    x = torch.randn(2, *SHAPE)
    assert torch.allclose(head(x), trace(derived, SHAPE).head(4)(x), atol=1e-5)
    assert info.cache_key == other.head_info("base", 4, input_shape=SHAPE).cache_key

    # A corrupted blob is named on load.
    key = tensor_key(info.hashes["conv1.weight"])
    repo.store.put(key, repo.store.get(key)[:-8])
    with pytest.raises(IntegrityError, match="'conv1.weight' of base@1"):
        other.pull("base")
    assert list(other.fsck(repair=True).corrupt) == [key]
    repo.push(base, "base", spec=SPEC)

    other.rm("ft")
    report = repo.gc()
    assert report.removed_blobs == 1 and report.manifests == 2
    with pytest.raises(RefNotFound, match="did you mean base"):
        repo.pull("bas")
    assert repo.reindex() == 2
    model = nn.Module()
    with pytest.raises(IntegrityError, match="missing from base@2"):
        repo.load_into(model.add_module("w", nn.Linear(1, 1)) or model, "base")
