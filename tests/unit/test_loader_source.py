"""The loader's concurrency against an in-memory server (`MemorySource`): windows, epochs
back to back, recall, failover, retries, lost sessions, the trainer's cache - and every
key exactly once per epoch, in the seeded order."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from hapi.cache import FeatureCache, FeatureSpace
from hapi.client import FeatureLoader
from hapi.client.pipeline.trainer_cache import TrainerCache
from hapi.client.servers.memory import MemorySource, feature_of
from hapi.client.servers.sessions import Sessions
from hapi.data import DatasetManifest, Transforms
from hapi.errors import InvalidRequest, ServerUnavailable, StoreUnavailable, StreamRecalled
from hapi.wire import ChunkTicket, SessionRequest

KEYS = tuple(f"d/c{i % 2}/{i:02d}.jpg" for i in range(23))
MANIFEST = DatasetManifest(
    "d", KEYS, tuple(i % 2 for i in range(23)), ("c0", "c1"), tuple("v1" for _ in KEYS)
)


def _request(cut: int) -> SessionRequest:
    return SessionRequest(
        model={"name": "resnet18"}, cut=cut, transforms={"ops": []}, image_size=64
    )


def _loader(*sources: MemorySource, **options: object) -> FeatureLoader:
    settings: dict[str, object] = {"batch_size": 5, "chunk_size": 4, "prefetch": 2, "cut": 1}
    settings.update(options)
    sessions = [Sessions(s, _request, keepalive_s=None) for s in sources]
    return FeatureLoader(sources[0], sessions, MANIFEST, **settings)  # type: ignore[arg-type]


def _epoch(loader: FeatureLoader, epoch: int, **kw: object) -> list[str]:
    keys: list[str] = []
    for batch in loader.batches(epoch, **kw):  # type: ignore[arg-type]
        for key, row in zip(batch.keys, batch.features, strict=True):
            assert torch.equal(row, feature_of(key)), key
        keys += batch.keys
    return keys


def _in_order(loader: FeatureLoader, epoch: int) -> list[str]:
    return [KEYS[j] for j in loader.order(epoch)]


def _eventually(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture
def source() -> MemorySource:
    return MemorySource()


def test_every_key_once_in_the_seeded_order_epochs_back_to_back(source: MemorySource) -> None:
    loader = _loader(source)
    ahead = False
    with loader.servers:
        first = []
        for step, batch in enumerate(loader.batches(0, then=1)):
            first += batch.keys
            if step == len(loader) - 1:
                # The last batch, held: the next epoch's requests go out meanwhile (from
                # the fetching threads, so they are waited for).
                ahead = _eventually(lambda: any(t.epoch == 1 for t in source.tickets))
        second = _epoch(loader, 1)
    assert first == _in_order(loader, 0) and second == _in_order(loader, 1)
    assert first != second
    assert ahead, "the next epoch was not fetched while this one drained"
    assert source.opened == ["mem-0"] and source.closed == ["mem-0"]


def test_streams_in_flight_stay_within_the_window(source: MemorySource) -> None:
    source.part_delay_s = 0.002
    loader = _loader(source, prefetch=2)
    with loader.servers:
        batches = loader.batches(0)
        next(batches)  # held, not trained: the loader reads ahead up to its windows
        time.sleep(0.2)
        issued = len(source.tickets)
        rest = [k for b in batches for k in b.keys]
    assert source.max_open == 2
    # Chunk 0 was handed on whole; not yet handed on: K in flight, plus the chunks a
    # training batch spans and one (5 samples of chunks of 4 -> 3): 2 + 3.
    assert 2 < issued - 1 <= 5
    assert len(rest) == 23 - 5


def test_a_recall_asks_again_for_what_was_not_delivered() -> None:
    source = MemorySource(batch_size=2)
    loader = _loader(source)
    recalled = threading.Event()

    def recall_once(ticket: ChunkTicket, part: int) -> None:
        if ticket.chunk == 2 and part == 1 and not recalled.is_set():
            recalled.set()
            loader.recall()

    source.on_part = recall_once
    with loader.servers:
        keys = _epoch(loader, 0)
    assert keys == _in_order(loader, 0)
    again = [t for t in source.tickets if t.chunk == 2]
    assert len(again) == 2 and len(again[1].keys) == len(again[0].keys) - source.batch_size


def _until_fired(failing: MemorySource) -> Callable[[ChunkTicket, int], None]:
    """An `on_part` that holds a server's first part until `failing` has failed a stream.

    The held chunk keeps that server busy, so the next chunks go to `failing` and its
    fault fires whatever the load: a fast in-memory server otherwise finishes each chunk
    before the next is placed, and takes them all."""

    def hold(ticket: ChunkTicket, part: int) -> None:
        _eventually(lambda: failing.faults_fired > 0)

    return hold


def test_a_failed_server_hands_its_chunks_to_another() -> None:
    a = MemorySource(address="memory://a", batch_size=2)
    b = MemorySource(address="memory://b", batch_size=2)
    b.fail_next(ServerUnavailable("memory://b went away"), after=1)
    a.on_part = _until_fired(b)
    loader = _loader(a, b)
    with loader.servers:
        keys = _epoch(loader, 0)
    assert keys == _in_order(loader, 0)
    assert loader.stats.failovers >= 1
    moved = {k for t in a.tickets for k in t.keys} & {k for t in b.tickets for k in t.keys}
    assert moved, "no chunk went from b to a"


def test_a_fault_is_spent_only_when_it_fires() -> None:
    """A stream recalled before its fault's part hands the fault on: a test that recalls
    never races the failure it asked for."""
    source = MemorySource(batch_size=2)
    source.fail_next(ServerUnavailable("gone"), after=1)
    session = source.open_session(_request(1)).session
    ticket = ChunkTicket(session=session, chunk=0, keys=list(KEYS[:4]), labels=[0] * 4)
    first = iter(source.stream(ticket))
    next(first)
    assert source.recall()
    with pytest.raises(StreamRecalled):
        next(first)
    second = iter(source.stream(ticket))
    next(second)
    with pytest.raises(ServerUnavailable, match="gone"):
        next(second)
    assert list(source.stream(ticket)), "spent: the third stream is whole"


def test_a_store_away_for_a_moment_is_retried(source: MemorySource) -> None:
    source.fail_next(StoreUnavailable("the store is away"), times=2)
    loader = _loader(source, retry_budget_s=30.0)
    with loader.servers:
        assert _epoch(loader, 0) == _in_order(loader, 0)
    assert loader.stats.retries == 2


def test_past_the_retry_budget_the_epoch_fails(source: MemorySource) -> None:
    source.fail_next(ServerUnavailable("down"), times=1000)
    loader = _loader(source, retry_budget_s=0.3)
    with loader.servers, pytest.raises(ServerUnavailable, match="down"):
        _epoch(loader, 0)


def test_a_lost_session_is_opened_again(source: MemorySource) -> None:
    loader = _loader(source)

    def forget(ticket: ChunkTicket, part: int) -> None:
        if ticket.chunk == 3 and part == 0 and len(source.opened) == 1:
            source.forget_sessions()
            source.fail_next(ServerUnavailable("restarted"))

    source.on_part = forget
    with loader.servers:
        assert _epoch(loader, 0) == _in_order(loader, 0)
    assert len(source.opened) == 2


def test_skipped_keys_are_reported_and_the_rest_delivered(source: MemorySource) -> None:
    source.skip = {KEYS[4], KEYS[9]}
    loader = _loader(source)
    with loader.servers:
        keys = _epoch(loader, 0)
    assert keys == [k for k in _in_order(loader, 0) if k not in source.skip]
    assert {s.key for s in loader.stats.skipped} == source.skip


def test_the_trainers_cache_serves_later_epochs_in_order(
    source: MemorySource, tmp_path: Path
) -> None:
    transforms = Transforms.eval(64)
    space = FeatureSpace("head", 1, transforms.to_dict(), "fp32", False)
    cache = TrainerCache(FeatureCache(tmp_path), space, transforms, "fp32")
    loader = _loader(source, cache=cache)
    with loader.servers:
        assert _epoch(loader, 0, then=1) == _in_order(loader, 0)
        asked = len(source.tickets)
        assert _epoch(loader, 1) == _in_order(loader, 1)
    assert loader.stats.cached == 23
    assert all(t.epoch == 0 for t in source.tickets[:asked])
    assert len(source.tickets) == asked, "a cached epoch asked the server"
    assert all(t.versions == ["v1"] * len(t.keys) for t in source.tickets)


def _keys(batches: Iterator[object]) -> list[str]:
    return [k for b in batches for k in b.keys]  # type: ignore[attr-defined]


def _cached_loader(source: MemorySource, root: Path, max_bytes: int = 10 << 20) -> FeatureLoader:
    transforms = Transforms.eval(64)
    space = FeatureSpace("head", 1, transforms.to_dict(), "fp32", False)
    cache = TrainerCache(
        FeatureCache(root, max_bytes=max_bytes, memory_bytes=0), space, transforms, "fp32"
    )
    return _loader(source, cache=cache)


def test_a_resumed_epoch_takes_what_is_left_from_the_cache(
    source: MemorySource, tmp_path: Path
) -> None:
    loader = _cached_loader(source, tmp_path)
    with loader.servers:
        _epoch(loader, 0)
        asked = len(source.tickets)
        assert _epoch(loader, 1, start=7) == _in_order(loader, 1)[7:]
    assert loader.stats.cached == 23 - 7 and len(source.tickets) == asked


def test_eviction_under_a_small_bound_never_breaks_an_epoch(
    source: MemorySource, tmp_path: Path
) -> None:
    loader = _cached_loader(source, tmp_path, max_bytes=600)  # room for a few entries
    with loader.servers:
        for epoch in range(3):
            assert _epoch(loader, epoch, then=epoch + 1 if epoch < 2 else None) == _in_order(
                loader, epoch
            )
    cache = loader.cache
    assert cache is not None and cache.cache.stats.evictions > 0
    assert cache.cache.stats.bytes_held <= 600


def test_two_writers_of_the_same_entries_leave_whole_ones(tmp_path: Path) -> None:
    space = FeatureSpace("head", 1, {}, "fp32", False)
    names = [f"{i:032x}" for i in range(40)]
    rows = [feature_of(n) for n in names]

    def write() -> None:
        FeatureCache(tmp_path, memory_bytes=0).put_many(space, names, rows)

    threads = [threading.Thread(target=write) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    reader = FeatureCache(tmp_path, memory_bytes=0)
    got = reader.get_many(space, names)
    assert all(g is not None and torch.equal(r, g) for r, g in zip(rows, got, strict=True))
    assert reader.stats.corrupt == 0


def test_the_cache_fills_through_failover_and_recall(tmp_path: Path) -> None:
    a = MemorySource(address="memory://a", batch_size=2)
    b = MemorySource(address="memory://b", batch_size=2)
    b.fail_next(ServerUnavailable("memory://b went away"), after=1)
    transforms = Transforms.eval(64)
    space = FeatureSpace("head", 1, transforms.to_dict(), "fp32", False)
    cache = TrainerCache(FeatureCache(tmp_path, memory_bytes=0), space, transforms, "fp32")
    loader = _loader(a, b, cache=cache)
    recalled = threading.Event()

    def recall_once(ticket: ChunkTicket, part: int) -> None:
        if ticket.chunk == 3 and part == 1 and not recalled.is_set():
            recalled.set()
            loader.recall()

    def hold_then_recall(ticket: ChunkTicket, part: int) -> None:
        _until_fired(b)(ticket, part)
        recall_once(ticket, part)

    a.on_part, b.on_part = hold_then_recall, recall_once
    with loader.servers:
        assert _epoch(loader, 0, then=1) == _in_order(loader, 0)
        assert loader.stats.failovers >= 1 and recalled.is_set()
        asked = len(a.tickets) + len(b.tickets)
        assert _epoch(loader, 1) == _in_order(loader, 1)
    assert loader.stats.cached == 23 and len(a.tickets) + len(b.tickets) == asked


def test_a_resumed_epochs_chunks_keep_the_epochs_boundaries(source: MemorySource) -> None:
    loader = _loader(source)
    whole = [keys for keys, _ in loader.chunks(0)]
    resumed = [keys for keys, _ in loader.chunks(0, start=7)]
    # The rest of the chunk it stopped in, then the epoch's own chunks from there on.
    assert resumed[0] == whole[1][3:] and resumed[1:] == whole[2:]


def test_the_loaders_state_resumes_where_the_batches_handed_on_stopped(
    source: MemorySource,
) -> None:
    loader = _loader(source)
    with loader.servers:
        taken: list[str] = []
        batches = loader.batches(0)
        for _ in range(2):
            taken += next(batches).keys
        state = loader.state_dict()
        batches.close()  # stopped mid-epoch, as by a crash after two steps
    assert state == {"epoch": 0, "position": len(taken)} and len(taken) == 10

    again = _loader(MemorySource())
    again.load_state_dict(state)
    with again.servers:
        rest = _epoch(again, 0)
        # The same order's remaining places, once; then the next epoch from its start.
        assert taken + rest == _in_order(again, 0)
        assert again.state_dict() == {"epoch": 1, "position": 0}
        assert _epoch(again, 1) == _in_order(again, 1)
        # A state of another epoch does not cut into this one.
        again.load_state_dict({"epoch": 5, "position": 3})
        assert len(_epoch(again, 2)) == len(KEYS)


@pytest.mark.parametrize("state", [{}, {"epoch": "x", "position": 0}, {"epoch": 0, "position": -1}])
def test_a_state_that_is_not_a_loaders_is_refused(state: dict[str, object]) -> None:
    with pytest.raises(InvalidRequest, match="state"):
        _loader(MemorySource()).load_state_dict(state)  # type: ignore[arg-type]
