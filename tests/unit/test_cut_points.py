"""Cut points of real models: tail(head(x)) == model(x) bit for bit, at every cut tested."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torchvision.models import VisionTransformer
from typer.testing import CliRunner

from hapi.errors import InvalidCut, UnknownModel
from hapi.graph import INPUT, ModelSpec, build_model, profile_rows, trace


def _check(model: nn.Module, size: int, cuts: list[int] | None = None) -> int:
    model.eval()
    graph = trace(model, (3, size, size))
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        expected = model(x)
        for cut in cuts if cuts is not None else range(graph.num_cuts + 1):
            cut = cut if cut >= 0 else graph.num_cuts + 1 + cut
            features = graph.head(cut)(x)
            if cut:
                assert tuple(features.shape[1:]) == graph.cut_point(cut).shape
            assert torch.equal(graph.tail(cut)(features), expected), f"cut {cut}"
    return graph.num_cuts


def test_resnet18_every_cut_is_exact_and_named_by_block() -> None:
    model = build_model(ModelSpec(name="resnet18"))
    assert _check(model, 64) == 15
    names = [p.name for p in trace(model, (3, 64, 64)).cut_points]
    assert names[:4] == ["conv1", "bn1", "relu", "maxpool"]
    assert names[4:12] == [f"layer{i}{s}" for i in range(1, 5) for s in (".0", "")]
    assert names[-3:] == ["avgpool", "flatten", "fc"]


@pytest.mark.parametrize(
    ("name", "size", "expected_cuts"),
    [
        ("resnet50", 64, 23),
        ("vgg11", 64, 30),
        ("alexnet", 64, 22),
        ("densenet121", 64, 16),
        ("mobilenet_v3_large", 64, 36),
        ("efficientnet_b0", 64, 42),
    ],
)
def test_torchvision_models(name: str, size: int, expected_cuts: int) -> None:
    model = build_model(ModelSpec(name=name))
    assert _check(model, size, [1, expected_cuts // 2, -2, -1]) == expected_cuts


def test_densenet_cuts_are_dense_blocks_and_transitions() -> None:
    names = [p.name for p in trace(build_model(ModelSpec(name="densenet121")), (3, 64, 64)).cut_points]
    for i in range(1, 4):
        assert f"features.denseblock{i}" in names and f"features.transition{i}" in names


def test_vision_transformer_cuts_at_encoder_blocks() -> None:
    vit = VisionTransformer(
        image_size=32, patch_size=8, num_layers=3, num_heads=2, hidden_dim=16, mlp_dim=32
    )
    n = _check(vit, 32)
    names = [p.name for p in trace(vit, (3, 32, 32)).cut_points]
    assert [f"encoder.layers.encoder_layer_{i}" for i in range(3)] == [
        x for x in names if x.startswith("encoder.layers")
    ]
    assert n == len(names)


def test_efficientnet_lite0_with_its_shipped_imagenet_weights() -> None:
    model = build_model(ModelSpec(name="efficientnet_lite0", weights="imagenet"))
    # Real weights, not a random init: the stem's weights are the published ones.
    assert build_model(ModelSpec(name="efficientnet_lite0", weights="imagenet", seed=9)).state_dict()[
        "_conv_stem.weight"
    ].equal(model.state_dict()["_conv_stem.weight"])
    n = _check(model, 112, [1, 10, -2, -1])
    assert n == 25
    # The batch size the model reads off its input is recomputed by each tail.
    assert trace(model, (3, 112, 112)).cut_point(1).name == "_conv_stem"


class UserNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.block = nn.Sequential(nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(self.conv(x)) + self.conv(x)  # a skip: no cut inside
        return self.head(y.mean(dim=(2, 3)))


class Untraceable(nn.Sequential):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent control flow: torch.fx cannot trace it
            return super().forward(x)
        return super().forward(-x)


def test_user_module() -> None:
    graph = trace(UserNet(), (3, 16, 16))
    assert graph.traced
    assert [p.name for p in graph.cut_points] == ["add", "mean", "head"]
    _check(UserNet(), 16)


def test_untraceable_model_falls_back_to_children_and_says_so() -> None:
    model = Untraceable(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2))
    model(torch.ones(1, 3, 8, 8))  # materialise the lazy layer
    graph = trace(model, (3, 8, 8))
    assert not graph.traced
    assert graph.fallback_reason and "control flow" in graph.fallback_reason
    assert [p.name for p in graph.cut_points] == ["0", "1", "2", "3"]
    x = torch.rand(2, 3, 8, 8)  # positive: the branch the children run in order
    with torch.no_grad():
        for cut in range(5):
            assert torch.equal(graph.tail(cut)(graph.head(cut)(x)), model(x))


def test_freeze_from_index_name_and_requires_grad() -> None:
    model = build_model(ModelSpec(name="resnet18"))
    graph = trace(model, (3, 64, 64))
    assert graph.resolve_freeze(7) == 7
    assert graph.resolve_freeze("layer3") == 10
    assert graph.resolve_freeze("layer3.1") == 10  # alias of the same cut
    assert graph.resolve_freeze("layer2.0") == 7
    assert graph.resolve_freeze(None) == 0
    for name, p in model.named_parameters():
        if not name.startswith(("layer4", "fc")):
            p.requires_grad_(False)
    assert graph.resolve_freeze(None) == 10
    with pytest.raises(InvalidCut, match="layer3.0.conv1"):
        graph.resolve_freeze("layer3.0.conv1")
    with pytest.raises(InvalidCut, match="0..15"):
        graph.resolve_freeze(16)


def test_cuts_past_freeze_or_model_are_refused() -> None:
    graph = trace(build_model(ModelSpec(name="resnet18")), (3, 64, 64))
    graph.check_cut(INPUT, 5)
    graph.check_cut(5, 5)
    with pytest.raises(InvalidCut, match="past the freeze point 5"):
        graph.check_cut(6, 5)
    with pytest.raises(InvalidCut, match="15 cut points"):
        graph.check_cut(16, 15)


def test_tracing_leaves_modes_and_flags_alone() -> None:
    model = build_model(ModelSpec(name="resnet18")).train()
    model.layer1.requires_grad_(False)
    trace(model, (3, 32, 32))
    assert all(m.training for m in model.modules())
    assert not any(p.requires_grad for p in model.layer1.parameters())
    assert model.bn1.num_batches_tracked.item() == 0  # shape propagation ran in eval mode


def test_heads_share_the_models_parameters() -> None:
    model = build_model(ModelSpec(name="resnet18"))
    graph = trace(model, (3, 32, 32))
    head, tail = graph.head(10), graph.tail(10)
    assert head.get_submodule("conv1").weight is model.conv1.weight
    assert tail.get_submodule("fc").weight is model.fc.weight
    assert not any(n.startswith("layer4") for n, _ in head.named_parameters())
    assert {n for n, _ in graph.head_parameters(4)} == {"conv1.weight", "bn1.weight", "bn1.bias"}


def test_model_specs_build_identically_and_refuse_what_cannot_be_had() -> None:
    spec = ModelSpec(name="resnet18", seed=3, num_classes=7)
    a, b = build_model(spec).state_dict(), build_model(spec).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert a["fc.weight"].shape == (7, 512)
    assert not torch.equal(a["conv1.weight"], build_model(ModelSpec(name="resnet18")).state_dict()["conv1.weight"])
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(UnknownModel, match="resnet_nope"):
        build_model(ModelSpec(name="resnet_nope"))
    with pytest.raises(UnknownModel, match="cannot be downloaded"):
        build_model(ModelSpec(name="resnet18", weights="imagenet"))


def test_profile_rows_and_cli() -> None:
    graph = trace(build_model(ModelSpec(name="resnet18")), (3, 64, 64))
    rows = profile_rows(graph)
    assert rows[0]["cut"] == 0 and rows[0]["bytes_per_sample"] == 3 * 64 * 64 * 4
    assert rows[-1] == {
        "cut": 15, "name": "fc", "shape": [1000], "bytes_per_sample": 4000,
        "bytes_fp16": 2000, "ratio": 4000 / (3 * 64 * 64 * 4),
    }
    from hapi.cli import _register, app

    _register()
    result = CliRunner().invoke(app, ["profile", "resnet18", "--image-size", "64", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == rows
    table = CliRunner().invoke(app, ["profile", "resnet18", "--image-size", "64"])
    assert "layer3" in table.output and "traced" in table.output
