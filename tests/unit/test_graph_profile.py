"""Profile rows and the `hapi profile` command."""

from __future__ import annotations

import json

import pytest

from hapi.graph import ModelSpec, build_model, profile_rows, trace

from ..cli_runner import hapi


def _cli(*args: str) -> tuple[int, str]:
    result = hapi(*args)
    return result.code, result.stdout + result.stderr


def test_profile_rows_list_the_input_and_every_cut_point() -> None:
    graph = trace(build_model(ModelSpec(name="resnet18")), (3, 64, 64))
    rows = profile_rows(graph)
    assert len(rows) == graph.num_cuts + 1
    assert rows[0] == {
        "cut": 0,
        "name": "input",
        "shape": [3, 64, 64],
        "bytes_per_sample": 3 * 64 * 64 * 4,
        "bytes_fp16": 3 * 64 * 64 * 2,
        "ratio": 1.0,
        "params": 0,
        "flops": 0,
    }
    assert rows[-1] == {
        "cut": 15,
        "name": "fc",
        "shape": [1000],
        "bytes_per_sample": 4000,
        "bytes_fp16": 2000,
        "ratio": 4000 / (3 * 64 * 64 * 4),
        "params": 11_689_512,  # all of resnet18's
        "flops": 297_115_648,  # 2 per multiply-add of its convolutions and fc at 64 px
    }
    # The head grows along the cuts; no FLOPs row when they are left out.
    assert [r["params"] for r in rows] == sorted(r["params"] for r in rows)
    assert [r["flops"] for r in rows] == sorted(r["flops"] for r in rows)
    assert "flops" not in profile_rows(graph, flops=False)[-1]


def test_profile_command_prints_json_and_a_table() -> None:
    code, out = _cli("profile", "resnet18", "--image-size", "64", "--json")
    assert code == 0, out
    rows = json.loads(out)
    assert len(rows) == 16 and [r["cut"] for r in rows] == list(range(16))
    assert rows[6]["name"] == "layer1" and rows[6]["shape"] == [64, 16, 16]
    code, out = _cli("profile", "resnet18", "--image-size", "64", "--num-classes", "3")
    assert code == 0, out
    assert "layer3" in out and "traced with torch.fx" in out and "48.0 KiB" in out  # input
    assert "296.1M" in out and "11.2M" in out  # the head's FLOPs and parameters at fc


@pytest.mark.slow  # imports transformers, traces with torch.export
def test_profile_takes_timm_and_hugging_face_models_with_options() -> None:
    pytest.importorskip("timm")
    options = '{"img_size": 32, "patch_size": 8, "depth": 2}'
    args = ("--image-size", "32", "--config", options, "--json")
    code, out = _cli("profile", "timm:vit_tiny_patch16_224", *args)
    assert code == 0, out
    names = [r["name"] for r in json.loads(out)]
    assert "blocks.0" in names and "blocks" in names

    pytest.importorskip("transformers")
    config = '{"image_size": 32, "patch_size": 8, "hidden_size": 32, "num_hidden_layers": 2, '
    config += '"num_attention_heads": 2, "intermediate_size": 64}'
    code, out = _cli("profile", "hf:ViTConfig", "--image-size", "32", "--config", config)
    assert code == 0, out
    assert "vit.layers.0" in out and "traced with torch.export" in out
    assert "torch.fx cannot trace it" in out  # the note says why

    done = hapi("profile", "resnet18", "--config", "[1]")
    assert done.code == 1 and "JSON object" in done.error


def test_profile_of_an_unknown_model_is_one_line_on_stderr() -> None:
    done = hapi("profile", "resnet_nope", "--json")
    assert done.code == 1
    assert done.stdout == ""
    assert done.stderr.startswith("error:") and "resnet_nope" in done.error
    assert "Traceback" not in done.stderr
