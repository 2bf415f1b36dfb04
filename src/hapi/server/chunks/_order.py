"""`SendOrder`: the chunk streams on one connection take it in order, the lowest first.

The streams of a lane (one client connection, named by the caller) send in the order of
their (epoch, chunk): before its first batch a stream waits while a lower stream of its
lane is still sending, never for a higher one, so the waits cannot form a cycle. A lower
stream that shows no progress for `stall_s` stops holding the others back. Why reading in
order is not enough, with the measurements: docs/server.md, "The send order of a
connection's chunk streams".
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager

__all__ = ["SendOrder"]

STALL_S = 10.0
"""How long a lower stream may show no progress before it stops holding others back: a
batch's write blocks while the link carries it (a raw batch of 4 MiB at 5 Mbit/s, 6.7 s)."""
_POLL_S = 0.1
"""How often a waiting stream checks whether its client went away."""


class _Stream:
    __slots__ = ("order", "progress")

    def __init__(self, order: tuple[int, int], now: float) -> None:
        self.order, self.progress = order, now


class SendOrder:
    """The order in which each lane's streams send (see the module's note).

    Args:
        stall_s: how long a lower stream may show no progress and still hold others.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(
        self, stall_s: float = STALL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.stall_s, self._clock = stall_s, clock
        self._cond = threading.Condition()
        self._lanes: dict[Hashable, dict[int, _Stream]] = {}
        self._ids = itertools.count()

    @contextmanager
    def stream(
        self, lane: Hashable, epoch: int, chunk: int, *, gone: Callable[[], bool] = lambda: False
    ) -> Iterator[Callable[[], None]]:
        """Register chunk (`epoch`, `chunk`)'s stream on `lane` while the block runs.

        Yields `send`: call it before each batch the stream sends. The first call waits
        for the stream's turn (or for `gone()`: its client left); every call is progress,
        which the streams waiting on this one see.
        """
        me = next(self._ids)
        with self._cond:
            streams = self._lanes.setdefault(lane, {})
            streams[me] = stream = _Stream((epoch, chunk), self._clock())
        started = False

        def send() -> None:
            nonlocal started
            if not started:
                self._wait_turn(streams, stream, gone)
                started = True
            with self._cond:
                stream.progress = self._clock()

        try:
            yield send
        finally:
            with self._cond:
                del streams[me]
                if not streams:
                    del self._lanes[lane]
                self._cond.notify_all()

    def lanes(self) -> int:
        """Lanes with a stream registered now."""
        with self._cond:
            return len(self._lanes)

    def _wait_turn(
        self, streams: dict[int, _Stream], me: _Stream, gone: Callable[[], bool]
    ) -> None:
        with self._cond:
            while not gone():
                now = self._clock()
                if not any(
                    s.order < me.order and now - s.progress < self.stall_s for s in streams.values()
                ):
                    return
                # Woken when a stream ends; the poll sees a stall or the client leaving.
                self._cond.wait(_POLL_S)
