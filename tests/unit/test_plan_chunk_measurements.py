"""A chunk's measurements, stage by stage: its read (server, link) and its training
(trainer) reach the re-planner apart, each once, and the chunk counts once."""

from __future__ import annotations

import math

import pytest

from hapi.errors import InvalidRequest
from hapi.plan import (
    LinkProfile,
    Plan,
    ReadMeasurement,
    ReplanConfig,
    Replanner,
    TrainMeasurement,
    choose_plan,
)

from ._plan_profiles import REPLAN_SERVER as SERVER
from ._plan_profiles import REPLAN_TRAINER as TRAINER
from ._plan_profiles import REPLAN_WORK as WORK


def _plan() -> Plan:
    return choose_plan(SERVER, TRAINER, LinkProfile(bytes_per_s=1e6), WORK, freeze=2)


def _read(chunk: int, **fields: object) -> ReadMeasurement:
    """A pushed chunk's read at cut 2, its link at the planned 1 MB/s."""
    settings: dict[str, object] = {
        "samples": 64,
        "bytes": 64_000,
        "cut": 2,
        "server_s": 64 * SERVER.compute_s(2),
        "transfer_s": 0.064,
        "chunk": chunk,
    }
    settings.update(fields)
    return ReadMeasurement(**settings)  # type: ignore[arg-type]


def _trained(chunk: int, **fields: object) -> TrainMeasurement:
    settings: dict[str, object] = {
        "samples": 64,
        "cut": 2,
        "trainer_s": 64 * TRAINER.remote_s(2),
        "chunk": chunk,
    }
    settings.update(fields)
    return TrainMeasurement(**settings)  # type: ignore[arg-type]


def test_a_chunk_read_then_trained_counts_once_in_two_steps() -> None:
    replanner = Replanner(_plan())
    for i in range(3):
        assert replanner.observe(_read(i)) is None
        assert replanner.observe(trained=_trained(i)) is None
    assert (replanner.chunks, replanner.steps) == (3, 6)
    together = Replanner(_plan())
    together.observe(_read(0), _trained(0))
    assert (together.chunks, together.steps) == (1, 1)


def test_a_training_is_evidence_of_the_trainer_alone() -> None:
    replanner = Replanner(_plan(), ReplanConfig(min_chunks=100))
    replanner.observe(trained=_trained(0, trainer_s=3 * 64 * TRAINER.remote_s(2)))
    scales = replanner.scales()
    assert scales["trainer"] == pytest.approx(3.0)
    assert (scales["server"], scales["link"]) == (1.0, 1.0)  # no data: the plan's


def test_a_read_is_evidence_of_the_server_and_the_link_alone() -> None:
    replanner = Replanner(_plan(), ReplanConfig(min_chunks=100))
    replanner.observe(_read(0, server_s=2 * 64 * SERVER.compute_s(2)))
    scales = replanner.scales()
    assert scales["server"] == pytest.approx(2.0)
    assert scales["trainer"] == 1.0


@pytest.mark.parametrize(("issued", "slow"), [(6.51, True), (0.05, False), (None, False)])
def test_a_training_counts_the_turns_no_later_chunk_can_claim(
    issued: float | None, slow: bool
) -> None:
    # A turn twice its own bytes' time is held back for the chunks that may have crossed
    # in it. A chunk trained was read: requested after the turn ended, it shows every
    # chunk that could have crossed in it has been read, and the turn counts as the
    # link's own. Requested before, or not known when, it shows nothing of the sort.
    replanner = Replanner(_plan(), ReplanConfig(min_chunks=100))
    replanner.observe(_read(0, transfer_s=0.128, issued=0.0, read_end=6.5))
    assert replanner.scales()["link"] == pytest.approx(1.0)
    replanner.observe(trained=_trained(1, issued=issued))
    assert (replanner.scales()["link"] > 1.5) is slow


def test_observing_nothing_or_two_chunks_at_once_is_refused() -> None:
    replanner = Replanner(_plan())
    with pytest.raises(InvalidRequest, match="got neither"):
        replanner.observe()
    with pytest.raises(InvalidRequest, match="one chunk"):
        replanner.observe(_read(0), _trained(1))
    assert (replanner.chunks, replanner.steps) == (0, 0)


@pytest.mark.parametrize(
    "bad",
    [
        lambda: _read(0, samples=-1),
        lambda: _read(0, bytes=True),
        lambda: _read(0, server_s=-0.1),
        lambda: _read(0, transfer_s=math.inf),
        lambda: _trained(0, samples=1.5),
        lambda: _trained(0, trainer_s=math.nan),
    ],
)
def test_a_measurement_out_of_range_is_refused(bad: object) -> None:
    with pytest.raises(InvalidRequest, match="must be"):
        bad()  # type: ignore[operator]


def test_a_read_without_a_server_or_link_time_is_taken() -> None:
    read = _read(0, server_s=None, transfer_s=None)
    replanner = Replanner(_plan())
    assert replanner.observe(read) is None
    assert replanner.scales() == {"server": 1.0, "link": 1.0, "trainer": 1.0}
