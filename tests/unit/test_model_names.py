"""timm and Hugging Face models by name (`timm:NAME`, `hf:CONFIG`), and profile rows with
parameters and forward FLOPs per cut."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from hapi.errors import InvalidRequest, UnknownModel
from hapi.graph import ModelSpec, build_model, profile_rows, trace

SMALL_VIT = {
    "image_size": 32,
    "patch_size": 8,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
}


def _same_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize(
    "spec",
    [
        ModelSpec(
            name="timm:vit_tiny_patch16_224",
            config={"img_size": 32, "patch_size": 8, "depth": 2},
            num_classes=3,
        ),
        # Importing transformers alone takes seconds: Hugging Face specs are CI's.
        pytest.param(
            ModelSpec(name="hf:ViTConfig", config=SMALL_VIT, num_classes=3),
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ModelSpec(name="hf:ViTForImageClassification", config=SMALL_VIT, seed=2),
            marks=pytest.mark.slow,
        ),
        pytest.param(ModelSpec(name="hf:vit", config=SMALL_VIT), marks=pytest.mark.slow),
    ],
    ids=["timm", "hf-config", "hf-class", "hf-type"],
)
def test_timm_and_hugging_face_specs_build_the_same_model_after_the_wire(spec: ModelSpec) -> None:
    pytest.importorskip("timm" if spec.name.startswith("timm:") else "transformers")
    sent = ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert sent == spec
    model = build_model(sent)
    assert not model.training and _same_state(model, build_model(spec))
    graph = trace(model, (3, 32, 32))
    assert graph.num_cuts >= 4
    if spec.num_classes is not None:
        assert graph.cut_points[-1].shape == (3,)


def test_unknown_names_and_options_are_refused() -> None:
    pytest.importorskip("timm")
    with pytest.raises(UnknownModel, match="unknown timm model 'nope_net'"):
        build_model(ModelSpec(name="timm:nope_net"))
    with pytest.raises(UnknownModel, match="cannot be downloaded"):
        build_model(ModelSpec(name="timm:resnet18", weights="imagenet"))
    with pytest.raises(UnknownModel, match="bogus"):
        build_model(ModelSpec(name="timm:resnet18", config={"bogus": 1}))
    for bad in ({"a": float("nan")}, {"a": object()}, {1: 2}, ["x"]):
        with pytest.raises(InvalidRequest, match="config"):
            ModelSpec(name="resnet18", config=bad)  # type: ignore[arg-type]


@pytest.mark.slow  # importing transformers alone takes seconds
def test_an_unknown_hugging_face_config_is_refused_with_the_known_ones() -> None:
    pytest.importorskip("transformers")
    with pytest.raises(UnknownModel, match="'NopeConfig'.*ViTConfig"):
        build_model(ModelSpec(name="hf:NopeConfig"))


def test_profile_rows_add_parameters_and_flops_per_cut() -> None:
    model = build_model(ModelSpec(name="resnet18"))
    graph = trace(model, (3, 32, 32))
    rows = profile_rows(graph)
    assert [r["cut"] for r in rows] == list(range(graph.num_cuts + 1))
    assert rows[0]["params"] == 0 and rows[0]["flops"] == 0
    # conv1: 64 filters of 3x7x7 over a 16x16 output, 2 FLOPs per multiply-add.
    assert rows[1]["name"] == "conv1" and rows[1]["flops"] == 2 * 64 * 3 * 7 * 7 * 16 * 16
    assert rows[1]["params"] == model.conv1.weight.numel()
    assert [r["flops"] for r in rows] == sorted(r["flops"] for r in rows)
    assert rows[-1]["params"] == sum(p.numel() for p in model.parameters())
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.rand(1, 3, 32, 32))
    assert rows[-1]["flops"] == counter.get_total_flops()
    assert "flops" not in profile_rows(graph, flops=False)[3]


@pytest.mark.slow
def test_profile_rows_of_a_model_traced_by_torch_export() -> None:
    pytest.importorskip("transformers")
    graph = trace(build_model(ModelSpec(name="hf:ViTConfig", config=SMALL_VIT)), (3, 32, 32))
    assert graph.method == "export"
    rows = profile_rows(graph)
    layers = [r for r in rows if r["name"].startswith("vit.layers.")]
    assert len(layers) == 2 and 0 < layers[0]["flops"] < layers[1]["flops"]
    assert layers[0]["params"] < layers[1]["params"] <= rows[-1]["params"]
