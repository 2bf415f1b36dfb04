"""A chunk's samples in its keys' order when two sources give them: the cache and a server.

Batches are cut from pieces in delivery order, so a chunk whose cached samples went first
and computed ones after would train other samples together than the same chunk without
the cache - and an exact job's losses would differ. The merge hands samples on in the
chunk's order: each as soon as every sample before it is in, or known to be skipped.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from hapi.client.pipeline.rebatch import Piece

__all__ = ["ChunkMerge"]


class ChunkMerge:
    """Orders one chunk's samples.

    Args:
        chunk: the chunk's index (its pieces carry it).
        cut: the cut every sample is at.
        keys: the chunk's keys, in order.
        labels: their labels.
        emit: takes each piece the order allows, in order (called under the merge's lock,
            so two sources' pieces never pass each other).
    """

    def __init__(
        self,
        chunk: int,
        cut: int,
        keys: Sequence[str],
        labels: Sequence[int],
        emit: Callable[[Piece], None],
    ) -> None:
        self.chunk, self.cut, self.emit = chunk, cut, emit
        self.order = list(keys)
        self.labels = dict(zip(keys, labels, strict=True))
        self._ready: dict[str, torch.Tensor] = {}
        self._gone: set[str] = set()
        self._next = 0
        self._lock = threading.Lock()

    def add(self, keys: Sequence[str], features: torch.Tensor | Sequence[torch.Tensor]) -> None:
        """Samples in (one row of `features` per key); hand on what the order allows."""
        with self._lock:
            start = self._next
            if (
                isinstance(features, torch.Tensor)
                and not self._ready
                and list(keys) == self.order[start : start + len(keys)]
                and not self._gone.intersection(keys)
            ):
                # The next samples in order, as one batch (a chunk all from the cache, or
                # a server's piece): handed on whole, not a tensor a row.
                self._next += len(keys)
                self._emit(list(keys), features)
            else:
                for key, row in zip(keys, features, strict=True):
                    self._ready[key] = row
            self._flush()

    def skip(self, keys: Sequence[str]) -> None:
        """Keys that will not come (skipped under `on_error="skip"`)."""
        with self._lock:
            self._gone.update(keys)
            self._flush()

    @property
    def pending(self) -> int:
        """Keys neither handed on nor skipped."""
        with self._lock:
            return len(self.order) - self._next

    def _flush(self) -> None:
        keys: list[str] = []
        rows: list[torch.Tensor] = []
        while self._next < len(self.order):
            key = self.order[self._next]
            if key in self._gone:
                self._next += 1
                continue
            row = self._ready.pop(key, None)
            if row is None:
                break
            keys.append(key)
            rows.append(row)
            self._next += 1
        if keys:
            self._emit(keys, torch.stack(rows))

    def _emit(self, keys: list[str], features: torch.Tensor) -> None:
        labels = torch.tensor([self.labels[k] for k in keys], dtype=torch.int64)
        self.emit(Piece(self.chunk, self.cut, keys, labels, features))
