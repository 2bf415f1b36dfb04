"""Heads from the repository: only the head's tensors are read, and equal heads share a key."""

from __future__ import annotations

import functools
import uuid

import pytest
import torch
from torch import nn

from hapi.errors import IntegrityError, InvalidCut, InvalidRequest
from hapi.graph import ModelSpec, build_model, trace
from hapi.repo import ModelRepo

SPEC = ModelSpec(name="resnet18", num_classes=10)
SHAPE = (3, 64, 64)


class CountingRepo:
    """Counts the tensor blobs the repository reads, at the store boundary."""

    def __init__(self, repo: ModelRepo) -> None:
        self.reads: list[str] = []
        store = repo.store
        original = store.get_many

        def get_many(keys):  # type: ignore[no-untyped-def]
            keys = list(keys)
            self.reads.extend(k for k in keys if k.startswith("tensors/"))
            return original(keys)

        store.get_many = get_many  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def models() -> tuple[nn.Module, nn.Module]:
    base = build_model(SPEC)
    derived = build_model(SPEC)
    with torch.no_grad():
        for name, p in derived.named_parameters():
            if name.startswith(("layer4", "fc")):
                p.add_(0.01)
    return base, derived


@pytest.fixture(scope="module")
def repo(models: tuple[nn.Module, nn.Module]) -> ModelRepo:
    """The tests only read it: one per module (each push hashes a ResNet's weights)."""
    repo = ModelRepo.open(f"memory://{uuid.uuid4().hex}")
    base, derived = models
    repo.push(base, "base", spec=SPEC)
    repo.push(derived, "derived", parent="base", spec=SPEC)
    return repo


@functools.cache
def cut_before_layer4() -> int:
    graph = trace(build_model(SPEC), SHAPE)
    return next(p.index for p in graph.cut_points if p.name == "layer3")


def test_head_matches_the_model_and_reads_only_its_tensors(
    repo: ModelRepo, models: tuple[nn.Module, nn.Module]
) -> None:
    cut = cut_before_layer4()
    counter = CountingRepo(repo)
    head, info = repo.load_head("derived", cut, input_shape=SHAPE)
    assert info.cut_name == "layer3" and info.ref == "derived@1"
    assert all(not k.startswith(("layer4", "fc")) for k in info.keys)
    assert len(counter.reads) == len(set(info.hashes.values()))
    manifest = repo.manifest("derived")
    assert info.nbytes < manifest.nbytes / 3  # layer4 holds most of a ResNet's weights
    x = torch.randn(2, *SHAPE)
    expected = trace(models[1], SHAPE).head(cut)(x)
    assert torch.allclose(head(x), expected, atol=1e-5)
    assert not head.training and not any(p.requires_grad for p in head.parameters())
    pulled = repo.pull("derived", cut=cut, input_shape=SHAPE)
    assert list(pulled) == list(info.keys)


def test_models_derived_from_one_base_share_heads_below_their_changes(repo: ModelRepo) -> None:
    cut = cut_before_layer4()
    below = [repo.head_info(r, cut, input_shape=SHAPE) for r in ("base", "derived")]
    assert below[0].cache_key == below[1].cache_key and below[0].id != below[1].id
    above = [repo.head_info(r, cut + 1, input_shape=SHAPE) for r in ("base", "derived")]
    assert above[0].cache_key != above[1].cache_key


def test_a_version_without_spec_needs_a_skeleton(models: tuple[nn.Module, nn.Module]) -> None:
    repo = ModelRepo.open(f"memory://{uuid.uuid4().hex}")
    repo.push(models[0], "bare")
    with pytest.raises(InvalidRequest, match="without a model spec"):
        repo.load_head("bare", 3, input_shape=SHAPE)
    skeleton = build_model(ModelSpec(name="resnet18", num_classes=10, seed=5))
    head, _ = repo.load_head("bare", 3, model=skeleton, input_shape=SHAPE)
    assert torch.equal(head.state_dict()["conv1.weight"], models[0].state_dict()["conv1.weight"])
    with pytest.raises(IntegrityError, match="does not match its architecture"):
        # resnet34's layer1 has a third block that resnet18 lacks.
        repo.load_head("bare", 7, model=build_model(ModelSpec(name="resnet34")), input_shape=SHAPE)
    with pytest.raises(InvalidCut):
        repo.load_head("bare", 99, model=skeleton, input_shape=SHAPE)
