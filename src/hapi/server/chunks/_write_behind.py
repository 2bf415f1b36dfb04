"""`WriteBehind`: a server's computed features written to its feature cache from a thread
of their own, so a stream never waits for the disk."""

from __future__ import annotations

import logging
import threading
from collections import deque

import torch

from hapi.cache import FeatureCache, FeatureSpace

__all__ = ["WRITE_BEHIND_BYTES", "WriteBehind"]

log = logging.getLogger("hapi.server")

WRITE_BEHIND_BYTES = 32 << 20
"""Features waiting for the writer at most; beyond it a miss is not stored (and misses
again), so a slow disk never holds a stream or the server's memory."""


class WriteBehind:
    """Writes offered features into the cache from a thread of its own, started on the
    first offer; what would pass `WRITE_BEHIND_BYTES` waiting is dropped."""

    def __init__(self, cache: FeatureCache, max_bytes: int = WRITE_BEHIND_BYTES) -> None:
        self.cache = cache
        self.max_bytes = max_bytes
        self.dropped = 0
        self._queue: deque[tuple[FeatureSpace, list[str], list[torch.Tensor], int]] = deque()
        self._pending = 0
        self._busy = False
        self._closed = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def offer(self, space: FeatureSpace, names: list[str], tensors: list[torch.Tensor]) -> bool:
        """Queue entries to write; False (and dropped) when closed or too much waits."""
        if not self.cache.writing:
            # The directory refused a write: counted there, and nothing more is queued.
            self.cache.put_many(space, names, tensors)
            return False
        size = sum(t.numel() * t.element_size() for t in tensors)
        with self._cond:
            if self._closed or self._pending + size > self.max_bytes:
                self.dropped += len(names)
                return False
            self._queue.append((space, names, tensors, size))
            self._pending += size
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="hapi-feature-cache-writer", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return  # closed, and all written
                space, names, tensors, size = self._queue.popleft()
                self._busy = True
            try:
                self.cache.put_many(space, names, tensors)
            except Exception:  # a bug, not the disk (the cache handles refused writes)
                log.exception("feature cache %s: a write failed", self.cache.root)
            finally:
                with self._cond:
                    self._pending -= size
                    self._busy = False
                    self._cond.notify_all()

    def flush(self) -> None:
        """Wait until everything queued is written."""
        with self._cond:
            while self._queue or self._busy:
                self._cond.wait()

    def close(self) -> None:
        """Write what is queued, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
