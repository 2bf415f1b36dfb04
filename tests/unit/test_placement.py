"""Where keys lie beside servers (`Placement`), epochs grouped by home (`home_order`), and
chunks sent to the server beside their bytes (`Servers.pick`)."""

from __future__ import annotations

import numpy as np
import pytest

from hapi.client import FeatureLoader
from hapi.client.pipeline._home_order import WINDOW_CHUNKS, home_order
from hapi.client.servers.memory import MemorySource
from hapi.client.servers.placement import NO_HOME, Backlog, Placement
from hapi.client.servers.pool import Servers
from hapi.client.servers.sessions import Sessions
from hapi.data import DatasetManifest
from hapi.wire import SessionRequest

KEYS = tuple(f"d/c{i % 2}/{i:02d}.jpg" for i in range(40))
MANIFEST = DatasetManifest("d", KEYS, tuple(i % 2 for i in range(40)), ("c0", "c1"), ())


def _request(cut: int) -> SessionRequest:
    return SessionRequest(
        model={"name": "resnet18"}, cut=cut, transforms={"ops": []}, image_size=64
    )


def _homes(n: int, servers: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, servers, n)


def test_home_order_keeps_every_key_once_and_makes_chunks_of_one_home() -> None:
    n, block, servers = 10_000, 64, 3
    homes = _homes(n, servers)
    shuffled = np.random.default_rng(1).permutation(n)
    order = home_order(shuffled, homes, block=block, seed=1, epoch=0)
    assert sorted(order.tolist()) == list(range(n))
    chunks = [order[i : i + block] for i in range(0, n, block)]
    mixed = [j for j, c in enumerate(chunks) if len(set(homes[c].tolist())) > 1]
    # Only the homes' remainders at the epoch's end mix: fewer chunks than homes.
    assert len(mixed) <= servers and all(j >= len(chunks) - servers for j in mixed)
    # Still a shuffle: the chunks' homes alternate, and each window keeps its own keys.
    assert len({int(homes[c[0]]) for c in chunks[:12]}) == servers
    # A key moves about a window at most (its home's remainder waits for the next).
    window = block * servers * WINDOW_CHUNKS
    first = set(order[:window].tolist())
    assert len(first & set(shuffled[:window].tolist())) >= window - servers * block
    assert first <= set(shuffled[: 2 * window].tolist())


def test_home_order_is_the_same_for_the_same_epoch_and_differs_between_epochs() -> None:
    homes = _homes(1000, 2)
    shuffled = np.random.default_rng(2).permutation(1000)
    one = home_order(shuffled, homes, block=10, seed=4, epoch=1)
    assert np.array_equal(one, home_order(shuffled, homes, block=10, seed=4, epoch=1))
    assert not np.array_equal(one, home_order(shuffled, homes, block=10, seed=4, epoch=2))


def test_home_order_keeps_the_short_last_chunk_last() -> None:
    # Chunks are cut at multiples of the block from the start: a short block anywhere
    # but last would put every chunk after it astride two blocks.
    homes = _homes(1005, 3)
    shuffled = np.random.default_rng(3).permutation(1005)
    order = home_order(shuffled, homes, block=10, seed=0, epoch=0)
    chunks = [order[i : i + 10] for i in range(0, 1005, 10)]
    assert len(chunks[-1]) == 5 and sorted(order.tolist()) == list(range(1005))
    assert all(len(set(homes[c].tolist())) == 1 for c in chunks[:-3])


def test_home_order_spreads_each_homes_chunks_so_every_server_has_work_at_once() -> None:
    # A few chunks in flight at a time: each home's chunks evenly spaced, never bunched.
    servers, block = 3, 64
    for seed in range(5):
        homes = _homes(10_000, servers, seed)
        shuffled = np.random.default_rng(seed + 1).permutation(10_000)
        order = home_order(shuffled, homes, block=block, seed=seed, epoch=0)
        firsts = [int(homes[order[i]]) for i in range(0, len(order), block)][:-servers]
        for home in range(servers):
            at = [j for j, h in enumerate(firsts) if h == home]
            assert max(np.diff([-1, *at, len(firsts)])) <= 2 * servers


def test_home_order_ends_every_homes_chunks_together() -> None:
    # Whichever home has the most chunks, each home's last comes in the epoch's last few:
    # no server runs out of its own while another has several left.
    servers, block = 3, 10
    homes = np.array([0] * 200 + [1] * 150 + [2] * 120)
    for epoch in range(5):
        shuffled = np.random.default_rng(epoch).permutation(len(homes))
        order = home_order(shuffled, homes, block=block, seed=0, epoch=epoch)
        firsts = [int(homes[order[i]]) for i in range(0, len(order), block)]
        whole = firsts[: len(homes) // block]
        last = [max(j for j, h in enumerate(whole) if h == home) for home in range(servers)]
        assert min(last) >= len(whole) - servers


def test_home_order_ends_with_chunks_mostly_of_one_home() -> None:
    # 19, 15 and 12 keys: whole chunks of 10 leave 9, 5 and 2, largest first at the end.
    homes = np.array([0] * 19 + [1] * 15 + [2] * 12)
    shuffled = np.random.default_rng(0).permutation(len(homes))
    order = home_order(shuffled, homes, block=10, seed=0, epoch=0)
    last_two = homes[order[30:40]], homes[order[40:]]
    assert np.bincount(last_two[0]).max() == 9 and len(last_two[1]) == 6


def test_a_backlog_counts_each_servers_own_keys_still_to_issue() -> None:
    homes = np.array([0, 0, 1, NO_HOME, 1, 0])
    backlog = Backlog(homes, np.arange(6), servers=3)
    assert backlog.rest.tolist() == [3, 2, 0]
    backlog.issue(np.array([0, 3]))
    assert backlog.ahead(more=False).tolist() == [2, 2, 0]
    # Another epoch follows: its keys are ahead of every server too.
    assert backlog.ahead(more=True).tolist() == [5, 4, 0]


def test_one_home_leaves_the_order_as_it_is() -> None:
    shuffled = np.random.default_rng(3).permutation(100)
    homes = np.zeros(100, dtype=np.int64)
    assert home_order(shuffled, homes, block=10, seed=0, epoch=0) is shuffled


def test_replicas_spread_their_keys_over_the_servers_that_hold_them() -> None:
    # Every key on servers 0 and 1 (a replicated volume), some also on 2 in part.
    local = np.array([[5, 5, 0]] * 100 + [[0, 0, 0]] * 3 + [[2, 0, 7]] * 10)
    placement = Placement(local, local.max(axis=1) + 1)
    homes = placement.homes
    counts = np.bincount(homes[:100], minlength=3)
    assert counts[0] == counts[1] == 50 and counts[2] == 0
    assert (homes[100:103] == NO_HOME).all() and (homes[103:] == 2).all()
    shares = placement.shares(np.arange(100))
    assert shares[0] == shares[1] == pytest.approx(5 / 6) and shares[2] == 0


class _Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def _pool(local_keys: list[set[str] | None], clock: _Clock | None = None) -> Servers:
    sources = [
        MemorySource(address=f"memory://{i}", local_keys=frozenset(k) if k is not None else None)
        for i, k in enumerate(local_keys)
    ]
    return Servers([Sessions(s, None) for s in sources], clock=clock or _Clock())


def test_chunks_go_to_the_server_their_bytes_lie_beside() -> None:
    keys = [f"k{i}" for i in range(12)]
    servers = _pool([set(keys[:6]), set(keys[6:])])
    placement = servers.place(keys)
    assert placement is not None and placement.homes.tolist() == [0] * 6 + [1] * 6
    for start in (0, 6, 3, 9):
        where = np.arange(start, start + 3)
        member = servers.pick(keys[start : start + 3], where=where)
        assert member.index == (start >= 6)
    # Piled up at its home, a chunk goes to the other.
    servers.members[0].inflight = 100
    assert servers.pick(keys[:3], where=np.arange(3)).index == 1


def _rate(servers: Servers, clock: _Clock, index: int, where: np.ndarray, seconds: float) -> None:
    """`index` finishes a chunk of 3 keys at `where` in `seconds` (after a first one)."""
    member = servers.members[index]
    for _ in range(2):  # the first chunk holds the session's opening: not a rate
        servers.pick(["k"] * 3, where=where)
        member.inflight = 3
        clock.now += seconds
        servers.finished(member, 3, 3, measured=True, where=where)


def test_a_server_takes_another_nodes_chunks_as_fast_as_it_reads_them() -> None:
    keys = [f"k{i}" for i in range(12)]
    for remote_s, taken in ((1.0, True), (10.0, False)):
        clock = _Clock()
        servers = _pool([set(keys[:6]), set(keys[6:])], clock)
        assert servers.place(keys) is not None
        home, other = np.arange(3), np.arange(6, 9)
        _rate(servers, clock, 0, home, 1.0)  # 3 samples/s on its own node's chunks
        _rate(servers, clock, 1, other, 1.0)
        assert servers.members[1].remote_rate is None
        servers.members[0].inflight, servers.members[1].inflight = 9, 0
        # Unmeasured, another node's chunk is priced at half the server's own rate, and
        # must end twice as soon as at home (`REMOTE_MARGIN`): it waits at home.
        assert servers.pick(keys[:3], where=home).index == 0
        servers.members[0].inflight = 9
        _rate(servers, clock, 1, home, remote_s)
        assert servers.members[1].remote_rate == pytest.approx(3 / remote_s)
        servers.members[0].inflight, servers.members[1].inflight = 9, 0
        # Read as fast as its own (fast links between nodes): it takes the chunk, 2 s
        # against 4 s at home; read 10x slower (the links bind): the chunk waits at home.
        assert (servers.pick(keys[:3], where=home).index == 1) is taken


def test_an_idle_server_with_its_own_work_ahead_leaves_a_chunk_at_its_home() -> None:
    keys = [f"k{i}" for i in range(12)]
    clock = _Clock()
    servers = _pool([set(keys[:6]), set(keys[6:])], clock)
    assert servers.place(keys) is not None
    home, other = np.arange(3), np.arange(6, 9)
    _rate(servers, clock, 0, home, 1.0)
    _rate(servers, clock, 1, other, 1.0)
    _rate(servers, clock, 1, home, 1.0)  # it reads the other node's bytes as fast
    servers.members[0].inflight, servers.members[1].inflight = 9, 0
    # Both have 39 of their own keys to read from now on (in flight or ahead): moving
    # the chunk would not end the epoch sooner.
    even = np.array([30, 39])
    assert servers.pick(keys[:3], where=home, ahead=even).index == 0
    # The home holds more than its share: the other takes its chunk.
    servers.members[0].inflight = 9
    assert servers.pick(keys[:3], where=home, ahead=np.array([30, 6])).index == 1


def test_without_two_servers_that_know_where_they_are_there_is_no_placement() -> None:
    keys = ["a", "b"]
    assert _pool([{"a"}, None]).place(keys) is None  # one server says, the other cannot
    assert _pool([{"a"}]).place(keys) is None  # one server takes every chunk anyway
    assert _pool([set(), set()]).place(keys) is None  # no byte lies beside any


def _located_loader(local: list[set[str]], **options: object) -> FeatureLoader:
    sources = [
        MemorySource(address=f"memory://{i}", local_keys=frozenset(keys))
        for i, keys in enumerate(local)
    ]
    sessions = [Sessions(s, _request, keepalive_s=None) for s in sources]
    return FeatureLoader(
        sources[0], sessions, MANIFEST, batch_size=4, chunk_size=4, prefetch=2, cut=1, **options
    )  # type: ignore[arg-type]


def test_a_loader_groups_its_epochs_by_home_and_trains_each_key_once() -> None:
    half = set(KEYS[:20])
    loader = _located_loader([half, set(KEYS) - half])
    homes = loader.homes()
    assert homes is not None and homes.tolist() == [0] * 20 + [1] * 20
    order = loader.order(0)
    chunks = [order[i : i + 4] for i in range(0, len(order), 4)]
    assert all(len({int(homes[j]) for j in c}) == 1 for c in chunks)
    keys = [k for batch in loader.batches(0) for k in batch.keys]
    assert sorted(keys) == sorted(KEYS)
    placed = {m.index: m for m in loader.servers}
    served = [{k for t in placed[i].connection.tickets for k in t.keys} for i in (0, 1)]  # type: ignore[attr-defined]
    # Each server read its own keys; one may also take the other's chunks, at the rate
    # it measures doing so (timing here: the deterministic cases are `pick`'s tests).
    assert served[0] | served[1] == set(KEYS)
    assert served[0] & half and served[1] - half


def test_a_later_loop_given_the_homes_orders_as_the_first_whatever_the_servers_say() -> None:
    # The servers listed the other way round: the same keys, other home numbers.
    half = set(KEYS[:20])
    first = _located_loader([half, set(KEYS) - half])
    homes = first.homes()
    swapped = _located_loader([set(KEYS) - half, half])
    assert not np.array_equal(swapped.order(1), first.order(1))
    again = _located_loader([set(KEYS) - half, half], homes=homes)
    assert np.array_equal(again.order(1), first.order(1))
