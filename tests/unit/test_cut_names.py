"""Cut names a person can use: after the module a cut follows, or the module before a step
and the step taken; the same in every run; accepted wherever a cut or freeze is given."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn
from torchvision.models import VisionTransformer

from hapi.errors import InvalidCut, InvalidRequest
from hapi.graph import INPUT, RAW, Cut, ModelGraph, ModelSpec, build_model, trace


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


@pytest.fixture(scope="module")
def resnet18() -> ModelGraph:
    """Read only: names and cuts."""
    return trace(build_model(ModelSpec(name="resnet18")), (3, 32, 32))


def test_a_step_after_a_module_is_named_by_both(resnet18: ModelGraph) -> None:
    graph = resnet18
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


def test_resolve_cut_takes_indices_names_aliases_raw_and_input(resnet18: ModelGraph) -> None:
    graph = resnet18
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


@pytest.mark.slow  # importing timm takes a second
def test_timm_vit_is_cut_between_its_blocks() -> None:
    timm = pytest.importorskip("timm")
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=3)
    graph = trace(model.eval(), (3, 32, 32))
    # Its forward's optional attn_mask and is_causal are constants, not values flowing on.
    blocks = [n for n in graph.names() if n.startswith("blocks")]
    assert blocks == ["blocks.0", "blocks.1", "blocks"]
    assert graph.resolve_cut("blocks.2") == graph.resolve_cut("blocks")


def _hf_vit() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        image_size=32,
        patch_size=8,
        num_hidden_layers=3,
        hidden_size=32,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=4,
    )
    return transformers.ViTForImageClassification(config)


@pytest.mark.slow
def test_a_name_of_no_module_says_so_and_suggests_the_real_ones() -> None:
    model = _hf_vit()
    modules = {name for name, _ in model.named_modules()}
    # Transformers 5 names the blocks vit.layers.N, 4 vit.encoder.layer.N: ask for the
    # spelling of the release that is not installed.
    ours, theirs = (
        ("vit.layers.2", "vit.encoder.layer.2")
        if "vit.layers.2" in modules
        else ("vit.encoder.layer.2", "vit.layers.2")
    )
    graph = trace(model, (3, 32, 32))
    with pytest.raises(InvalidCut) as refused:
        graph.resolve_freeze(theirs)
    message = str(refused.value)
    assert f"'{theirs}' names no module of ViTForImageClassification" in message
    assert f"closest names are '{ours}' (cut {graph.resolve_freeze(ours)})" in message
    assert "not the only tensor" not in message
    with pytest.raises(InvalidCut, match=f"'{theirs}' names no module"):
        graph.resolve_cut(theirs)
    # A real module inside a block still gets the message about flowing tensors.
    with pytest.raises(InvalidCut, match=r"is not a cut point.*only tensor flowing on"):
        graph.resolve_freeze(f"{ours}.mlp")


def test_resnet_names_of_no_module_and_of_modules_that_are_no_cut(resnet18: ModelGraph) -> None:
    graph = resnet18
    with pytest.raises(InvalidCut) as refused:
        graph.resolve_cut("layer5")
    assert "'layer5' names no module of ResNet" in str(refused.value)
    assert "'layer4' (cut 12)" in str(refused.value)
    with pytest.raises(InvalidCut, match=r"'avgpool\+flatten' \(cut 14\)"):
        graph.resolve_freeze("avgpool+flaten")
    with pytest.raises(InvalidCut, match="no name is close to it; the cut points are"):
        graph.resolve_freeze("transformer")
    with pytest.raises(InvalidCut, match=r"'layer3\.0\.conv1' is not a cut point of ResNet"):
        graph.resolve_freeze("layer3.0.conv1")


def test_the_job_and_the_cli_give_the_same_answer(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hapi.cli import main
    from hapi.client import TransferJob

    # Nothing waits on a server before the freeze is resolved: port 9 answers nothing.
    with pytest.raises(InvalidCut, match=r"'layer5' names no module.*'layer4' \(cut 12\)"):
        TransferJob("resnet18", "d", "127.0.0.1:9", freeze="layer5", image_size=32)
    with pytest.raises(InvalidCut, match=r"'layer5' names no module"):
        TransferJob("resnet18", "d", "127.0.0.1:9", cut="layer5", image_size=32)
    monkeypatch.setenv("COLUMNS", "400")
    argv = ["hapi", "plan", "resnet18", "--server", "127.0.0.1:9", "--dataset", "d"]
    monkeypatch.setattr(sys, "argv", [*argv, "--freeze", "layer5", "--image-size", "32"])
    with pytest.raises(SystemExit) as exited:
        main()
    err = " ".join(capsys.readouterr().err.split())
    assert exited.value.code == 1
    assert "'layer5' names no module of ResNet" in err and "'layer4' (cut 12)" in err


@pytest.mark.parametrize(
    ("written", "spec"),
    [
        ("auto", "auto"), (" Auto ", "auto"), (None, "freeze"), ("freeze", "freeze"),
        ("RAW", "raw"), (RAW, RAW), ("input", "input"), ("0", INPUT), ("-1", RAW), (10, 10),
        ("10", 10), ("layer3", "layer3"), (Cut("layer3"), "layer3"),
    ],
)  # fmt: skip
def test_every_form_a_user_writes_is_one_cut(written: object, spec: object) -> None:
    assert Cut.of(written).spec == spec  # type: ignore[arg-type]


@pytest.mark.parametrize("written", [True, -2, "", "  ", 1.5, ["layer3"]])
def test_what_is_no_cut_is_refused_by_name(written: object) -> None:
    with pytest.raises(InvalidRequest, match="cut must be"):
        Cut.of(written)  # type: ignore[arg-type]


def test_a_cut_becomes_the_index_the_wire_carries(resnet18: ModelGraph) -> None:
    freeze = resnet18.resolve_cut("avgpool+flatten")
    assert Cut.of(None).index(resnet18, freeze) == freeze
    assert Cut.of("raw").index(resnet18, freeze) == RAW
    assert Cut.of("input").index(resnet18, freeze) == INPUT
    assert Cut.of("layer3").index(resnet18, freeze) == resnet18.resolve_cut("layer3")
    with pytest.raises(InvalidCut, match="planner"):
        Cut.of("auto").index(resnet18, freeze)
    with pytest.raises(InvalidCut, match="past the freeze point"):
        Cut.of("layer4").index(resnet18, resnet18.resolve_cut("layer3"))
