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
import math
from dataclasses import dataclass
from pathlib import Path

from hapi.errors import InvalidRequest
from hapi.server.memory.limits import tightest_limit

__all__ = ["MemoryModel", "bound_allocator", "default_budget"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
ALLOCATOR_THRESHOLD = 4 << 20
"""Allocations at least this large are mapped and unmapped on their own, and free memory
at the top of a heap above it is given back (see `bound_allocator`)."""


def bound_allocator() -> bool:
    """Make the C allocator give freed memory back, so that the process's memory follows
    the bytes the budget counts. Call it early, before threads start; returns whether the
    allocator is glibc's (elsewhere it does nothing).

    glibc's malloc keeps freed memory for reuse: an arena per thread (up to eight per
    core) and a mapping threshold that grows with each large free. A server with dozens
    of threads running batches of megabyte activations then held three times what its
    batches used (`benchmarks/tenants.py`: 750 MB over the idle server against 117 MB of
    budget), and a memory cgroup killed it. Two arenas and fixed 4 MiB thresholds bring
    that back to tens of megabytes over the budget, for a few page faults per batch.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        return False
    if mallopt is None:
        return False
    ok = mallopt(_M_ARENA_MAX, 2)
    ok &= mallopt(_M_MMAP_THRESHOLD, ALLOCATOR_THRESHOLD)
    ok &= mallopt(_M_TRIM_THRESHOLD, ALLOCATOR_THRESHOLD)
    return bool(ok)


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
