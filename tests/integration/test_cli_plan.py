"""`hapi plan` against a real server: the table of options, the choice, the measured plot."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image

from hapi.data import open_store, synth_dataset
from hapi.server import HapiServer, serve

from ..cli_runner import hapi


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HapiServer]:
    root = tmp_path_factory.mktemp("store")
    synth_dataset(open_store(root), "train", classes=2, per_class=6, size=48, seed=4)
    with serve(store=str(root)) as running:
        yield running


def _args(server: HapiServer, *extra: str) -> list[str]:
    return [
        "plan", "resnet18", "--server", server.address, "--dataset", "train",
        "--image-size", "32", "--num-classes", "2", "--freeze", "layer4",
        "--batch-size", "4", "--chunk-size", "4", "--probe-samples", "4", *extra,
    ]  # fmt: skip


def test_plan_prints_every_option_and_the_choice(server: HapiServer, tmp_path: Path) -> None:
    figure = tmp_path / "pictures" / "plan.png"
    done = hapi(*_args(server, "--plot", str(figure)))
    assert done.code == 0, done.stderr
    out = done.stdout
    # The picture without --measure: each option's predicted stages, the choice marked.
    assert figure.read_bytes()[:4] == b"\x89PNG" and f"wrote {figure}" in out.replace("\n", "")
    assert "freeze=12 (layer4), as given" in out
    for column in ("option", "server s", "link s", "trainer s", "epoch s", "held by"):
        assert column in out
    assert "RAW" in out and "cut 12 layer4" in out
    assert "chosen:" in out and "predicted" in out
    assert out.count("*") >= 1
    # The picture names the option the table marks chosen.
    marked = next(line for line in out.splitlines() if "│ * │" in line)
    chosen = marked.split("│")[2].strip()  # the option column of the row marked *
    with Image.open(figure) as image:
        said = image.info["Description"]
    assert said.startswith(f"chosen: {chosen}, ")


def test_plan_for_another_link_and_as_json(server: HapiServer) -> None:
    done = hapi(*_args(server, "--link", "64kbit", "--json"))
    assert done.code == 0, done.stderr
    plan = json.loads(done.stdout)
    assert {"cut", "share", "epoch_s", "binding", "reason", "options"} <= set(plan)
    chosen = [row for row in plan["options"] if row["chosen"]]
    assert len(chosen) == 1 and chosen[0]["cut"] == plan["cut"]
    # At 64 kbit/s the link holds RAW, whose bytes are the objects themselves (~2 KB JPEGs:
    # ~0.25 s a sample on the wire; at 1 Mbit/s a loaded CI trainer could take as long).
    raw = next(row for row in plan["options"] if row["cut"] == -1)
    assert raw["binding"] == "link"


def test_plan_measure_runs_the_top_options_and_plots_them(
    server: HapiServer, tmp_path: Path
) -> None:
    figure = tmp_path / "plan.png"
    done = hapi(*_args(server, "--measure", "--top", "1", "--plot", str(figure), "--json"))
    assert done.code == 0, done.stderr
    measured = json.loads(done.stdout)["measured"]
    # The fastest option, the chosen one (the same, or a simpler tie), RAW, the freeze cut.
    assert 2 <= len(measured) <= 4
    assert {row["cut"] for row in measured} >= {-1, 12}
    assert all(row["measured_s"] > 0 and row["predicted_s"] > 0 for row in measured)
    assert figure.stat().st_size > 1000 and figure.read_bytes()[:4] == b"\x89PNG"


def test_plan_refuses_a_freeze_that_trains_nothing(server: HapiServer) -> None:
    done = hapi(
        "plan", "resnet18", "--server", server.address, "--dataset", "train",
        "--image-size", "32", "--freeze", "fc",
    )  # fmt: skip
    assert done.code == 1
    assert "nothing to train" in done.error
