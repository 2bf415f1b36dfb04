"""`Outbox`: the few batches a chunk has computed and its stream has not sent yet.

A chunk computes in a thread of its own and its Flight stream sends from the outbox, so
computing batch k+1 overlaps sending batch k, and a chunk waiting for a slow link holds
no compute slot (it waits on the outbox, not inside a grant).

The consumer is the one that learns its client has gone (only the stream's own thread
may ask gRPC); it closes the outbox, and the producer, which checks `closed` before each
batch, stops: work for nobody ends within the batch being computed.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

__all__ = ["Outbox"]

T = TypeVar("T")

POLL_S = 0.1
"""How often a consumer waiting for an item asks whether it has gone (`Outbox.items`)."""


def _never() -> bool:
    return False


class Outbox(Generic[T]):
    """A bounded queue from one producer to one consumer, either of which may stop.

    Args:
        capacity: items the producer may be ahead of the consumer.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: deque[T] = deque()
        self._cond = threading.Condition()
        self._done = False
        self._error: BaseException | None = None
        self._closed = False

    @property
    def closed(self) -> bool:
        """Whether the consumer has gone (the producer should stop)."""
        return self._closed

    @property
    def room(self) -> bool:
        """Whether an item would fit now."""
        with self._cond:
            return len(self._items) < self.capacity

    def wait_room(self) -> bool:
        """Wait until an item would fit; False when the consumer has gone."""
        with self._cond:
            while not self._closed and len(self._items) >= self.capacity:
                self._cond.wait()
            return not self._closed

    def offer(self, item: T) -> bool:
        """Add `item` if there is room now; False when full (or closed)."""
        with self._cond:
            if self._closed or len(self._items) >= self.capacity:
                return False
            self._items.append(item)
            self._cond.notify_all()
            return True

    def put(self, item: T) -> bool:
        """Add `item`, waiting for room; False when the consumer has gone."""
        with self._cond:
            while not self._closed and len(self._items) >= self.capacity:
                self._cond.wait()
            if self._closed:
                return False
            self._items.append(item)
            self._cond.notify_all()
            return True

    def finish(self, error: BaseException | None = None) -> None:
        """The producer is done: with `error`, the consumer raises it after the items."""
        with self._cond:
            self._done, self._error = True, error
            self._cond.notify_all()

    def close(self) -> None:
        """The consumer is done; a waiting `put` returns False."""
        with self._cond:
            self._closed = True
            self._items.clear()
            self._cond.notify_all()

    def __iter__(self) -> Iterator[T]:
        """The items as they come, until the producer finishes (raising its error)."""
        return self.items()

    def items(self, gone: Callable[[], bool] = _never, poll_s: float = POLL_S) -> Iterator[T]:
        """The items as they come, until the producer finishes (raising its error) or,
        while waiting for one, `gone()` says the consumer's client left: then the outbox
        closes (the producer stops) and the items end early (`closed` tells which).

        Args:
            gone: asked every `poll_s` while no item is ready, outside the lock, from the
                consumer's thread (a gRPC call context may be asked from its own only).
            poll_s: seconds between its calls.
        """
        while True:
            with self._cond:
                if not self._items and not self._done:
                    self._cond.wait(poll_s)
                ready = bool(self._items)
                if ready:
                    item = self._items.popleft()
                    self._cond.notify_all()
                elif self._done:
                    if self._error is not None:
                        raise self._error
                    return
            if ready:
                yield item
            elif gone():
                self.close()
                return
