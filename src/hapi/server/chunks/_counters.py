"""What a session's chunks cost the server: its counters, and the reads it waited for."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator

from hapi.data.shards.blob import Blob
from hapi.wire import SessionStats

__all__ = ["SessionCounters", "TimedReads"]


class SessionCounters:
    """What a session has cost the server so far: one counter per field of `SessionStats`
    (the wire's schema is the only list of them); `snapshot` is its `SessionStats`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = {
            name: info.default for name, info in SessionStats.model_fields.items()
        }

    def add(self, **deltas: float) -> None:
        """Add to counters by name; chunks of a session run concurrently.

        Raises:
            KeyError: a name that is not a field of `SessionStats`.
        """
        with self._lock:
            for name, delta in deltas.items():
                self._values[name] += delta

    def snapshot(self) -> SessionStats:
        """The counters now, as the wire reports them."""
        with self._lock:
            return SessionStats.model_validate(self._values)


class TimedReads:
    """The objects of a chunk, counting the time spent waiting for them and their bytes."""

    def __init__(self, objects: Iterable[Blob | BaseException]) -> None:
        self._objects = iter(objects)
        self.waited = 0.0
        self.nbytes = 0

    def __iter__(self) -> Iterator[Blob | BaseException]:
        while True:
            t0 = time.perf_counter()
            data = next(self._objects, None)
            self.waited += time.perf_counter() - t0
            if data is None:
                return
            if not isinstance(data, BaseException):
                self.nbytes += len(data)
            yield data
