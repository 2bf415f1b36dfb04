"""Heads as content-addressed artifacts: torch.export's JSON program and safetensors weights,
loaded without unpickling anything; equal to the in-memory head."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from torch import nn

from hapi.errors import CorruptObject, IntegrityError, InvalidCut, InvalidRequest
from hapi.graph import ModelGraph, ModelSpec, build_model, trace
from hapi.graph.export import HeadArtifact, export_head, load_head


class SkipNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8))
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = torch.relu(self.block(x) + x)
        return self.fc(x.mean(dim=(2, 3)))


class Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.mean() > 0:  # a branch on a tensor's value: not exportable
            return x * 2
        return x


@pytest.fixture(scope="module")
def resnet18() -> ModelGraph:
    torch.manual_seed(0)
    return trace(build_model(ModelSpec(name="resnet18")), (3, 32, 32))


@pytest.fixture(scope="module")
def artifact(resnet18: ModelGraph) -> HeadArtifact:
    return export_head(resnet18, "layer2")


def _refuses_pickle(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("unpickled")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)


def test_a_loaded_head_equals_the_in_memory_head(
    resnet18: ModelGraph, artifact: HeadArtifact, monkeypatch: pytest.MonkeyPatch
) -> None:
    _refuses_pickle(monkeypatch)
    head = load_head(artifact)
    x = torch.randn(3, 3, 32, 32)
    expected = resnet18.head(resnet18.resolve_cut("layer2"))
    with torch.no_grad():
        for batch in (x, x[:1]):  # any batch size
            assert torch.equal(head(batch), expected(batch))
    assert not any(p.requires_grad for p in head.parameters())
    with pytest.raises(InvalidRequest, match=r"inputs of shape \(N, 3, 32, 32\)"):
        head(torch.randn(1, 3, 16, 16))


@pytest.mark.slow
def test_a_user_module_and_a_hugging_face_vit_export_at_a_mid_cut() -> None:
    torch.manual_seed(0)
    graph = trace(SkipNet().eval(), (3, 16, 16))
    cut = graph.resolve_cut("stem")
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(load_head(export_head(graph, cut))(x), graph.head(cut)(x))

    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=3,
    )
    vit = transformers.ViTForImageClassification(config).eval()
    graph = trace(vit, (3, 32, 32))
    cut = graph.resolve_cut("vit.layers.0")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(load_head(export_head(graph, cut))(x), graph.head(cut)(x))


@pytest.mark.slow
def test_the_digest_names_the_content(resnet18: ModelGraph, artifact: HeadArtifact) -> None:
    assert export_head(resnet18, "layer2").digest == artifact.digest
    torch.manual_seed(0)
    twin = trace(build_model(ModelSpec(name="resnet18")), (3, 32, 32))
    assert export_head(twin, "layer2").digest == artifact.digest  # another model, same content
    with torch.no_grad():
        twin.model.get_parameter("layer1.0.conv1.weight")[0, 0, 0, 0] += 1.0
    changed = export_head(twin, "layer2")
    assert changed.digest != artifact.digest and changed.program == artifact.program
    assert export_head(resnet18, "layer1").digest != artifact.digest


def test_bytes_that_do_not_match_their_digest_are_refused(artifact: HeadArtifact) -> None:
    with pytest.raises(IntegrityError, match="does not match"):
        HeadArtifact(
            program=artifact.program,
            weights=artifact.weights[:-1] + b"\0",
            input_shape=artifact.input_shape,
            digest=artifact.digest,
        )
    with pytest.raises(CorruptObject):
        load_head(HeadArtifact(program=b"{", weights=b"nope", input_shape=(3, 32, 32)))


def _tampered(artifact: HeadArtifact, change: str) -> HeadArtifact:
    data = json.loads(artifact.program)
    if change == "target":
        data["graph_module"]["graph"]["nodes"][0]["target"] = "torch.load"
    elif change == "expression":
        data["range_constraints"] = {"s77": {"min_val": 2, "max_val": None}}
        node = data["graph_module"]["graph"]["nodes"][0]
        node["inputs"].append(
            {
                "name": "n",
                "arg": {
                    "as_sym_int": {
                        "as_expr": {"expr_str": "__import__('os').system('true')", "hint": None}
                    }
                },
                "kind": 1,
            }
        )
    elif change == "guards":
        data["guards_code"] = ["__import__('os')"]
    program = json.dumps(data).encode()
    return HeadArtifact(program=program, weights=artifact.weights, input_shape=(3, 32, 32))


@pytest.mark.parametrize(
    ("change", "message"),
    [("target", "calls 'torch.load'"), ("expression", "shape expression"), ("guards", "guard")],
)
def test_programs_that_do_more_than_aten_are_refused(
    artifact: HeadArtifact, change: str, message: str
) -> None:
    with pytest.raises(InvalidRequest, match=message):
        load_head(_tampered(artifact, change))


def test_a_head_that_branches_on_values_names_the_line() -> None:
    net = nn.Sequential(nn.Conv2d(3, 4, 3), Gate(), nn.ReLU(), nn.Flatten(), nn.Linear(144, 2))
    graph = trace(net, (3, 8, 8))  # torch.fx and torch.export fail: cut between children
    assert graph.method == "children"
    export_head(graph, 1)  # before the branch: fine
    with pytest.raises(InvalidRequest, match=r"cut 2 .*in forward \(if x\.mean\(\) > 0:"):
        export_head(graph, 2)


def test_input_and_raw_need_no_head(resnet18: ModelGraph) -> None:
    for cut in (0, -1, "input"):
        with pytest.raises(InvalidCut, match="needs no head"):
            export_head(resnet18, cut)
