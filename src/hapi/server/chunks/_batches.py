"""A chunk's wire batches: how large one may be, and encoding one with its time counted.

Both ways a chunk's batches are made share these: computed by the session's head
(`hapi.server.chunks.session`) and sent from the feature cache
(`hapi.server.chunks.feature_cache`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pyarrow as pa

from hapi.server.chunks._counters import SessionCounters
from hapi.wire import encode_batch

__all__ = ["WIRE_BATCH_BYTES", "Sent", "Wire", "encode", "samples_per_batch"]

WIRE_BATCH_BYTES = 1 << 20
"""Bytes a wire batch holds at most (or one sample, when a sample's features are more).

A batch is counted in the budget while it computes; once sent to the outbox it waits for
its stream outside it, up to `AHEAD_BATCHES` and the one being sent per chunk in flight.
Batches of at most this many bytes bound that to a few MiB per chunk, whatever the cut:
the rule an operator caps the server's memory by (README, "Memory") holds for early cuts
too, where 32 samples of ResNet-18's `relu` at 112 px are 25 MiB."""

Wire = tuple[pa.RecordBatch, bytes | None]
"""A wire batch and, on a chunk's last, its report (a chunk's outbox items)."""
Sent = Callable[[pa.RecordBatch], None]
"""Told of each wire batch a chunk's head computed, once it is in the outbox."""


def samples_per_batch(bytes_per_sample: int) -> int:
    """Samples of `bytes_per_sample` bytes a wire batch holds (`WIRE_BATCH_BYTES`), >= 1."""
    return max(WIRE_BATCH_BYTES // max(bytes_per_sample, 1), 1)


def encode(
    schema: pa.Schema,
    stats: SessionCounters,
    keys: list[str],
    labels: list[int],
    **payload: object,
) -> pa.RecordBatch:
    """A wire batch of `schema`, its encoding time and samples counted in `stats`."""
    t0 = time.perf_counter()
    batch = encode_batch(schema, keys, labels, **payload)  # type: ignore[arg-type]
    stats.add(encode_s=time.perf_counter() - t0, samples=len(keys))
    return batch
