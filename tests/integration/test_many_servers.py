"""A job over several servers: chunks spread over them, and move off one that dies."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hapi.client import TransferJob, connect
from hapi.data import open_store, synth_dataset

from ..seaweed import free_port
from ..serve_process import ServeProcess

SAMPLES = 24


@pytest.fixture
def two(tmp_path: Path) -> Iterator[list[ServeProcess]]:
    # A shaped link keeps each server's chunks in flight a while (48 KB at 2 Mbit/s:
    # 0.2 s), so a server killed mid-epoch has streams to cut and chunks still to come.
    synth_dataset(open_store(tmp_path), "train", classes=3, per_class=8, size=72, seed=5)
    taken: set[int] = set()
    servers = [ServeProcess(tmp_path, free_port(taken)) for _ in range(2)]
    try:
        for server in servers:
            server.start("--batch-size", "3", "--egress-limit", "2mbit")
        for server in servers:
            server.wait_ready()
        yield servers
    finally:
        for server in servers:
            server.stop()


def _job(server: str | list[str], dataset: str = "train", **options: object) -> TransferJob:
    return TransferJob(
        {"name": "resnet18", "num_classes": 3},
        dataset,
        server,
        freeze="layer3",
        cut="layer3",
        image_size=64,
        batch_size=4,
        chunk_size=3,
        prefetch=2,
        seed=3,
        retry_budget_s=60,
        **options,
    )


def _samples_served(server: ServeProcess) -> int:
    stats = connect(server.address).stats()
    return sum(s.samples for s in [*stats.sessions.values(), *stats.closed_sessions.values()])


def test_a_job_over_two_servers_uses_both_and_trains_as_over_one(
    two: list[ServeProcess],
) -> None:
    alone = _job(two[0].address)
    alone.fit(1, lr=0.05)
    before = [_samples_served(s) for s in two]

    job = _job([s.address for s in two])
    (epoch,) = job.fit(1, lr=0.05).epochs
    assert epoch.samples == SAMPLES and epoch.failovers == 0
    served = [_samples_served(s) - b for s, b in zip(two, before, strict=True)]
    assert sum(served) == SAMPLES and min(served) > 0  # both took chunks, no key twice
    # The same samples in the same batches, wherever each chunk was computed.
    torch.testing.assert_close(
        torch.tensor(job.history.losses), torch.tensor(alone.history.losses), rtol=1e-4, atol=1e-4
    )


def test_a_server_killed_mid_epoch_hands_its_chunks_to_the_other(
    two: list[ServeProcess],
) -> None:
    reference = _job([s.address for s in two])
    reference.fit(1, lr=0.05)

    job = _job([s.address for s in two])

    def kill_one(step: int, total: int) -> None:
        if step == 1:
            two[1].kill()  # and it stays dead

    (epoch,) = job.fit(1, lr=0.05, progress=kill_one).epochs
    assert epoch.samples == SAMPLES and not epoch.skipped  # each key once (the loader checks)
    torch.testing.assert_close(
        torch.tensor(job.history.losses),
        torch.tensor(reference.history.losses),
        rtol=1e-4,
        atol=1e-4,
    )
    # The next epoch gives the dead server its share of chunks again (a new loop knows
    # nothing of it): each fails there and moves to the server left.
    after = job.fit(1, lr=0.05).epochs[-1]
    assert after.samples == SAMPLES and after.failovers >= 1
    moved = job.history.failovers
    assert {e.data["from"] for e in moved} == {two[1].address}
    assert {e.data["to"] for e in moved} == {two[0].address}
    assert sum(e.failovers for e in job.history.epochs) == len(moved)


def test_servers_are_named_once_each() -> None:
    from hapi.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="twice"):
        _job(["grpc://127.0.0.1:1", "grpc://127.0.0.1:1"])


def test_with_no_server_left_chunks_are_read_from_the_store_and_computed_here(
    two: list[ServeProcess],
) -> None:
    # 16 chunks of 3: after the first step at most 8 are issued - 4 in flight over two
    # servers, and 4 more as the first 4 are read (the loader reads at most the 2 chunks
    # a batch of 4 spans, plus one, ahead of training) - so the last ones go out to no
    # server. (With 8 chunks all could be issued, read and buffered by then.)
    synth_dataset(open_store(two[0].store), "long", classes=3, per_class=16, size=72, seed=5)
    samples = 48
    reference = _job(two[0].address, "long")
    reference.fit(1, lr=0.05)
    reference.fit(1, lr=0.05)  # as the job below: a fit's optimizer starts anew

    job = _job([s.address for s in two], "long", store=two[0].store)

    def kill_both(step: int, total: int) -> None:
        if step == 1:
            for server in two:
                server.kill()  # and they stay dead

    first = job.fit(1, lr=0.05, progress=kill_both).epochs[-1]
    second = job.fit(1, lr=0.05).epochs[-1]
    assert first.samples == second.samples == samples
    assert first.fallbacks >= 1
    assert second.fallbacks == 16  # every chunk of the epoch
    assert sum(e.fallbacks for e in job.history.epochs) == len(job.history.fallbacks)
    # The trainer's own sample pipeline and head: the same losses as the servers'.
    torch.testing.assert_close(
        torch.tensor(job.history.losses),
        torch.tensor(reference.history.losses),
        rtol=1e-4,
        atol=1e-4,
    )
