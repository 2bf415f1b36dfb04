"""What a session's chunks cost the server: its counters, and the reads it waited for."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields

from hapi.wire import SessionStats

__all__ = ["SessionCounters", "TimedReads"]


@dataclass
class SessionCounters:
    """What a session has cost the server so far; `snapshot` is its `SessionStats`."""

    chunks: int = 0
    samples: int = 0
    skipped: int = 0
    abandoned: int = 0
    bytes_read: int = 0
    bytes_sent: int = 0
    read_s: float = 0.0
    transform_s: float = 0.0
    head_s: float = 0.0
    encode_s: float = 0.0
    shaping_wait_s: float = 0.0
    cpu_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **deltas: float) -> None:
        """Add to counters by name; chunks of a session run concurrently."""
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def snapshot(self) -> SessionStats:
        """The counters now, as the wire reports them."""
        with self._lock:
            return SessionStats(
                **{f.name: getattr(self, f.name) for f in fields(self) if f.name != "_lock"}
            )


class TimedReads:
    """The objects of a chunk, counting the time spent waiting for them and their bytes."""

    def __init__(self, objects: Iterable[bytes | BaseException]) -> None:
        self._objects = iter(objects)
        self.waited = 0.0
        self.nbytes = 0

    def __iter__(self) -> Iterator[bytes | BaseException]:
        while True:
            t0 = time.perf_counter()
            data = next(self._objects, None)
            self.waited += time.perf_counter() - t0
            if data is None:
                return
            if isinstance(data, bytes):
                self.nbytes += len(data)
            yield data
