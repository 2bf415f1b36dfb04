"""Profiles kept between jobs: the same job run again plans at once, from what it measured;
a job's first run trains at once, and plans from its own chunks beside its training."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from hapi.client import TransferJob, connect
from hapi.client.planning.plan_job import STALE_LINK
from hapi.data import open_store, synth_dataset
from hapi.plan import LinkProfile
from hapi.server import HapiServer, serve


@pytest.fixture
def server(tmp_path: Path) -> Iterator[HapiServer]:
    synth_dataset(open_store(tmp_path), "train", classes=3, per_class=6, size=72, seed=8)
    with serve(store=str(tmp_path), batch_size=4) as running:
        yield running


def _job(server: HapiServer, **options: object) -> TransferJob:
    settings: dict[str, object] = {
        "freeze": "layer3", "image_size": 64, "batch_size": 4, "chunk_size": 4,
        "probe_samples": 6, "seed": 1,
    }  # fmt: skip
    settings.update(options)
    return TransferJob({"name": "resnet18", "num_classes": 3}, "train", server.address, **settings)


def _object_sizes(root: Path) -> list[int]:
    return [p.stat().st_size for p in (root / "train").rglob("*.jpg")]


def _bytes_sent(server: HapiServer) -> int:
    """What the server has streamed: every probe's and chunk's bytes."""
    return connect(server.address).stats().bytes_sent


def test_a_job_run_again_plans_from_the_profiles_the_first_run_measured(
    server: HapiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HAPI_CACHE_DIR", str(tmp_path / "cache"))
    first = _job(server)
    assert first.plan is not None
    (measured,) = first.history.of_kind("plan")
    assert measured.data["kept_profiles"] is False
    kept = sorted(p.name.split("-")[0] for p in (tmp_path / "cache" / "profiles").iterdir())
    assert kept == ["job", "trainer"]
    sent = _bytes_sent(server)
    assert sent > 0

    again = _job(server)
    assert again.plan is not None
    (planned,) = again.history.of_kind("plan")
    assert planned.data["kept_profiles"] is True
    assert "earlier run" in planned.message
    assert (again.plan.cut, again.plan.share) == (first.plan.cut, first.plan.share)
    # Only the link was probed again (a RAW probe of at most `probe_samples` objects).
    assert 0 < _bytes_sent(server) - sent <= 6 * max(_object_sizes(tmp_path))
    sent = _bytes_sent(server)

    # What the measurements depend on changed (the probe's size): measured again.
    other = _job(server, probe_samples=5)
    assert other.plan is not None
    assert other.history.of_kind("plan")[0].data["kept_profiles"] is False
    assert _bytes_sent(server) > sent

    # A job that asks for fresh measurements gets them, and trains.
    fresh = _job(server, reuse_profiles=False)
    assert fresh.plan is not None
    assert fresh.history.of_kind("plan")[0].data["kept_profiles"] is False
    (epoch,) = again.fit(1, lr=0.05).epochs
    assert epoch.samples == 18


def test_a_job_weighing_fewer_codecs_plans_from_what_one_weighing_more_measured(
    server: HapiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HAPI_CACHE_DIR", str(tmp_path / "cache"))
    auto = _job(server)  # none, lz4 and zstd weighed
    assert auto.plan is not None
    assert auto.history.of_kind("plan")[0].data["kept_profiles"] is False
    sent = _bytes_sent(server)

    off = _job(server, wire_compression="none")
    assert off.plan is not None
    assert off.history.of_kind("plan")[0].data["kept_profiles"] is True
    assert _bytes_sent(server) - sent <= 6 * max(_object_sizes(tmp_path))  # the link's probe
    sent = _bytes_sent(server)
    assert off.plan.compression == "none"
    assert off.plan.link == auto.plan.link  # one measurement

    # Lossy dtypes were never measured: the job measures them (and all else) again.
    lossy = _job(server, lossy_wire=True)
    assert lossy.plan is not None
    assert lossy.history.of_kind("plan")[0].data["kept_profiles"] is False
    assert _bytes_sent(server) > sent


def test_a_kept_link_that_changed_since_is_measured_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same address, first unshaped, then behind a 500 kbit/s egress: the second job
    plans from the link it measures, not the kept one, and keeps it for the next."""
    monkeypatch.setenv("HAPI_CACHE_DIR", str(tmp_path / "cache"))
    synth_dataset(open_store(tmp_path), "train", classes=3, per_class=6, size=72, seed=8)
    with socket.socket() as s:  # one address for both servers: the profiles' key
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with serve(store=str(tmp_path), batch_size=4, port=port) as fast:
        first = _job(fast)
        assert first.plan is not None
        kept_rate = first.plan.link.bytes_per_s
    assert kept_rate > 5e5 / 8 * STALE_LINK * 2  # loopback: far past the shaped rate below
    (kept_file,) = (tmp_path / "cache" / "profiles").glob("job-*.json")
    before = json.loads(kept_file.read_text())

    with serve(store=str(tmp_path), batch_size=4, port=port, egress_limit="500kbit") as slow:
        assert slow.address == fast.address
        second = _job(slow)
        assert second.plan is not None
        (planned,) = second.history.of_kind("plan")
        assert planned.data["kept_profiles"] is True
        assert planned.data["stale_link"] is True
        assert "link measured again" in planned.message
        assert second.plan.link.bytes_per_s < 5e5 / 8 * 1.5  # the shaped rate, give or take
        # The kept file holds the fresh link, and the rest as the first job measured it.
        after = json.loads(kept_file.read_text())
        assert LinkProfile.from_dict(after["link"]) == second.plan.link
        assert {k: after[k] for k in ("server", "trainer", "codecs")} == {
            k: before[k] for k in ("server", "trainer", "codecs")
        }

        third = _job(slow)  # planned from the link the second job kept
        assert third.plan is not None
        (again,) = third.history.of_kind("plan")
        assert (again.data["kept_profiles"], again.data["stale_link"]) == (True, False)
        assert third.plan.link == second.plan.link


def _samples_computed(server: HapiServer) -> tuple[int, int]:
    """Samples the server computed, in every session, open or closed, and the chunk
    streams their client left before their end."""
    stats = connect(server.address).stats()
    sessions = [*stats.sessions.values(), *stats.closed_sessions.values()]
    return sum(s.samples for s in sessions), sum(s.abandoned for s in sessions)


def test_a_first_run_trains_at_once_and_plans_from_its_own_chunks_then_a_second_plans_first(
    server: HapiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HAPI_CACHE_DIR", str(tmp_path / "cache"))
    first = _job(server, augment=False, cache=False)
    history = first.fit(2, lr=0.05)

    kinds = [e.kind for e in history.events]
    assert kinds[0] == "plan-aside" and "plan" in kinds, kinds
    assert history.of_kind("plan-aside")[0].data["cut"] == first.freeze  # it began there
    assert [e.samples for e in history.epochs] == [18, 18]
    assert first.plan is not None
    (measured,) = history.of_kind("plan")
    assert measured.data["kept_profiles"] is False
    # The server computed the epochs' samples (the local share's raw reads included), a
    # RAW probe of at most `probe_samples`, and the part of each chunk that was re-routed
    # to the new cut when the plan came in mid-epoch (at most a chunk each): no probe at
    # the freeze cut (4 + 6 more).
    computed, rerouted = _samples_computed(server)
    assert 36 <= computed <= 36 + 6 + 4 * rerouted, (computed, rerouted)

    again = _job(server, augment=False, cache=False)
    history = again.fit(1, lr=0.05)
    assert history.events[0].kind == "plan", history.events  # planned before it trained
    assert history.events[0].data["kept_profiles"] is True
