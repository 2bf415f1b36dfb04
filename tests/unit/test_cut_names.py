"""Cut names a person can use: after the module a cut follows, or the module before a step
and the step taken; the same in every run; accepted wherever a cut or freeze is given."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchvision.models import VisionTransformer

from hapi.errors import InvalidCut
from hapi.graph import INPUT, RAW, ModelSpec, build_model, trace


def _vit() -> nn.Module:
    torch.manual_seed(0)
    return VisionTransformer(
        image_size=32, patch_size=16, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64
    )


class SkipNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x) + x.mean(dim=1, keepdim=True)
        return self.fc(y.mean(dim=(2, 3)))


def test_a_step_after_a_module_is_named_by_both() -> None:
    graph = trace(build_model(ModelSpec(name="resnet18")), (3, 32, 32))
    assert graph.names()[-3:] == ("avgpool", "avgpool+flatten", "fc")
    assert graph.cut_point(14).aliases == ("flatten",)  # the graph node's name still works
    names = trace(SkipNet(), (3, 8, 8)).names()
    assert names == ("conv+add", "conv+mean", "fc")


def test_the_class_token_of_a_vit_is_named_after_the_encoder() -> None:
    graph = trace(_vit(), (3, 32, 32))
    token = graph.resolve_cut("encoder+getitem")
    assert graph.cut_point(token).shape == (32,)
    assert graph.cut_point(token - 1).name == "encoder"
    assert graph.cut_point(token + 1).name == "heads"


def test_names_are_the_same_in_every_trace() -> None:
    first, second = trace(_vit(), (3, 32, 32)), trace(_vit(), (3, 32, 32))
    assert first.names() == second.names()
    assert [p.aliases for p in first.cut_points] == [p.aliases for p in second.cut_points]


def test_resolve_cut_takes_indices_names_aliases_raw_and_input() -> None:
    graph = trace(build_model(ModelSpec(name="resnet18")), (3, 32, 32))
    assert graph.resolve_cut(RAW) == RAW and graph.resolve_cut("raw") == RAW
    assert graph.resolve_cut("input") == INPUT and graph.resolve_cut("0") == INPUT
    assert graph.resolve_cut("layer3") == graph.resolve_cut("layer3.1") == 10
    assert graph.resolve_cut("avgpool+flatten") == graph.resolve_cut("flatten") == 14
    assert graph.resolve_freeze("avgpool+flatten") == 14
    assert graph.resolve_freeze("input") == INPUT
    with pytest.raises(InvalidCut, match=r"'layer3\.0\.conv1'.*'layer3\.0'"):
        graph.resolve_cut("layer3.0.conv1")
    with pytest.raises(InvalidCut, match=r"RAW \(-1\), INPUT \(0\) or 1\.\.15"):
        graph.resolve_cut(16)
    with pytest.raises(InvalidCut, match="freeze cannot be 'raw'"):
        graph.resolve_freeze("raw")
    with pytest.raises(InvalidCut):
        graph.resolve_cut(True)  # type: ignore[arg-type]


def test_timm_vit_is_cut_between_its_blocks() -> None:
    timm = pytest.importorskip("timm")
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=3)
    graph = trace(model.eval(), (3, 32, 32))
    # Its forward's optional attn_mask and is_causal are constants, not values flowing on.
    blocks = [n for n in graph.names() if n.startswith("blocks")]
    assert blocks == ["blocks.0", "blocks.1", "blocks"]
    assert graph.resolve_cut("blocks.2") == graph.resolve_cut("blocks")
