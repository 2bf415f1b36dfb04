"""Cut points of real models: tail(head(x)) == model(x) bit for bit, at every cut tested."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn
from torchvision.models import VisionTransformer

from hapi.errors import InvalidCut, InvalidRequest
from hapi.graph import INPUT, ModelGraph, ModelSpec, build_model, trace

Zoo = Callable[[str], tuple[nn.Module, ModelGraph]]


@pytest.fixture(scope="module")
def zoo() -> Iterator[Zoo]:
    """Named models, built (seeded) and traced at 64 px once for this module's tests.

    Building and tracing is most of what these tests cost; the models are used read-only.
    """
    cache: dict[str, tuple[nn.Module, ModelGraph]] = {}

    def get(name: str) -> tuple[nn.Module, ModelGraph]:
        if name not in cache:
            model = build_model(ModelSpec(name=name)).eval()
            cache[name] = (model, trace(model, (3, 64, 64)))
        return cache[name]

    yield get
    cache.clear()  # vgg11 alone holds half a gigabyte of parameters


def _roundtrip(model: nn.Module, graph: ModelGraph, cuts: list[int] | None = None) -> int:
    """Check the split at `cuts` (negative: from the end; None: all); return the cut count."""
    model.eval()
    x = torch.randn(2, *graph.input_shape)
    with torch.no_grad():
        expected = model(x)
        for cut in cuts if cuts is not None else range(graph.num_cuts + 1):
            cut = cut if cut >= 0 else graph.num_cuts + 1 + cut
            features = graph.head(cut)(x)
            if cut:
                assert tuple(features.shape[1:]) == graph.cut_point(cut).shape
            assert torch.equal(graph.tail(cut)(features), expected), f"cut {cut}"
    return graph.num_cuts


@pytest.mark.slow
def test_resnet18_every_cut_is_exact_and_named_by_block(zoo: Zoo) -> None:
    model, graph = zoo("resnet18")
    assert _roundtrip(model, graph) == 15
    assert graph.traced and graph.fallback_reason is None
    assert graph.names()[:4] == ("conv1", "bn1", "relu", "maxpool")
    assert graph.names()[4:12] == tuple(f"layer{i}{s}" for i in range(1, 5) for s in (".0", ""))
    assert graph.names()[-3:] == ("avgpool", "avgpool+flatten", "fc")  # a step: module+op
    assert graph.cut_point(6).aliases == ("layer1.1",)  # layer1 ends where its last block does


@pytest.mark.parametrize(
    ("name", "expected_cuts"),
    [
        # Seconds of parameters to initialise (25M, 133M, 61M): the fast tier keeps the
        # smaller ones, and resnet18 in test_conformance.
        pytest.param("resnet50", 23, marks=pytest.mark.slow),
        pytest.param("vgg11", 30, marks=pytest.mark.slow),
        pytest.param("alexnet", 22, marks=pytest.mark.slow),
        pytest.param("densenet121", 16, marks=pytest.mark.slow),
        pytest.param("mobilenet_v3_large", 36, marks=pytest.mark.slow),
        # EfficientNet's family is in the fast tier by efficientnet_lite0 (below).
        pytest.param("efficientnet_b0", 42, marks=pytest.mark.slow),
    ],
)
def test_torchvision_models_split_exactly(zoo: Zoo, name: str, expected_cuts: int) -> None:
    model, graph = zoo(name)
    assert _roundtrip(model, graph, [1, expected_cuts // 2, -2, -1]) == expected_cuts


def test_densenet_cuts_are_dense_blocks_and_transitions(zoo: Zoo) -> None:
    names = zoo("densenet121")[1].names()
    for i in range(1, 4):
        assert f"features.denseblock{i}" in names and f"features.transition{i}" in names
    assert not any("denselayer" in n for n in names)  # a dense layer's input flows on


def test_vision_transformer_cuts_at_encoder_blocks() -> None:
    vit = VisionTransformer(
        image_size=32, patch_size=16, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64
    )
    graph = trace(vit, (3, 32, 32))
    assert _roundtrip(vit, graph) == 8
    blocks = [p for p in graph.cut_points if p.name.startswith("encoder.layers")]
    assert [p.name for p in blocks] == [
        "encoder.layers.encoder_layer_0",
        "encoder.layers.encoder_layer_1",
    ]
    assert all(p.shape == (5, 32) for p in blocks)  # 2x2 patches + the class token
    assert graph.cut_points[-1].shape == (1000,)


@pytest.mark.slow  # vit_b_16 has 86M parameters to initialise, and takes only 224 px
def test_vit_b_16_shapes_at_224() -> None:
    graph = trace(build_model(ModelSpec(name="vit_b_16")), (3, 224, 224))
    blocks = [p for p in graph.cut_points if p.name.startswith("encoder.layers.")]
    assert len(blocks) == 12
    assert all(p.shape == (197, 768) for p in blocks)  # 14x14 patches + the class token
    assert graph.cut_points[-1].shape == (1000,)


def test_efficientnet_lite0_with_its_shipped_imagenet_weights() -> None:
    model = build_model(ModelSpec(name="efficientnet_lite0", weights="imagenet"))
    graph = trace(model, (3, 64, 64))
    assert _roundtrip(model, graph, [1, 12, -2, -1]) == 25
    assert graph.names()[:3] == ("_conv_stem", "_bn0", "_blocks.0")
    assert graph.cut_points[-1].shape == (1000,)


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


class UntraceableSkip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 3, 1)
        self.b = nn.Conv2d(3, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.b(self.a(x)) + x  # not its children in order
        return x


def test_user_module_cuts_only_where_one_tensor_flows() -> None:
    model = UserNet()
    graph = trace(model, (3, 16, 16))
    assert graph.traced
    assert graph.names() == ("conv+add", "conv+mean", "head")
    assert _roundtrip(model, graph) == 3


def test_untraceable_model_falls_back_to_children_and_says_so() -> None:
    model = Untraceable(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(144, 2))
    graph = trace(model, (3, 8, 8))
    assert not graph.traced
    assert graph.fallback_reason and "control flow" in graph.fallback_reason
    assert graph.names() == ("0", "1", "2", "3")
    assert graph.cut_point(3).shape == (144,)
    assert isinstance(graph.head(2), nn.Sequential) and isinstance(graph.tail(2), nn.Sequential)
    x = torch.rand(2, 3, 8, 8)  # positive: the branch that runs the children in order
    with torch.no_grad():
        for cut in range(5):
            assert torch.equal(graph.tail(cut)(graph.head(cut)(x)), model(x))


def test_untraceable_model_whose_children_are_not_its_forward_has_no_cuts() -> None:
    graph = trace(UntraceableSkip(), (3, 4, 4))
    assert not graph.traced and graph.num_cuts == 0
    assert graph.fallback_reason and "no cut points" in graph.fallback_reason
    assert graph.tail(INPUT) is graph.model
    with pytest.raises(InvalidCut):
        graph.head(1)


def test_an_input_the_model_cannot_take_is_a_clear_error() -> None:
    with pytest.raises(InvalidRequest, match=r"shape \(1, 1, 16, 16\)"):
        trace(UserNet(), (1, 16, 16))
    with pytest.raises(InvalidRequest, match="positive ints"):
        trace(UserNet(), (3, 0, 16))


def test_cut_point_sizes_and_head_parameters(zoo: Zoo) -> None:
    model, graph = zoo("resnet18")
    layer1 = graph.cut_point(5)
    assert layer1.shape == (64, 16, 16)
    assert layer1.numel == 64 * 16 * 16 and layer1.bytes_per_sample == 4 * layer1.numel
    assert graph.input_bytes_per_sample == 4 * 3 * 64 * 64
    counts = [p.params_before for p in graph.cut_points]
    assert counts == sorted(counts)
    assert counts[-1] == sum(p.numel() for p in model.parameters())
    assert counts[0] == model.conv1.weight.numel()
    assert {n for n, _ in graph.head_parameters(4)} == {"conv1.weight", "bn1.weight", "bn1.bias"}
    assert not list(graph.head_parameters(INPUT))


def test_tracing_leaves_modes_flags_and_rng_alone() -> None:
    model = build_model(ModelSpec(name="resnet18")).train()
    model.layer1.requires_grad_(False)
    untraceable = UntraceableSkip()  # its init draws from the RNG; tracing must not
    state = torch.get_rng_state()
    trace(model, (3, 32, 32))
    trace(untraceable, (3, 4, 4))
    assert torch.equal(torch.get_rng_state(), state)
    assert all(m.training for m in model.modules())
    assert not any(p.requires_grad for p in model.layer1.parameters())
    assert all(p.requires_grad for p in model.layer2.parameters())
    assert model.bn1.num_batches_tracked.item() == 0  # shapes were propagated in eval mode


def test_heads_and_tails_share_the_models_parameters(zoo: Zoo) -> None:
    model, graph = zoo("resnet18")
    head, tail = graph.head(10), graph.tail(10)
    assert head.get_submodule("conv1").weight is model.conv1.weight
    assert tail.get_submodule("fc").weight is model.fc.weight
    assert not any(n.startswith(("layer4", "fc")) for n, _ in head.named_parameters())
    assert not any(n.startswith(("conv1", "layer1")) for n, _ in tail.named_parameters())


def test_training_a_tail_trains_the_users_model() -> None:
    model = UserNet()
    graph = trace(model, (3, 8, 8))
    tail = graph.tail(2).train()
    before = model.head.weight.detach().clone()
    optimizer = torch.optim.SGD(tail.parameters(), lr=0.1)
    features = graph.head(2)(torch.randn(4, 3, 8, 8)).detach()
    tail(features).sum().backward()
    optimizer.step()
    assert not torch.equal(model.head.weight, before)
