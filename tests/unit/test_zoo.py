"""Named models: the same spec builds the same parameters everywhere, offline."""

from __future__ import annotations

import json

import pytest
import torch

from hapi.errors import InvalidRequest, UnknownModel
from hapi.graph import ModelSpec, build_model, known_models


def _same_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_spec_builds_bit_identical_models_without_touching_the_global_rng() -> None:
    spec = ModelSpec(name="resnet18", seed=3, num_classes=7)
    state = torch.get_rng_state()
    a, b = build_model(spec), build_model(spec)
    assert torch.equal(torch.get_rng_state(), state)
    assert _same_state(a, b)
    assert not a.training
    assert a.fc.out_features == 7 and a.state_dict()["fc.weight"].shape == (7, 512)
    other = build_model(ModelSpec(name="resnet18", seed=4, num_classes=7))
    assert not torch.equal(a.conv1.weight, other.conv1.weight)


def test_efficientnet_lite0_loads_its_shipped_weights_whatever_the_seed() -> None:
    a = build_model(ModelSpec(name="efficientnet_lite0", weights="imagenet"))
    b = build_model(ModelSpec(name="efficientnet_lite0", weights="imagenet", seed=9))
    assert _same_state(a, b)  # the weights come from the file, not the seed
    random = build_model(ModelSpec(name="efficientnet_lite0"))
    assert not torch.equal(
        a.state_dict()["_conv_stem.weight"], random.state_dict()["_conv_stem.weight"]
    )
    assert _same_state(random, build_model(ModelSpec(name="efficientnet_lite0")))
    head = build_model(ModelSpec(name="efficientnet_lite0", weights="imagenet", num_classes=3))
    assert head.get_submodule("_fc").out_features == 3
    assert torch.equal(head.state_dict()["_conv_stem.weight"], a.state_dict()["_conv_stem.weight"])


def test_spec_round_trips_through_json() -> None:
    spec = ModelSpec(name="efficientnet_lite0", weights="imagenet", seed=2, num_classes=10)
    assert ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert ModelSpec.from_dict({"name": "resnet18"}) == ModelSpec(name="resnet18")


@pytest.mark.parametrize(
    "bad",
    [
        {},
        {"name": "resnet18", "colour": "red"},
        {"name": ""},
        {"name": 3},
        {"name": "resnet18", "weights": "laion"},
        {"name": "resnet18", "seed": "1"},
        {"name": "resnet18", "seed": True},
        {"name": "resnet18", "num_classes": 0},
        {"name": "resnet18", "num_classes": 2.5},
        ["resnet18"],
    ],
)
def test_bad_specs_are_invalid_requests(bad: object) -> None:
    with pytest.raises(InvalidRequest):
        ModelSpec.from_dict(bad)  # type: ignore[arg-type]


def test_unknown_models_and_weights_that_cannot_be_had_are_refused() -> None:
    with pytest.raises(UnknownModel, match=r"'resnet_nope'.*resnet18"):
        build_model(ModelSpec(name="resnet_nope"))
    with pytest.raises(UnknownModel, match="cannot be downloaded"):
        build_model(ModelSpec(name="resnet18", weights="imagenet"))


def test_known_models() -> None:
    names = known_models()
    assert {"resnet18", "vit_b_16", "densenet121", "efficientnet_lite0"} <= set(names)
    assert names == sorted(names)
    assert "fasterrcnn_resnet50_fpn" not in names  # classification models only
