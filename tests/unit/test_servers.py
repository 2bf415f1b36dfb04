"""`Servers`: which server takes each chunk, and a failed server set aside and taken back."""

from __future__ import annotations

import heapq

import pytest

from hapi.client import connect
from hapi.client.servers.pool import MAX_COOLDOWN_S, Servers
from hapi.client.servers.sessions import Sessions
from hapi.errors import InvalidRequest


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _servers(n: int, clock: _Clock | None = None) -> Servers:
    # Connections are lazy: nothing here reaches a server.
    sessions = [Sessions(connect(f"grpc://127.0.0.1:{9000 + i}"), None) for i in range(n)]
    return Servers(sessions, clock=clock or _Clock())


def _keys(chunk: int, n: int = 8, prefix: str = "train/a") -> list[str]:
    return [f"{prefix}/{chunk}-{i}.jpg" for i in range(n)]


def test_chunks_spread_in_proportion_to_the_measured_rates() -> None:
    clock = _Clock()
    servers = _servers(2, clock)
    rates = {0: 30.0, 1: 10.0}  # samples/s
    for member in servers:  # a finish of nothing starts each one's measured time
        servers.finished(member, 0, 0, measured=True)
    clock.now += 1.0
    for member in servers:
        servers.finished(member, 0, int(rates[member.index]), measured=True)
    assert [m.rate for m in servers] == [30.0, 10.0]
    # Eight chunks of 8 keys in flight; each server works through its own in order.
    busy_until = {0: 0.0, 1: 0.0}
    running: list[tuple[float, int]] = []
    taken = {0: 0, 1: 0}
    now = 0.0
    for chunk in range(80):
        if len(running) == 8:
            now, index = heapq.heappop(running)
            servers.release(servers.members[index], 8)
        member = servers.pick(_keys(chunk))
        taken[member.index] += 1
        busy_until[member.index] = max(now, busy_until[member.index]) + 8 / rates[member.index]
        heapq.heappush(running, (busy_until[member.index], member.index))
    assert taken[0] == pytest.approx(3 * taken[1], abs=4)


def test_a_rate_is_samples_over_the_time_between_finishes_while_busy() -> None:
    clock = _Clock()
    servers = _servers(1, clock)
    (member,) = servers.members
    servers.pick(_keys(0))
    clock.now += 5.0
    servers.finished(member, 8, 8, measured=True)
    assert member.rate is None  # the first chunk opened the session: not the server's rate
    for _ in range(2):
        servers.pick(_keys(0))  # busy from now
    clock.now += 2.0
    servers.finished(member, 8, 8, measured=True)
    clock.now += 0.001  # the next chunk had arrived meanwhile: finished at once
    servers.finished(member, 8, 8, measured=True)
    assert member.rate == pytest.approx((0.85 * 8 + 8) / (0.85 * 2.0 + 0.001))
    clock.now += 50.0  # idle: no work in flight, so this time does not count
    servers.pick(_keys(1))
    clock.now += 1.0
    servers.finished(member, 8, 8, measured=True)
    d = 0.85
    assert member.rate == pytest.approx((d * d * 8 + d * 8 + 8) / (d * d * 2 + d * 0.001 + 1.0))


def test_a_rate_needs_a_second_of_work() -> None:
    # Streams are read in order: a chunk made while the one before was read finishes
    # right after it. That gap alone is no rate (it made a server seem 30x as fast).
    clock = _Clock()
    servers = _servers(1, clock)
    (member,) = servers.members
    for gap in (5.0, 0.005):
        servers.pick(_keys(0))
        clock.now += gap
        servers.finished(member, 8, 8, measured=True)
    assert member.rate is None
    servers.pick(_keys(0))
    clock.now += 1.0
    servers.finished(member, 8, 8, measured=True)
    assert member.rate == pytest.approx((0.85 * 8 + 8) / (0.85 * 0.005 + 1.0))


def test_a_server_without_a_rate_yet_gets_chunks_as_the_others_average() -> None:
    servers = _servers(3)
    picked = [servers.pick(_keys(c)).index for c in range(6)]
    assert sorted(picked) == [0, 0, 1, 1, 2, 2]  # equal shares before any measurement


def test_chunks_go_to_the_server_that_says_their_keys_are_local() -> None:
    servers = _servers(2)
    servers.members[1].sessions.local_prefixes = ("train/b",)
    local = [servers.pick(_keys(c, prefix="train/b")).index for c in range(12)]
    # Its expected time counts half (LOCAL_GAIN): it takes twice the others' load.
    assert local[0] == 1 and local.count(1) == 8
    elsewhere = servers.pick(_keys(99, prefix="train/a"))
    assert elsewhere.index == 0
    # Segment-wise: `train/bb` is not under `train/b`.
    assert servers.members[1].local_share(["train/bb/x.jpg", "train/b/y.jpg"]) == 0.5


def test_a_failed_server_is_set_aside_then_tried_again() -> None:
    clock = _Clock()
    servers = _servers(2, clock)
    first, second = servers.members
    cooldown = servers.failed(first)
    assert not servers.usable(first) and servers.others_usable(first)
    assert all(servers.pick(_keys(c)) is second for c in range(4))
    clock.now += cooldown
    assert servers.usable(first)
    assert servers.pick(_keys(5)) is first  # back, and the least loaded
    # Failures in a row double the cool-down, up to its limit; a finished chunk resets it.
    assert [servers.failed(first) for _ in range(6)][-1] == MAX_COOLDOWN_S
    servers.finished(first, 0, 0, measured=False)
    assert first.failures == 0


def test_with_every_server_set_aside_a_chunk_goes_to_the_one_back_soonest() -> None:
    clock = _Clock()
    servers = _servers(2, clock)
    first, second = servers.members
    servers.failed(first)
    servers.failed(first)  # a longer cool-down
    servers.failed(second)
    assert servers.pick(_keys(0)) is second
    assert servers.pick(_keys(1), avoid=second) is second  # no other is closer to coming back


def test_one_server_twice_is_refused() -> None:
    one = connect("grpc://127.0.0.1:9000")
    with pytest.raises(InvalidRequest, match="twice"):
        Servers([Sessions(one, None), Sessions(connect("grpc://127.0.0.1:9000"), None)])
    with pytest.raises(InvalidRequest, match="at least one"):
        Servers([])
