"""`SendOrder`: the streams on one connection send in chunk order, and nothing deadlocks."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from hapi.server.chunks._order import SendOrder


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _eventually(check: Callable[[], bool]) -> None:
    """Wait (up to 5 s) for `check()`: threads on a busy machine take their time."""
    deadline = time.monotonic() + 5
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


class _Sender:
    """A thread that registers chunk `chunk` on `lane`, waits for its first send and
    logs it; its stream ends at `end()`."""

    def __init__(self, order: SendOrder, lane: str, chunk: int, log: list[str], **kw: Any):
        registered, self.release = threading.Event(), threading.Event()

        def run() -> None:
            with order.stream(lane, 0, chunk, **kw) as send:
                registered.set()
                send()
                log.append(f"send {chunk}")
                self.release.wait(10)
            log.append(f"end {chunk}")

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert registered.wait(5)

    def end(self) -> None:
        self.release.set()
        self.thread.join(5)


def test_a_stream_sends_only_after_the_lower_streams_on_its_lane_ended() -> None:
    order, log = SendOrder(), list[str]()
    low = _Sender(order, "conn", 0, log)
    _eventually(lambda: log == ["send 0"])
    high = _Sender(order, "conn", 1, log)
    time.sleep(0.3)
    assert log == ["send 0"]  # chunk 1 waits while chunk 0 is still sending
    low.end()
    _eventually(lambda: log == ["send 0", "end 0", "send 1"])
    high.end()
    assert order.lanes() == 0


def test_a_lower_stream_never_waits_for_a_higher_one() -> None:
    # Chunk 1's request overtook chunk 0's: it sends at once (nothing lower is there),
    # and chunk 0, arriving after it, does not wait for it either.
    order, log = SendOrder(), list[str]()
    high = _Sender(order, "conn", 1, log)
    low = _Sender(order, "conn", 0, log)
    _eventually(lambda: sorted(log) == ["send 0", "send 1"])
    low.end()
    high.end()


def test_lanes_do_not_wait_for_each_other() -> None:
    order, log = SendOrder(), list[str]()
    first = _Sender(order, "conn-a", 0, log)
    other = _Sender(order, "conn-b", 5, log)
    _eventually(lambda: sorted(log) == ["send 0", "send 5"])
    assert order.lanes() == 2
    first.end()
    other.end()
    assert order.lanes() == 0


def test_a_lower_stream_without_progress_stops_holding_the_others() -> None:
    # A client that reads out of order (or left without cancelling) leaves chunk 0's
    # stream stuck: after `stall_s` without progress, chunk 1 goes anyway.
    clock = _Clock()
    order, log = SendOrder(stall_s=5.0, clock=clock), list[str]()
    low = _Sender(order, "conn", 0, log)
    _eventually(lambda: log == ["send 0"])
    high = _Sender(order, "conn", 1, log)
    clock.now = 4.0
    time.sleep(0.3)
    assert log == ["send 0"]
    clock.now = 5.5  # chunk 0's last progress was its first send, at 0
    _eventually(lambda: log == ["send 0", "send 1"])
    low.end()
    high.end()


def test_progress_keeps_a_slow_lower_stream_ahead() -> None:
    # A lower stream that keeps sending batches, however slowly, keeps its place.
    clock = _Clock()
    order = SendOrder(stall_s=5.0, clock=clock)
    log: list[str] = []
    with order.stream("conn", 0, 0) as send_low:
        send_low()
        high = _Sender(order, "conn", 1, log)
        for t in (4.0, 8.0, 12.0):
            clock.now = t
            send_low()  # a batch each 4 s: progress within the 5 s
            time.sleep(0.2)
            assert log == []
    _eventually(lambda: log == ["send 1"])
    high.end()


def test_a_waiting_stream_whose_client_left_stops_waiting() -> None:
    order, log = SendOrder(), list[str]()
    gone = threading.Event()
    low = _Sender(order, "conn", 0, log)
    _eventually(lambda: log == ["send 0"])
    high = _Sender(order, "conn", 1, log, gone=gone.is_set)
    time.sleep(0.2)
    assert log == ["send 0"]
    gone.set()  # its send() returns; the server's write then fails on the cut call
    _eventually(lambda: log == ["send 0", "send 1"])
    low.end()
    high.end()


def test_streams_of_later_epochs_follow_those_of_earlier_ones() -> None:
    order, log = SendOrder(), list[str]()
    registered = threading.Event()

    def next_epoch() -> None:
        with order.stream("conn", 1, 0) as send:
            registered.set()
            send()
            log.append("epoch 1 chunk 0")

    with order.stream("conn", 0, 7) as send:
        send()
        thread = threading.Thread(target=next_epoch, daemon=True)
        thread.start()
        assert registered.wait(5)
        time.sleep(0.2)
        assert log == []
        log.append("epoch 0 chunk 7 ends")
    thread.join(5)
    assert log == ["epoch 0 chunk 7 ends", "epoch 1 chunk 0"]


@pytest.mark.parametrize("error", [RuntimeError, GeneratorExit])
def test_a_stream_that_fails_gives_up_its_place(error: type[BaseException]) -> None:
    order = SendOrder()
    with pytest.raises(error), order.stream("conn", 0, 0) as send:
        send()
        raise error()
    assert order.lanes() == 0
