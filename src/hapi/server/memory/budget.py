"""The server's memory budget: its size, and what one session's batches cost in it.

A session's memory is modelled as the research system's storage side models it
(../shared/PAPERS.md, section 1): its head's weights, held once however many sessions
share the head, plus for each batch running `fixed + per_sample * batch` bytes. The
scheduler keeps the sum within the budget by choosing batch sizes.

Torch is not imported here: `hapi serve` calls `bound_allocator` before it loads torch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hapi.errors import InvalidRequest
from hapi.server.memory.limits import tightest_limit

__all__ = [
    "MemoryModel",
    "bound_allocator",
    "default_budget",
    "give_back",
    "give_back_when_quiet",
]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
ALLOCATOR_THRESHOLD = 4 << 20
"""Allocations at least this large are mapped and unmapped on their own (see
`bound_allocator`)."""
RETAINED_BYTES = 32 << 20
"""Free memory at the top of a heap the allocator keeps for the next batches, each of its
two arenas (see `bound_allocator`)."""
QUIET_S = 1.0
"""How long no batch runs before the allocator's free memory is given back."""


def bound_allocator() -> bool:
    """Make the C allocator give freed memory back, so that the process's memory follows
    the bytes the budget counts. Call it early, before threads start; returns whether the
    allocator is glibc's (elsewhere it does nothing).

    glibc's malloc keeps freed memory for reuse: an arena per thread (up to eight per
    core) and a mapping threshold that grows with each large free. A server with dozens
    of threads running batches of megabyte activations then held three times what its
    batches used (`benchmarks/tenants.py`: 750 MB over the idle server against 117 MB of
    budget), and a memory cgroup killed it. Two arenas and a fixed 4 MiB mapping
    threshold bring that back to tens of megabytes over the budget.

    The heaps' free tops are kept up to `RETAINED_BYTES` each, so a batch does not fault
    in again, zeroed, what the one before freed (at 32 px that was a quarter of the
    server's time); they are given back when the budget runs short (`Scheduler`'s
    `kept`) and when the server goes quiet (`give_back_when_quiet`). Figures:
    docs/server.md, "The C allocator".
    """
    global _bound
    libc = _libc()
    if libc is None:
        return False
    ok = libc.mallopt(_M_ARENA_MAX, 2)
    ok &= libc.mallopt(_M_MMAP_THRESHOLD, ALLOCATOR_THRESHOLD)
    ok &= libc.mallopt(_M_TRIM_THRESHOLD, RETAINED_BYTES)
    _bound = bool(ok)
    return _bound


_bound = False
"""Whether `bound_allocator` ran: the process is a server's own (`hapi serve`)."""


def give_back() -> bool:
    """Return the C allocator's free memory to the system (glibc's `malloc_trim`), the
    middle of its heaps included; whether it could. Only in a process whose allocator
    `bound_allocator` set: a server inside another program (a test, a notebook) leaves
    that program's heaps alone, where a trim would walk gigabytes."""
    libc = _libc()
    return _bound and libc is not None and bool(libc.malloc_trim(0))


def give_back_when_quiet(
    quiet_since: Callable[[], float | None],
    stopped: threading.Event,
    *,
    after_s: float = QUIET_S,
    clock: Callable[[], float] = time.monotonic,
    trim: Callable[[], object] = give_back,
) -> None:
    """Give the allocator's free memory back once per quiet spell - `after_s` after the
    last batch ended (`quiet_since`: when, or None while one runs) - until `stopped`.
    Run in a thread: an idle server's memory falls back to what it holds, while a busy one
    keeps its batches' memory for the next ones."""
    trimmed: float | None = None
    while not stopped.wait(after_s / 2):
        since = quiet_since()
        if since is not None and since != trimmed and clock() - since >= after_s:
            trim()
            trimmed = since


@functools.cache
def _libc() -> Any:
    """glibc, for `mallopt` and `malloc_trim`; None elsewhere."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is None or not hasattr(libc, "mallopt") or not hasattr(libc, "malloc_trim"):
            return None
    except OSError:
        return None
    return libc


def default_budget(device: str = "cpu", *, root: Path = Path("/")) -> int:
    """The budget when none is configured: what the tightest limit on the process's
    memory allows (`hapi.server.memory.limits`): half the room left under the host's memory or
    any of the process's memory cgroups (less what is in use there, this process's own
    memory included), and on a GPU also 90% of its free memory. The budget must hold
    where the kernel would kill the process: in a container, that is its cgroup's limit.

    Args:
        device: where heads run (cpu, cuda, cuda:N).
        root: where `/proc` and `/sys` are read (a directory laid out like them in tests).
    """
    return tightest_limit(device, root=root).budget


@dataclass(frozen=True, kw_only=True)
class MemoryModel:
    """What one batch of a session costs: `fixed + per_sample * batch` bytes, weights apart.

    Raises:
        InvalidRequest: a negative size.
    """

    fixed: int
    """Bytes a running batch holds whatever its size (decoding one image, read-ahead,
    scratch of the head's first operators)."""
    per_sample: int
    """Bytes each sample of a batch adds (its input, the head's activations up to the
    cut at their peak, its encoded features)."""
    decode: int = 0
    """Of `fixed`, what decoding and transforming the largest image expected takes; an
    image that needs more asks the scheduler for the difference."""

    def __post_init__(self) -> None:
        if min(self.fixed, self.per_sample, self.decode) < 0:
            raise InvalidRequest(f"memory sizes must be >= 0, got {self}")

    def batch_bytes(self, batch: int) -> int:
        """Bytes a batch of `batch` samples holds while it runs."""
        return self.fixed + self.per_sample * batch

    def largest_batch(self, free: int, limit: int) -> int:
        """The largest batch (`limit`, else a power of two below it) within `free`; 0: none.

        Powers of two: a head runs a few batch sizes again and again, rather than a new
        one each time (allocator reuse, kernel choice).
        """
        if self.batch_bytes(limit) <= free:
            return limit
        if self.per_sample == 0 or free < self.batch_bytes(1):
            return 0
        fits = (free - self.fixed) // self.per_sample
        return 1 << int(math.log2(min(fits, limit)))
