"""Freeze points and the cuts a frozen model allows."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hapi.errors import InvalidCut
from hapi.graph import INPUT, RAW, ModelGraph, ModelSpec, build_model, trace


@pytest.fixture(scope="module")
def resnet18() -> ModelGraph:
    return trace(build_model(ModelSpec(name="resnet18")), (3, 32, 32))


def test_freeze_from_an_index_or_a_module_name(resnet18: ModelGraph) -> None:
    assert resnet18.resolve_freeze(0) == 0
    assert resnet18.resolve_freeze(7) == 7
    assert resnet18.resolve_freeze("7") == 7
    assert resnet18.resolve_freeze("maxpool") == 4
    assert resnet18.resolve_freeze("layer3") == 10
    assert resnet18.resolve_freeze("layer3.1") == 10  # an alias of the same cut
    assert resnet18.resolve_freeze("layer2.0") == 7
    assert resnet18.resolve_freeze("fc") == resnet18.num_cuts


def test_freeze_that_is_not_a_cut_point_names_the_nearest(resnet18: ModelGraph) -> None:
    with pytest.raises(InvalidCut, match=r"'layer3.0.conv1'.*'layer3.0'"):
        resnet18.resolve_freeze("layer3.0.conv1")
    with pytest.raises(InvalidCut, match="avgpool"):
        resnet18.resolve_freeze("avgpol")
    with pytest.raises(InvalidCut, match=r"0\.\.15"):
        resnet18.resolve_freeze(16)
    with pytest.raises(InvalidCut, match=r"0\.\.15"):
        resnet18.resolve_freeze(-1)
    with pytest.raises(InvalidCut):
        resnet18.resolve_freeze(True)  # type: ignore[arg-type]


def test_freeze_from_requires_grad() -> None:
    model = build_model(ModelSpec(name="resnet18"))
    graph = trace(model, (3, 32, 32))
    assert graph.resolve_freeze(None) == 0
    for name, p in model.named_parameters():
        if not name.startswith(("layer4", "fc")):
            p.requires_grad_(False)
    assert graph.resolve_freeze(None) == 10
    model.fc.requires_grad_(False)
    model.layer4.requires_grad_(False)
    assert graph.resolve_freeze(None) == graph.num_cuts


def test_freeze_from_requires_grad_without_tracing() -> None:
    model = _Untraceable(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    graph = trace(model, (4,))
    assert not graph.traced and graph.num_cuts == 3
    model[0].requires_grad_(False)
    assert graph.resolve_freeze(None) == 2  # the ReLU has no parameters to train


class _Untraceable(nn.Sequential):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) if x.sum() > -1e9 else x


def test_cuts_past_the_freeze_point_or_the_model_are_refused(resnet18: ModelGraph) -> None:
    for cut in (RAW, INPUT, 1, 5):
        resnet18.check_cut(cut, 5)
    with pytest.raises(InvalidCut, match=r"past the freeze point 5.*1\.\.5"):
        resnet18.check_cut(6, 5)
    with pytest.raises(InvalidCut, match="past the model's 15 cut points"):
        resnet18.check_cut(16, 15)
    with pytest.raises(InvalidCut, match=r"RAW \(-1\), INPUT \(0\) or 1\.\.5"):
        resnet18.check_cut(-2, 5)
    with pytest.raises(InvalidCut, match=r"use RAW \(-1\) or INPUT \(0\), or freeze more"):
        resnet18.check_cut(1, 0)
