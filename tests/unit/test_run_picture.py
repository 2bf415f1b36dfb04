"""Pictures of a plan and of a run: written whole, the choice and the events on them."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from hapi.client import EpochStats, History
from hapi.client.pipeline.history import Event
from hapi.errors import InvalidRequest
from hapi.plan import LinkProfile, Workload, choose_plan
from hapi.plan.picture import plot_plan

from ._plan_profiles import NAMES, server_profile, trainer_profile


def _epoch(epoch: int, *, cached: int, cut: int, share: float = 0.0) -> EpochStats:
    return EpochStats(
        epoch=epoch, loss=1.0 / (epoch + 1), accuracy=0.5, seconds=4.0 - epoch, samples=64,
        bytes_received=0 if cached == 64 else 2_000_000, wait_s=0.1, compute_s=1.0,
        decode_s=0.2, server_s=2.0, transfer_s=1.5, trainer_s=1.0, cut=cut, share=share,
        cached=cached,
    )  # fmt: skip


def test_a_run_is_drawn_with_its_sources_and_events(tmp_path: Path) -> None:
    history = History(
        epochs=[_epoch(0, cached=0, cut=14, share=0.25), _epoch(1, cached=64, cut=14)],
        events=[Event(kind="replan", epoch=0, chunk=3, message="moved to cut 14")],
    )
    path = history.plot(tmp_path / "deep" / "run.png", title="a run")
    with Image.open(path) as image:
        assert image.format == "PNG" and image.width > 500 and image.height > 500
        said = image.info["Description"]
    assert "epoch 1:" in said and "cut 14 + 25% local" in said
    assert "epoch 2:" in said and "all from caches" in said and "64 from the trainer's" in said
    with pytest.raises(InvalidRequest, match="no epoch"):
        History().plot(tmp_path / "none.png")


def test_a_plan_is_drawn_with_every_option_shown(tmp_path: Path) -> None:
    workload = Workload(samples=512, chunk_size=32)
    link = LinkProfile(bytes_per_s=1e6)
    plan = choose_plan(server_profile(), trainer_profile(), link, workload, freeze=2, names=NAMES)
    path = plot_plan(plan, tmp_path / "plan.png", measured=[(plan.chosen, 1.5)], title="t")
    with Image.open(path) as image:
        assert image.format == "PNG" and image.height > 200
        said = image.info["Description"]
    assert said.startswith(f"chosen: {plan.chosen.label}, ") and "RAW " in said
