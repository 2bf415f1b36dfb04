"""Faults while a job measures its plan: the job trains anyway, every key once.

A `cut="auto"` job measures its server in its first seconds. A server killed (-9) then, or
a store away then, or no server at all, must not fail `fit`: the job starts on the
default plan (the freeze cut) and the plan follows once a server can be measured.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hapi.client import TransferJob, connect
from hapi.data import open_store, synth_dataset
from hapi.errors import HapiError, ServerUnavailable

from ..seaweed import SeaweedS3, free_port
from ..serve_process import ServeProcess

CLASSES, PER_CLASS = 3, 6
SAMPLES = CLASSES * PER_CLASS


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServeProcess]:
    synth_dataset(
        open_store(tmp_path), "train", classes=CLASSES, per_class=PER_CLASS, size=72, seed=5
    )
    running = ServeProcess(tmp_path, free_port())
    running.start("--batch-size", "4")
    try:
        running.wait_ready()
        yield running
    finally:
        running.stop()


def _job(address: str, **options: object) -> TransferJob:
    return TransferJob(
        {"name": "resnet18", "num_classes": CLASSES},
        "train",
        address,
        freeze="layer4",
        image_size=64,
        batch_size=4,
        chunk_size=4,
        probe_samples=6,
        seed=2,
        **options,
    )


class _KillWhenMeasured(threading.Thread):
    """Kills the server (-9) as soon as it holds a session - the job's first probe - and
    starts it again a moment later on the same port."""

    def __init__(self, server: ServeProcess, job: TransferJob) -> None:
        super().__init__(daemon=True)
        self.server, self.job = server, job
        self.events_at_kill: int | None = None

    def run(self) -> None:
        client = connect(self.server.address, timeout=2)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if client.stats().sessions:
                    break
            except HapiError:
                pass
            time.sleep(0.01)
        self.events_at_kill = len(self.job.history.events)
        self.server.kill()
        time.sleep(1.0)
        self.server.start()


@pytest.mark.slow
def test_a_server_killed_while_the_plan_is_measured_trains_every_key_once(
    server: ServeProcess,
) -> None:
    job = _job(server.address, retry_budget_s=120)
    killer = _KillWhenMeasured(server, job)
    killer.start()
    history = job.fit(2, lr=0.05)
    killer.join()

    kinds = [e.kind for e in history.events]
    assert killer.events_at_kill is not None
    assert "plan" not in kinds[: killer.events_at_kill]  # it landed before the plan was made
    assert [e.samples for e in history.epochs] == [SAMPLES, SAMPLES]
    assert not any(e.skipped for e in history.epochs)
    # The job did not wait for the server: it started on the freeze cut, and measured
    # its plan once the server was back.
    assert kinds[0] == "plan-aside", kinds
    assert "plan" in kinds, kinds
    assert job.plan is not None


@pytest.mark.slow
def test_with_no_server_at_all_the_job_trains_from_the_store_on_the_default_plan(
    tmp_path: Path,
) -> None:
    synth_dataset(
        open_store(tmp_path), "train", classes=CLASSES, per_class=PER_CLASS, size=72, seed=5
    )
    nobody = f"grpc://127.0.0.1:{free_port()}"  # nothing listens there
    job = _job(nobody, store=str(tmp_path), retry_budget_s=2)

    history = job.fit(1, lr=0.05)

    assert [e.samples for e in history.epochs] == [SAMPLES]
    assert history.fallbacks  # every chunk read from the store and computed here
    kinds = [e.kind for e in history.events]
    assert kinds[0] == "plan-aside" and "plan-deferred" in kinds, kinds
    assert "training starts on the freeze cut" in history.of_kind("plan-aside")[0].message
    deferred = history.of_kind("plan-deferred")[0]
    assert "ServerUnavailable" in deferred.data["error"]
    assert "training goes on on the freeze cut" in deferred.message
    assert job.cut == job.freeze
    with pytest.raises(ServerUnavailable, match="unreachable"):
        job.plan  # noqa: B018  (asked for, it is measured: within the retry budget)


@pytest.mark.slow
@pytest.mark.s3
def test_a_store_away_while_the_plan_is_measured_delays_the_plan_not_the_job(
    tmp_path: Path,
) -> None:
    with SeaweedS3(tmp_path / "weed") as store:
        uri = store.new_bucket()
        synth_dataset(
            open_store(uri, store.options), "train", classes=CLASSES, per_class=PER_CLASS,
            size=72, seed=5,
        )  # fmt: skip
        running = ServeProcess(uri, free_port(), store.client_env)
        running.start("--batch-size", "4")
        try:
            running.wait_ready()
            job = _job(running.address, retry_budget_s=120)
            job.manifest("train")  # listed: the outage lands on the plan's probes
            store.stop()
            back = threading.Timer(2.0, store.start)
            back.start()
            try:
                history = job.fit(1, lr=0.05)
            finally:
                back.join()
        finally:
            running.stop()

    assert [e.samples for e in history.epochs] == [SAMPLES]
    kinds = [e.kind for e in history.events]
    assert kinds[0] == "plan-aside" and "plan-deferred" in kinds, kinds
    assert "StoreUnavailable" in history.of_kind("plan-deferred")[0].data["error"]
