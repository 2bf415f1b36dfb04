"""The conformance matrix: models hapi must split and train exactly.

Torchvision families, timm models and Hugging Face models built from configs (random init,
nothing downloaded), and user modules with skip connections, Python control flow on shapes
and dropout. For each:

- cut points are found (by torch.fx, or torch.export where fx cannot trace);
- in eval mode, `tail(head(x))` equals the model's output bit for bit at every cut, also
  with the activation sent through the wire's encoding;
- in train mode, the tail (with the head frozen in eval mode) computes exactly what the
  original model does from the same RNG state: outputs, gradients and batch-norm statistics,
  at the input cut and at a cut in the middle.

Each model is built and traced once per module (the `traced` fixture) at 32-64 px. The
fast tier (`-m "not slow"`) keeps a torchvision CNN and ViT and the user modules torch.fx
traces; the full matrix runs in CI. timm models, Hugging Face models and `user_shape_flow`
(traced by torch.export) are CI's alone: importing timm or transformers and tracing by
torch.export cost seconds each.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hapi.graph import ModelGraph, ModelSpec, build_model, trace

from ..graph_checks import NoisyAux, split_exactly, train_step_both_ways


@dataclass(frozen=True)
class Case:
    build: Callable[[], nn.Module]
    size: int
    blocks: tuple[str, ...]
    """Some of the cut points it must have: its blocks."""
    method: str = "fx"
    fast: bool = False
    """In the fast tier: one model of each kind is, the rest are marked slow."""


def _tv(name: str, **kwargs: object) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        if not kwargs:
            return build_model(ModelSpec(name=name))
        from torchvision import models

        return models.get_model(name, weights=None, **kwargs)

    return build


def _tv_vit() -> nn.Module:
    from torchvision.models import VisionTransformer

    return VisionTransformer(
        image_size=32,
        patch_size=8,
        num_layers=2,
        num_heads=2,
        hidden_dim=32,
        mlp_dim=64,
        dropout=0.1,
        attention_dropout=0.1,
    )


def _timm(name: str, **kwargs: object) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        timm = pytest.importorskip("timm")
        return timm.create_model(name, num_classes=5, **kwargs)

    return build


def _hf(model: str, config: str, **kwargs: object) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        transformers = pytest.importorskip("transformers")
        cfg = getattr(transformers, config)(num_labels=5, **kwargs)
        return getattr(transformers, model)(cfg)

    return build


class SkipNet(nn.Module):
    """Residual blocks written by hand: no cut inside a block, one after each."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
            for _ in range(3)
        )
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x)
        return self.fc(x.mean(dim=(2, 3)))


class ShapeFlow(nn.Module):
    """Python control flow on shapes: a loop over channel groups torch.fx cannot unroll."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.mix = nn.Conv2d(8, 8, 1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        if x.shape[-1] > 8:
            x = F.avg_pool2d(x, 2)
        groups = [x[:, i : i + 2] * (i + 1) for i in range(0, int(x.shape[1]), 2)]
        x = self.mix(torch.cat(groups, dim=1))
        x = F.dropout(x.mean(dim=(2, 3)), p=0.3, training=self.training)
        return self.fc(x)


class DropoutNet(nn.Module):
    """Functional dropout in the forward, a dropout module and batch norm."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout2d(0.2)
        )
        self.fc = nn.Linear(8 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.adaptive_avg_pool2d(self.features(x), 4).flatten(1)
        return self.fc(F.dropout(x, p=0.5, training=self.training))


class TupleNet(nn.Module):
    """Returns (logits, features), as models with an auxiliary output do: logits are trained."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = self.features(x).mean(dim=(2, 3))
        return self.fc(F.dropout(pooled, p=0.2, training=self.training)), pooled


CASES: dict[str, Case] = {
    # torchvision: fourteen families (vgg11 last: 133M parameters to initialise)
    "resnet18": Case(
        _tv("resnet18"), 32, ("layer1.0", "layer1", "layer4", "avgpool+flatten"), fast=True
    ),
    "mobilenet_v2": Case(_tv("mobilenet_v2"), 32, ("features.1", "features.17", "features")),
    "mobilenet_v3_small": Case(_tv("mobilenet_v3_small"), 32, ("features.1", "features.11")),
    "efficientnet_b0": Case(_tv("efficientnet_b0"), 32, ("features.1", "features.7", "avgpool")),
    "regnet_x_400mf": Case(_tv("regnet_x_400mf"), 32, ("stem", "trunk_output.block1")),
    "convnext_tiny": Case(_tv("convnext_tiny"), 32, ("features.1.0", "features.6", "avgpool")),
    "swin_t": Case(_tv("swin_t"), 32, ("features.1", "features.5.3", "avgpool")),
    "vit": Case(_tv_vit, 32, ("encoder.layers.encoder_layer_0", "encoder+getitem"), fast=True),
    "shufflenet_v2_x0_5": Case(_tv("shufflenet_v2_x0_5"), 32, ("stage2.0", "stage4")),
    "squeezenet1_1": Case(_tv("squeezenet1_1"), 32, ("features.3", "features")),
    "mnasnet0_5": Case(_tv("mnasnet0_5"), 32, ("layers.8", "layers+mean")),
    "googlenet": Case(
        _tv("googlenet", aux_logits=False, init_weights=True), 32, ("inception3a", "inception5b")
    ),
    "densenet121": Case(_tv("densenet121"), 32, ("features.denseblock1", "features.transition3")),
    # timm
    "timm_vit_tiny": Case(
        _timm(
            "vit_tiny_patch16_224",
            img_size=32,
            patch_size=8,
            depth=3,
            drop_rate=0.1,
            drop_path_rate=0.2,
        ),
        32,
        ("blocks.0", "blocks.1", "blocks"),
    ),
    "timm_convnext_atto": Case(
        _timm("convnext_atto", drop_path_rate=0.2), 64, ("stages.0", "stages.2.blocks.0")
    ),
    "timm_mobilenetv3": Case(
        _timm("mobilenetv3_small_050", drop_rate=0.2, drop_path_rate=0.1), 64, ("blocks.1",)
    ),
    # Hugging Face, from configs: torch.fx cannot trace them; torch.export can
    "hf_vit": Case(
        _hf(
            "ViTForImageClassification",
            "ViTConfig",
            image_size=32,
            patch_size=8,
            hidden_size=32,
            num_hidden_layers=3,
            num_attention_heads=2,
            intermediate_size=64,
            hidden_dropout_prob=0.1,
            attention_probs_dropout_prob=0.1,
        ),
        32,
        ("vit.layers.0", "vit.layers.1", "vit.layers.2"),
        "export",
    ),
    "hf_resnet": Case(
        _hf(
            "ResNetForImageClassification",
            "ResNetConfig",
            embedding_size=8,
            hidden_sizes=[8, 16],
            depths=[1, 1],
        ),
        32,
        ("resnet.encoder.stages.0", "resnet.encoder.stages.1"),
        "export",
    ),
    "hf_convnext": Case(
        _hf(
            "ConvNextForImageClassification",
            "ConvNextConfig",
            num_stages=2,
            hidden_sizes=[8, 16],
            depths=[1, 1],
            drop_path_rate=0.2,
        ),
        32,
        ("convnext.encoder.stages.0", "convnext.encoder.stages.1"),
        "export",
    ),
    "hf_swin": Case(
        _hf(
            "SwinForImageClassification",
            "SwinConfig",
            image_size=32,
            patch_size=4,
            embed_dim=16,
            depths=[1, 1],
            num_heads=[2, 2],
            window_size=4,
            drop_path_rate=0.2,
        ),
        32,
        ("swin.encoder.layers.0", "swin.encoder.layers.1"),
        "export",
    ),
    # user modules
    "user_skip": Case(SkipNet, 16, ("stem", "blocks.0+add", "blocks.2+add"), fast=True),
    "user_shape_flow": Case(ShapeFlow, 16, ("stem", "mix"), "export"),
    "user_dropout": Case(DropoutNet, 16, ("features", "features+flatten"), fast=True),
    "user_tuple_output": Case(TupleNet, 16, ("features", "features+mean", "fc"), fast=True),
    "user_training_branches": Case(NoisyAux, 16, ("stem", "body"), fast=True),
    "vgg11": Case(_tv("vgg11"), 32, ("features.3", "classifier.3")),
}


@pytest.fixture(scope="module")
def traced() -> Iterator[Callable[[str], tuple[nn.Module, ModelGraph]]]:
    cache: dict[str, tuple[nn.Module, ModelGraph]] = {}

    def get(name: str) -> tuple[nn.Module, ModelGraph]:
        if name not in cache:
            case = CASES[name]
            torch.manual_seed(0)
            model = case.build().eval()
            cache[name] = (model, trace(model, (3, case.size, case.size)))
        return cache[name]

    yield get
    cache.clear()


NAMES = [
    name if case.fast else pytest.param(name, marks=pytest.mark.slow)
    for name, case in CASES.items()
]


@pytest.mark.parametrize("name", NAMES)
def test_cut_points_are_found(
    traced: Callable[[str], tuple[nn.Module, ModelGraph]], name: str
) -> None:
    _, graph = traced(name)
    case = CASES[name]
    assert graph.traced and graph.method == case.method, graph.notes
    assert set(case.blocks) <= set(graph.names()), graph.names()
    assert len(set(graph.names())) == graph.num_cuts


@pytest.mark.parametrize("name", NAMES)
def test_every_cut_is_exact_also_through_the_wire(
    traced: Callable[[str], tuple[nn.Module, ModelGraph]], name: str
) -> None:
    model, graph = traced(name)
    split_exactly(model, graph)


@pytest.mark.parametrize("where", ["input", "mid"])
@pytest.mark.parametrize("name", NAMES)
def test_the_tail_trains_exactly_the_original(
    traced: Callable[[str], tuple[nn.Module, ModelGraph]], name: str, where: str
) -> None:
    model, graph = traced(name)
    cut = 0 if where == "input" else graph.num_cuts // 2
    try:
        train_step_both_ways(model, graph, cut, seed=3)
    finally:
        model.eval().requires_grad_(True)
