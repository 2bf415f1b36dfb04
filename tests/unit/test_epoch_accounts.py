"""Epoch accounting (`EpochAccounts`) over a loader on an in-memory server: epochs add up to
the loop's time, the servers' time comes from their reports or else their counters, and
receiving is the trainer's busy time on one core."""

from __future__ import annotations

import time

import pytest

from hapi.client import FeatureLoader
from hapi.client.job._epochs import EpochAccounts
from hapi.client.pipeline.history import EpochStats
from hapi.client.servers.memory import MemorySource
from hapi.client.servers.sessions import Sessions
from hapi.data import DatasetManifest
from hapi.wire import SessionRequest

KEYS = tuple(f"d/c{i % 2}/{i:02d}.jpg" for i in range(23))
MANIFEST = DatasetManifest("d", KEYS, tuple(i % 2 for i in range(23)), ("c0", "c1"))
PER_KEY_S = 0.001


def _request(cut: int) -> SessionRequest:
    return SessionRequest(model={"name": "resnet18"}, cut=cut, transforms={"ops": []})


def _loader(source: MemorySource) -> FeatureLoader:
    sessions = Sessions(source, _request, keepalive_s=None)
    return FeatureLoader(source, sessions, MANIFEST, batch_size=5, chunk_size=4, cut=1)


def _run(
    loader: FeatureLoader, accounts: EpochAccounts, epoch: int, then: int | None = None
) -> EpochStats:
    seen = sum(len(batch) for batch in loader.batches(epoch, then=then))
    return accounts.close(epoch, cut=1, share=0.0, loss=0.0, correct=0.0, seen=seen, compute=0.0)


def test_receiving_is_the_trainers_busy_time_on_one_core() -> None:
    """The process's CPU beyond training and decoding is receiving the streams: part of
    the trainer's busy time when the trainer has one core, beside it with more."""
    for one_core in (True, False):
        loader = _loader(MemorySource())
        with loader.servers:
            epoch = _run(loader, EpochAccounts(loader, one_core=one_core), 0)
        # No training step here: the process's CPU on the epoch was all receiving.
        assert epoch.receive_s > 0.0 and epoch.samples == 23
        busy = epoch.compute_s + epoch.decode_s
        assert epoch.trainer_s == pytest.approx(busy + epoch.receive_s if one_core else busy)


def test_epochs_add_up_to_the_loops_time_and_ask_the_servers_nothing_between_them() -> None:
    """Each epoch's window starts where the one before it ended, so what runs between
    epochs is counted; and servers that report their time with each chunk are asked for
    their counters once, before anything is in flight (behind an epoch fetched ahead, a
    stats call waits a second at 10 Mbit/s, and the trainer with it)."""
    source = MemorySource(server_s_per_key=PER_KEY_S)
    loader = _loader(source)
    epochs = []
    with loader.servers:
        began = time.perf_counter()
        accounts = EpochAccounts(loader)
        for epoch in range(3):
            epochs.append(_run(loader, accounts, epoch, then=epoch + 1 if epoch < 2 else None))
            time.sleep(0.1)  # after an epoch's end, its bookkeeping: the next epoch's time
        elapsed = time.perf_counter() - began
    assert all(e.seconds >= 0.1 for e in epochs[1:])
    assert sum(e.seconds for e in epochs) <= elapsed - 0.1  # the last sleep is no epoch's
    assert source.stats_calls == 1
    assert [e.server_s for e in epochs] == pytest.approx([23 * PER_KEY_S] * 3)


def test_a_server_that_does_not_report_per_chunk_is_timed_by_its_counters() -> None:
    source = MemorySource(server_s_per_key=PER_KEY_S, reports_time=False)
    loader = _loader(source)
    with loader.servers:
        accounts = EpochAccounts(loader)
        epochs = [_run(loader, accounts, epoch) for epoch in range(2)]
    # Each epoch's difference of the session's CPU counters.
    assert [e.server_s for e in epochs] == pytest.approx([23 * PER_KEY_S] * 2)
    assert source.stats_calls == 3  # before the first epoch, and after each
