"""The tail trains the user's model: dropout, drop-path, stochastic depth, drop-connect and
batch-norm statistics behave in the tail exactly as in the original model.

Each check runs one training step both ways from the same RNG state: the original model in
train mode with its frozen part in eval mode (as `TransferJob` runs it), and the head (eval,
no grad, as on the server) followed by the tail in train mode. Outputs, gradients and
batch-norm statistics must be equal bit for bit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hapi.graph import ModelGraph, ModelSpec, build_model, model_output, trace

from ..graph_checks import NoisyAux, split_exactly, train_step_both_ways


class Noisy(nn.Module):
    """Adds noise in training only: a Python branch on `self.training`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            return x + 0.5 * torch.randn_like(x)
        return x


class DropoutNet(nn.Module):
    """Batch norm, a branching submodule, and functional dropout in the root's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.noisy = Noisy()
        self.body = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.body(self.noisy(self.stem(x)))
        x = F.dropout(x.mean(dim=(2, 3)), p=0.5, training=self.training)
        return self.fc(x)


class RootBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc(x)
        if self.training:
            x = x * 2
        return x


def _timm_vit() -> nn.Module:
    timm = pytest.importorskip("timm")
    return timm.create_model(
        "vit_tiny_patch16_224",
        img_size=32,
        patch_size=8,
        depth=3,
        num_classes=5,
        drop_rate=0.2,
        drop_path_rate=0.3,
        attn_drop_rate=0.1,
    )


def _hf_vit() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=5,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )
    return transformers.ViTForImageClassification(config)


MODELS: dict[str, tuple[Callable[[], nn.Module], int]] = {
    "user": (DropoutNet, 16),
    "timm_vit_drop_path": (_timm_vit, 32),
    "efficientnet_lite0": (lambda: build_model(ModelSpec(name="efficientnet_lite0")), 32),
    "efficientnet_b0": (lambda: build_model(ModelSpec(name="efficientnet_b0")), 64),
    "hf_vit_dropout": (_hf_vit, 32),  # traced with torch.export
}


@pytest.fixture(scope="module")
def traced() -> Iterator[Callable[[str], tuple[nn.Module, ModelGraph]]]:
    cache: dict[str, tuple[nn.Module, ModelGraph]] = {}

    def get(name: str) -> tuple[nn.Module, ModelGraph]:
        if name not in cache:
            build, size = MODELS[name]
            torch.manual_seed(0)
            model = build()
            cache[name] = (model, trace(model, (3, size, size)))
        return cache[name]

    yield get
    cache.clear()


def _mid(graph: ModelGraph) -> int:
    return graph.num_cuts // 2


# The ViT traced by torch.export takes seconds, and torchvision's EfficientNet-B0 a second
# a check: the edit loop's tier keeps the others (EfficientNet-Lite0 among them).
_SLOW = {"hf_vit_dropout", "efficientnet_b0"}
_MODELS = [pytest.param(n, marks=pytest.mark.slow) if n in _SLOW else n for n in MODELS]


@pytest.mark.parametrize("name", _MODELS)
@pytest.mark.parametrize("where", ["input", "mid"])
def test_tail_trains_exactly_the_original(
    traced: Callable[[str], tuple[nn.Module, ModelGraph]], name: str, where: str
) -> None:
    model, graph = traced(name)
    cut = 0 if where == "input" else _mid(graph)
    train_step_both_ways(model, graph, cut, seed=1)


@pytest.mark.parametrize("name", _MODELS)
def test_the_tail_is_stochastic_in_train_mode_and_not_in_eval(
    traced: Callable[[str], tuple[nn.Module, ModelGraph]], name: str
) -> None:
    model, graph = traced(name)
    tail = graph.tail(0)
    x = torch.randn(4, *graph.input_shape)
    outs = []
    with torch.no_grad():
        for seed in (1, 2):
            torch.manual_seed(seed)
            outs.append(tail.train()(x))
        assert not torch.equal(outs[0], outs[1])  # the randomness is live, not traced away
        tail.eval()
        assert torch.equal(tail(x), tail(x))
        assert torch.equal(tail(x), model_output(model.eval()(x)))


def test_batch_norm_statistics_update_in_the_trainable_part_only(
    traced: Callable[[str], tuple[nn.Module, ModelGraph]],
) -> None:
    model, graph = traced("user")
    cut = graph.resolve_freeze("noisy")
    model.train()
    frozen = graph.head(cut).eval()
    stem_bn, body_bn = model.stem[1], model.body[1]
    before = stem_bn.running_mean.clone(), body_bn.running_mean.clone()
    with torch.no_grad():
        graph.tail(cut).train()(frozen(torch.randn(4, 3, 16, 16)))
    assert torch.equal(stem_bn.running_mean, before[0])
    assert not torch.equal(body_bn.running_mean, before[1])


@pytest.fixture(scope="module")
def noisy_aux() -> tuple[nn.Module, ModelGraph]:
    torch.manual_seed(0)
    model = NoisyAux()
    return model, trace(model, (3, 8, 8))


def test_a_root_branching_on_training_is_traced_in_both_modes(
    noisy_aux: tuple[nn.Module, ModelGraph], caplog: pytest.LogCaptureFixture
) -> None:
    model = NoisyAux()
    with caplog.at_level(logging.WARNING, logger="hapi.graph"):
        graph = trace(model, (3, 8, 8))
    assert not caplog.records  # the warning that the branch was lost is gone
    # `fc` ends where one tensor flows in eval mode only: in training the auxiliary head
    # reads the pooled features too, so it is no cut point.
    assert graph.names() == noisy_aux[1].names()
    assert graph.names()[-2:] == ("body", "body+mean") and graph.method == "fx"
    assert "traced in train and in eval mode" in graph.notes[0]
    assert "From cut 7 (body+mean) on" in graph.notes[0] and "randn_like" in graph.notes[0]
    split_exactly(model, graph)


@pytest.mark.parametrize("cut", ["input", "stem", "body.0", "body"])
def test_a_tail_trains_the_training_only_branches_as_the_original(
    noisy_aux: tuple[nn.Module, ModelGraph], cut: str
) -> None:
    model, graph = noisy_aux
    # Equal outputs (the seeded noise and the auxiliary head), gradients (the auxiliary
    # head's too) and batch-norm statistics, bit for bit.
    train_step_both_ways(model, graph, graph.resolve_cut(cut), seed=3)


def test_the_tail_switches_graphs_with_its_mode_and_holds_both_from_the_start(
    noisy_aux: tuple[nn.Module, ModelGraph],
) -> None:
    model, graph = noisy_aux
    cut = graph.resolve_cut("body")
    tail = graph.tail(cut)
    keys = set(tail.state_dict())
    assert {"aux.weight", "fc.weight"} <= keys  # an optimizer made now holds the aux head
    assert any(p is model.aux.weight for p in tail.parameters())
    x = torch.randn(4, 3, 8, 8)
    with torch.no_grad():
        features = graph.head(cut).eval()(x)
        for _ in range(2):  # back and forth
            torch.manual_seed(5)
            trained = tail.train()(features)
            model.train()
            for module in (model.stem, model.body):
                module.eval()
            torch.manual_seed(5)
            assert torch.equal(trained, model(x))
            assert torch.equal(tail.eval()(features), model.eval()(x))
    assert set(tail.state_dict()) == keys


def test_a_root_branch_after_the_last_module_runs_in_the_tail() -> None:
    model = RootBranch()
    graph = trace(model, (4,))
    x = torch.randn(3, 4)
    with torch.no_grad():
        features = graph.head(1)(x)
        for cut, given in ((0, x), (1, features)):
            assert torch.equal(graph.tail(cut).train()(given), model.train()(x))
            assert torch.equal(graph.tail(cut).eval()(given), model.eval()(x))


@pytest.mark.slow
def test_an_exported_tail_moved_with_to_updates_the_models_own_statistics() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3
    )
    model = transformers.ResNetForImageClassification(config)
    graph = trace(model, (3, 32, 32))
    assert graph.method == "export"
    tail = graph.tail(1).to(torch.float64)  # as a trainer moves its tail to its device
    name = next(n for n, _ in model.named_buffers() if "stages.1" in n and "running_mean" in n)
    assert model.get_buffer(name).dtype == torch.float64
    assert tail.get_buffer(name) is model.get_buffer(name)
    features = graph.head(1).eval()(torch.randn(4, 3, 32, 32, dtype=torch.float64))
    before = {n: b.clone() for n, b in model.named_buffers() if n.endswith("running_mean")}
    with torch.no_grad():
        tail.train()(features.detach())
    changed = [n for n, b in before.items() if not torch.equal(model.get_buffer(n), b)]
    assert changed and all(n.startswith("resnet.encoder.stages.1") for n in changed)
