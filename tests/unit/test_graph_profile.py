"""Profile rows and the `hapi profile` command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from hapi.graph import ModelSpec, build_model, profile_rows, trace


def _cli(*args: str) -> tuple[int, str]:
    from hapi.cli import _register, app

    _register()
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output


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
    hapi = Path(sys.executable).with_name("hapi")
    done = subprocess.run(
        [str(hapi), "profile", "resnet_nope", "--json"], capture_output=True, text=True
    )
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.startswith("error:") and "resnet_nope" in done.stderr
    assert "Traceback" not in done.stderr
