"""Chaos: servers killed (-9) and the store stopped at random moments during a 2-server job.

Two `hapi serve` processes read one SeaweedFS store. While the job trains, a chaos thread
kills a server and brings it back a moment later, or stops the store and starts it again
on the same ports and data, at seeded random times. The job must finish every epoch with
every key delivered exactly once (the loader checks each key and raises on a duplicate or
a missing one) and train what an undisturbed run trains.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hapi.client import TransferJob
from hapi.data import open_store, synth_dataset

from ..chaos import Chaos
from ..seaweed import SeaweedS3, free_port
from ..serve_process import ServeProcess

CLASSES, PER_CLASS = 3, 10


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[SeaweedS3, list[ServeProcess]]]:
    with SeaweedS3(tmp_path / "weed") as store:
        uri = store.new_bucket()
        synth_dataset(
            open_store(uri, store.options), "train", classes=CLASSES, per_class=PER_CLASS,
            size=64, seed=9,
        )  # fmt: skip
        env = store.client_env
        taken: set[int] = set()
        servers = [ServeProcess(uri, free_port(taken), env) for _ in range(2)]
        try:
            for server in servers:
                # A shaped link keeps chunks in flight long enough to be cut.
                server.start("--batch-size", "3", "--egress-limit", "1mbit")
            for server in servers:
                server.wait_ready()
            yield store, servers
        finally:
            for server in servers:
                server.stop()


def _job(servers: list[ServeProcess]) -> TransferJob:
    return TransferJob(
        {"name": "resnet18", "num_classes": CLASSES},
        "train",
        [s.address for s in servers],
        freeze="layer3",
        cut="layer3",
        image_size=64,
        batch_size=5,
        chunk_size=3,
        prefetch=2,
        seed=4,
        retry_budget_s=120,
    )


@pytest.mark.slow
def test_a_two_server_job_survives_kills_and_store_outages_with_every_key_once(
    cluster: tuple[SeaweedS3, list[ServeProcess]],
) -> None:
    store, servers = cluster
    reference = _job(servers)
    reference.fit(3, lr=0.05)

    job = _job(servers)
    events = ["kill", "store", "kill", "kill", "store", "kill"]
    with Chaos(servers, store, seed=23, events=events) as chaos:
        history = job.fit(3, lr=0.05)
    assert len(chaos.done) >= 3, chaos.done  # the job outlasted several failures
    samples = CLASSES * PER_CLASS
    assert [e.samples for e in history.epochs] == [samples] * 3
    assert not any(e.skipped for e in history.epochs)
    assert history.retries  # something failed and was asked again
    torch.testing.assert_close(
        torch.tensor(history.losses),
        torch.tensor(reference.history.losses),
        rtol=1e-4,
        atol=1e-4,
    )
