"""`BatchTuner`: the head's batch size, chosen by the time a sample it measures.

The best batch depends on the head and the input, not on a constant: on one core, ResNet-18
at 32 px costs 994 us a sample in batches of 32 and 753 in batches of 256 (a batch's fixed
cost per operator is much of a small input's work), while at 112 px 256 costs 1.2x what 32
does (the activations leave the CPU's caches). So a session starts at `START` and walks by
doubling and halving, timing real batches - exploring costs nothing but a few batches run
at a worse size - and keeps the size whose median time a sample is lowest.
"""

from __future__ import annotations

import statistics
import threading
from collections import OrderedDict
from collections.abc import Hashable

__all__ = ["BETTER", "LOWEST", "START", "TRIES", "BatchTuner", "BatchTuners"]

START = 32
"""The size a session begins at (the server's batch before sizes were measured)."""
LOWEST = 8
TRIES = 3
"""Batches timed at a size before it is compared: a median, since a shared core stalls."""
BETTER = 0.05
"""How much faster a sample a size must run to replace the best so far: within it, the
one found first stays (sizes whose difference is noise do not trade places)."""


class BatchTuner:
    """The batch size a session asks the scheduler for; thread-safe (a session's chunks
    run in threads of their own).

    Args:
        most: the largest batch the server runs (`ServerConfig.batch_size`).
    """

    def __init__(self, most: int) -> None:
        self.most = most
        self.size = min(START, most)
        """The size batches are asked for now: being tried, or the one chosen."""
        self.settled = False
        self._longest = 0
        """The longest chunk seen: a batch larger than it is never full."""
        self._per_sample: dict[int, list[float]] = {}
        self._best: int | None = None
        self._lock = threading.Lock()

    def chunk(self, keys: int) -> None:
        """A chunk of `keys` keys starts. One longer than any before lets the walk go on
        where the best size was a whole chunk (a planner's probe chunks are short; the
        job's own come after)."""
        with self._lock:
            if keys <= self._longest:
                return
            best, shorter = self._best, self._longest
            self._longest = keys
            if self.settled and best is not None and best >= shorter:
                self.settled = False
                self._next(best)

    def record(self, size: int, seconds: float) -> None:
        """A batch of `size` samples spent `seconds` in the head. Only full batches count
        (a chunk's last, or one the scheduler granted smaller, says nothing of the size
        tried); where chunks are shorter than the size, a whole chunk is full."""
        with self._lock:
            target = min(self.size, self._longest)
            if self.settled or size != target or seconds <= 0:
                return
            runs = self._per_sample.setdefault(target, [])
            runs.append(seconds / size)
            if len(runs) >= TRIES:
                self._step(target)

    def seconds_per_sample(self) -> dict[int, float]:
        """Each size tried and its median time a sample."""
        with self._lock:
            return {s: statistics.median(r) for s, r in self._per_sample.items() if r}

    def _step(self, measured: int) -> None:
        """The size just measured against the best so far; then the best's untried
        neighbour, or settle on the best."""
        here = statistics.median(self._per_sample[measured])
        best = self._best
        if best is None or here < statistics.median(self._per_sample[best]) * (1 - BETTER):
            self._best = best = measured
        self._next(best)

    def _next(self, best: int) -> None:
        """Try the best's untried neighbour, larger first; else settle on the best."""
        larger = min(best * 2, self.most, self._longest)  # no larger than a chunk is
        for there in (larger, best // 2):
            if there != best and there >= LOWEST and there not in self._per_sample:
                self.size = there
                return
        self.size, self.settled = best, True


class BatchTuners:
    """One tuner per head as it runs (module, input size, dtype), shared by its sessions:
    a job's later sessions, and other jobs on the same head, start at the size found.

    Args:
        most: the largest batch the server runs.
        keep: tuners kept, the least recently used forgotten past it.
    """

    def __init__(self, most: int, keep: int = 256) -> None:
        self.most, self.keep = most, keep
        self._tuners: OrderedDict[Hashable, BatchTuner] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> BatchTuner:
        with self._lock:
            tuner = self._tuners.pop(key, None) or BatchTuner(self.most)
            self._tuners[key] = tuner
            while len(self._tuners) > self.keep:
                self._tuners.popitem(last=False)
            return tuner
