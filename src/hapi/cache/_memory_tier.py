"""The feature cache's memory tier: entries packed into slabs, about 115 bytes each beside
their payload (a tensor an entry cost about 700 more, which the budget did not count).

The entries of one space and shape are rows of one slab, found by name in a dict. A slab
is allocated at the budget's size but costs memory only as its rows are written, so
growing it copies nothing. Once the budget is spent, new features overwrite the oldest
rows first, but entries read back from disk do not: an epoch that scans more than the
tier holds would overwrite what the next epoch reads first (at a million entries and 256
MiB, 4% of an epoch's reads hit; kept, a quarter do).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["MemoryTier"]


@dataclass(eq=False)
class _Slab:
    """Rows of one (space, shape, dtype), the first `len(names)` written; a ring once
    the budget allows no more."""

    rows: torch.Tensor
    capacity: int
    names: list[str | None] = field(default_factory=list)
    """The name in each written row, to forget a row's entry when it is overwritten."""
    where: dict[str, int] = field(default_factory=dict)
    next: int = 0
    """The row the next entry goes to (the oldest, once the slab wraps)."""


class MemoryTier:
    """Entries kept in memory within `budget` bytes of payload (not thread-safe: the
    cache calls it under its lock)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._slabs: dict[tuple[str, tuple[int, ...], torch.dtype], _Slab] = {}
        self._by_space: dict[str, list[_Slab]] = {}
        self._held = 0

    def __bool__(self) -> bool:
        return self._held > 0

    @property
    def held(self) -> int:
        """Bytes of the rows written."""
        return self._held

    def get_batch(self, sid: str, names: Sequence[str]) -> tuple[list[int], torch.Tensor | None]:
        """The places in `names` of the entries held, and their rows stacked in that order
        (copied out together: a later put may overwrite a row). Entries of one space have
        one shape: they come from one slab."""
        for slab in self._by_space.get(sid, ()):
            rows = list(map(slab.where.get, names))
            found = [i for i, r in enumerate(rows) if r is not None]
            if found:
                index = torch.tensor([rows[i] for i in found])
                return found, slab.rows.index_select(0, index)
        return [], None

    def contains(self, sid: str, name: str) -> bool:
        return any(name in slab.where for slab in self._by_space.get(sid, ()))

    def put(self, sid: str, name: str, tensor: torch.Tensor) -> None:
        """Keep a copy of `tensor` under `name` (nothing if it is held, or cannot fit)."""
        self.put_batch(sid, [name], tensor.unsqueeze(0))

    def put_batch(
        self, sid: str, names: Sequence[str], batch: torch.Tensor, *, evict: bool = True
    ) -> None:
        """Keep copies of `batch`'s rows under `names` (those not held, while they fit),
        in one copy: a chunk read from disk is remembered whole, not a row at a time.
        `evict=False`: only into rows never written (entries read back from disk).

        The rows are booked by name alone (one slab for the batch's shape): a tensor a
        row cost about 5 us an entry, most of a cached epoch's reading."""
        if not len(names):
            return
        row_bytes = max(math.prod(batch.shape[1:]) * batch.element_size(), 1)
        slab = self._slab(sid, tuple(batch.shape[1:]), batch.dtype, row_bytes)
        if slab is None:
            return
        held = self._by_space[sid]
        fresh: dict[str, int] = {}  # each name not held, once, with its row in the batch
        for i, name in enumerate(names):
            if name not in slab.where and (len(held) == 1 or not self.contains(sid, name)):
                fresh.setdefault(name, i)
        if not fresh:
            return
        start = len(slab.names)
        free = min(slab.capacity - start, (self.budget - self._held) // row_bytes)
        if not evict:
            if slab.next != start or free <= 0:
                return
            fresh = dict(itertools.islice(fresh.items(), free))
        new = list(fresh.values())
        picked = batch if len(new) == len(batch) else batch[torch.tensor(new)]
        if slab.next == start and free >= len(new):
            # Rows appended (the usual case until the budget is spent): booked together.
            slab.names.extend(fresh)
            slab.where.update(zip(fresh, range(start, start + len(new)), strict=True))
            slab.next = start + len(new)
            self._held += row_bytes * len(new)
            slab.rows[start : slab.next].copy_(picked)
            return
        self._ring(slab, list(fresh), picked, row_bytes)

    def _ring(self, slab: _Slab, names: list[str], batch: torch.Tensor, row_bytes: int) -> None:
        """`batch`'s rows into `slab` a row at a time, past its end or the budget's:
        overwriting its oldest."""
        keep: list[int] = []
        rows: list[int] = []
        for i, name in enumerate(names):
            row = self._book(slab, name, row_bytes)
            if row is None:
                break
            keep.append(i)
            rows.append(row)
        if len(set(rows)) < len(rows):  # a ring smaller than the batch: the last write wins
            for i, row in zip(keep, rows, strict=True):
                slab.rows[row].copy_(batch[i])
            return
        if rows:
            picked = batch if len(keep) == len(batch) else batch[torch.tensor(keep)]
            slab.rows.index_copy_(0, torch.tensor(rows), picked)

    def _book(self, slab: _Slab, name: str, row_bytes: int) -> int | None:
        """The row of `slab` that `name`'s copy goes to, booked for it (the row's old
        entry forgotten): a new row while the budget allows, else the oldest; None when
        the slab has no row and the budget none to give."""
        room = self._held + row_bytes <= self.budget and len(slab.names) < slab.capacity
        if slab.next >= len(slab.names) and not room:
            if not slab.names:
                return None
            slab.next = 0  # wrap: overwrite the oldest (the budget is never given back)
        row = slab.next
        if row == len(slab.names):  # a new row, within the budget
            slab.names.append(name)
            self._held += row_bytes
        else:
            old = slab.names[row]
            if old is not None:
                del slab.where[old]
            slab.names[row] = name
        slab.where[name] = row
        slab.next = row + 1
        return row

    def clear(self) -> None:
        self._slabs.clear()
        self._by_space.clear()
        self._held = 0

    def _slab(
        self, sid: str, shape: tuple[int, ...], dtype: torch.dtype, row_bytes: int
    ) -> _Slab | None:
        """The slab of rows of `shape` and `dtype` in space `sid`, made if the budget
        allows one more row; None if there is none and it does not."""
        key = (sid, shape, dtype)
        slab = self._slabs.get(key)
        if slab is None:
            capacity = self.budget // row_bytes
            if capacity == 0 or self._held + row_bytes > self.budget:
                return None
            # Virtual until written: a large allocation's pages are committed on first use.
            slab = _Slab(torch.empty((capacity, *shape), dtype=dtype), capacity)
            self._slabs[key] = slab
            self._by_space.setdefault(sid, []).append(slab)
        return slab
