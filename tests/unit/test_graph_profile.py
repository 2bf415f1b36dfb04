"""Profile rows and the `hapi profile` command."""

from __future__ import annotations

import json

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
    }
    assert rows[-1] == {
        "cut": 15,
        "name": "fc",
        "shape": [1000],
        "bytes_per_sample": 4000,
        "bytes_fp16": 2000,
        "ratio": 4000 / (3 * 64 * 64 * 4),
    }


def test_profile_command_prints_json_and_a_table() -> None:
    code, out = _cli("profile", "resnet18", "--image-size", "64", "--json")
    assert code == 0, out
    rows = json.loads(out)
    assert len(rows) == 16 and [r["cut"] for r in rows] == list(range(16))
    assert rows[6]["name"] == "layer1" and rows[6]["shape"] == [64, 16, 16]
    code, out = _cli("profile", "resnet18", "--image-size", "64", "--num-classes", "3")
    assert code == 0, out
    assert "layer3" in out and "traced" in out and "24.0 KiB" in out  # the input in fp16


def test_profile_of_an_unknown_model_is_one_line_on_stderr() -> None:
    done = hapi("profile", "resnet_nope", "--json")
    assert done.code == 1
    assert done.stdout == ""
    assert done.stderr.startswith("error:") and "resnet_nope" in done.error
    assert "Traceback" not in done.stderr
