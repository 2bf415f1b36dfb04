"""`ChunkTally`: what the job's own chunks at one cut cost their server, for a plan
measured while the job trains on that cut (`PlanInForce`, a job measured for the first
time): its chunks are the probe at that cut, and the server computes nothing extra.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from hapi.plan import ReadMeasurement

__all__ = ["ChunkTally", "ChunkTotals"]


@dataclass(frozen=True)
class ChunkTotals:
    """The chunks tallied, summed."""

    chunks: int
    samples: int
    bytes: int
    server_s: float
    """The server's busy time on them, as their reports said."""


class ChunkTally:
    """Sums the chunks read from a server at `cut`, after the first `skip`: a session's
    first chunk pays for what every later one reuses (its head loaded, its buffers
    made), which no later chunk costs. Thread-safe: chunks are read on fetching threads.
    """

    def __init__(self, cut: int, *, skip: int = 1) -> None:
        self.cut = cut
        self._skip = skip
        self._seen = 0
        self._totals = ChunkTotals(0, 0, 0, 0.0)
        self._changed = threading.Condition()
        self._closed = False

    def add(self, measured: ReadMeasurement) -> None:
        """Count a chunk's read, if it was a server's at this tally's cut."""
        if measured.cut != self.cut or measured.server_s is None or not measured.samples:
            return
        with self._changed:
            self._seen += 1
            if self._seen <= self._skip:
                return
            t = self._totals
            self._totals = ChunkTotals(
                t.chunks + 1,
                t.samples + measured.samples,
                t.bytes + measured.bytes,
                t.server_s + measured.server_s,
            )
            self._changed.notify_all()

    def wait(self, chunks: int, timeout_s: float) -> ChunkTotals | None:
        """The totals once `chunks` chunks are tallied - or, once the loop has ended
        (`close`), those it had if any - else None: not within `timeout_s` (the server
        is too slow to tell, or the job's chunks come from its cache)."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self._totals.chunks < chunks:
                left = deadline - time.monotonic()
                if self._closed and self._totals.chunks:
                    break
                if left <= 0 or self._closed:
                    return None
                self._changed.wait(left)
            return self._totals

    def close(self) -> None:
        """The loop ended: no more chunks come until the next, so a wait ends now."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def reopen(self) -> None:
        """A loop starts: its chunks add to the tally again."""
        with self._changed:
            self._closed = False
