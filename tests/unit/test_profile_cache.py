"""The trainer's profile kept on disk: measured once per model, batch and machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch import nn

from hapi.client.planning.profile_cache import ProfileCache
from hapi.graph import ModelGraph, trace
from hapi.plan import TrainerProfile, measure_trainer


def _net(width: int = 8) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, width, 3), nn.ReLU(), nn.Flatten(), nn.Linear(width * 6 * 6, 2)
    )


class _Counting:
    """`measure_trainer`, counting its calls."""

    def __init__(self, graph: ModelGraph, freeze: int, batch: int) -> None:
        self.graph, self.freeze, self.batch, self.calls = graph, freeze, batch, 0

    def __call__(self) -> TrainerProfile:
        self.calls += 1
        return measure_trainer(self.graph, self.freeze, batch_size=self.batch, repeats=1)


def test_a_profile_is_measured_once_and_read_back_equal(tmp_path: Path) -> None:
    graph = trace(_net(), (3, 8, 8))
    profiles = ProfileCache(tmp_path)
    measure = _Counting(graph, 2, 4)

    first, cached_first = profiles.trainer(graph, 2, 4, measure)
    again, cached_again = ProfileCache(tmp_path).trainer(graph, 2, 4, measure)

    assert (cached_first, cached_again) == (False, True)
    assert measure.calls == 1
    assert again == first
    assert len(list(tmp_path.glob("trainer-*.json"))) == 1


@pytest.mark.parametrize("change", ["batch", "freeze", "shape", "width"])
def test_what_changes_the_times_is_measured_again(tmp_path: Path, change: str) -> None:
    graph = trace(_net(), (3, 8, 8))
    profiles = ProfileCache(tmp_path)
    profiles.trainer(graph, 2, 4, _Counting(graph, 2, 4))

    freeze, batch = 2, 4
    other = graph
    if change == "batch":
        batch = 8
    elif change == "freeze":
        freeze = 1
    elif change == "shape":
        other = trace(
            nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 2)),
            (3, 10, 10),
        )
    else:
        other = trace(_net(16), (3, 8, 8))
    measure = _Counting(other, freeze, batch)
    _, cached = profiles.trainer(other, freeze, batch, measure)
    assert not cached and measure.calls == 1


def test_a_torn_or_foreign_file_is_measured_again_and_replaced(tmp_path: Path) -> None:
    graph = trace(_net(), (3, 8, 8))
    profiles = ProfileCache(tmp_path)
    profiles.trainer(graph, 2, 4, _Counting(graph, 2, 4))
    (path,) = tmp_path.glob("trainer-*.json")
    path.write_text('{"head_s": [0.1')  # a write torn half-way

    measure = _Counting(graph, 2, 4)
    profile, cached = profiles.trainer(graph, 2, 4, measure)

    assert not cached and measure.calls == 1
    assert TrainerProfile.from_dict(json.loads(path.read_text())) == profile


def test_an_unwritable_cache_measures_every_time(tmp_path: Path) -> None:
    graph = trace(_net(), (3, 8, 8))
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    profiles = ProfileCache(blocker / "profiles")
    measure = _Counting(graph, 2, 4)

    profiles.trainer(graph, 2, 4, measure)
    _, cached = profiles.trainer(graph, 2, 4, measure)

    assert not cached and measure.calls == 2
