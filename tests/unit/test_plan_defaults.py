"""The default freeze point, and refusing a freeze that leaves nothing to train."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from hapi.errors import InvalidCut
from hapi.graph import INPUT, ModelGraph, ModelSpec, build_model, trace
from hapi.plan import check_trainable, choose_freeze, default_freeze


@pytest.fixture(scope="module")
def resnet18() -> ModelGraph:
    return trace(build_model(ModelSpec(name="resnet18")), (3, 32, 32))


class _Net(nn.Module):
    """A user's model whose forward ends in a functional op after the classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv(x)))
        return F.log_softmax(self.head(torch.flatten(x, 1)), dim=1)


def test_resnet18_defaults_to_everything_but_fc(resnet18: ModelGraph) -> None:
    choice = default_freeze(resnet18)
    point = resnet18.cut_point(choice.freeze)
    assert "flatten" in (point.name, *point.aliases)
    assert resnet18.cut_point(choice.freeze + 1).name == "fc"
    assert resnet18.resolve_freeze("flatten") == choice.freeze
    assert "'fc'" in choice.reason and "513,000 parameters train" in choice.reason


def test_a_user_module_defaults_to_before_its_classifier() -> None:
    graph = trace(_Net(), (3, 16, 16))
    freeze, reason = default_freeze(graph)
    assert graph.cut_point(freeze + 1).name == "head"
    assert "'head'" in reason
    seq = trace(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), (8,))
    assert default_freeze(seq).freeze == 2  # the ReLU; only the last Linear trains


def test_a_model_with_one_layer_trains_it_all() -> None:
    graph = trace(nn.Sequential(nn.Linear(8, 4), nn.ReLU()), (8,))
    assert default_freeze(graph).freeze == INPUT


def test_a_model_without_parameters_has_no_default() -> None:
    graph = trace(nn.Sequential(nn.ReLU(), nn.Flatten()), (4, 2))
    with pytest.raises(InvalidCut, match="no parameters to train"):
        default_freeze(graph)


def test_choose_freeze_prefers_the_user_then_requires_grad(resnet18: ModelGraph) -> None:
    assert choose_freeze(resnet18, None).freeze == resnet18.num_cuts - 1
    assert choose_freeze(resnet18, "layer3") == (10, "freeze=10 (layer3), as given")
    model = build_model(ModelSpec(name="resnet18"))
    graph = trace(model, (3, 32, 32))
    for name, p in model.named_parameters():
        if not name.startswith(("layer4", "fc")):
            p.requires_grad_(False)
    choice = choose_freeze(graph, None)
    assert choice.freeze == 10 and "do not require gradients" in choice.reason


def test_a_freeze_that_leaves_nothing_to_train_is_refused(resnet18: ModelGraph) -> None:
    with pytest.raises(InvalidCut, match=r"freeze=15 \(fc\) leaves nothing to train.*freeze=14"):
        check_trainable(resnet18, resnet18.num_cuts)
    with pytest.raises(InvalidCut, match="nothing to train"):
        choose_freeze(resnet18, "fc")
    check_trainable(resnet18, resnet18.num_cuts - 1)  # fc trains


def test_frozen_parameters_after_the_freeze_are_refused_too() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    graph = trace(model, (8,))
    model[2].requires_grad_(False)
    with pytest.raises(InvalidCut, match="requires_grad=False"):
        check_trainable(graph, 2)
