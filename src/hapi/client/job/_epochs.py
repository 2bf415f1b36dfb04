"""`EpochAccounts`: each epoch's figures, from the moment the one before it ended.

An epoch's window starts where the one before it ended, so the epochs of a `fit` add up
to its time: what runs between them (the bookkeeping, the next epoch's order) is the next
epoch's, not nobody's. The servers' time on an epoch is what its chunks reported; servers
that report nothing are asked for their CPU counters, once before anything is in flight
(a stats call made behind the streams of an epoch fetched ahead waits - a second at
10 Mbit/s) and after each epoch.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable

from hapi.client.pipeline.history import EpochStats
from hapi.client.pipeline.loader import FeatureLoader
from hapi.errors import HapiError

__all__ = ["EpochAccounts"]

_AS_COUNTED = (
    "bytes_received", "wait_s", "transfer_s", "chunks_local", "retries", "failovers",
    "fallbacks", "cached", "server_cached", "server_compiled", "server_head", "read_bytes",
    "placed_bytes", "local_bytes",
)  # fmt: skip
"""The epoch's figures the loader counted under the same names."""


class EpochAccounts:
    """Times and counts the epochs of one loop over `loader`.

    Args:
        loader: the loop's loader (its counters are the epoch's).
        totals: sums one rank's figures over every rank (data-parallel), or None.
        one_core: whether the trainer runs on one core (receiving then competes with
            training); None: as this process's CPU affinity says.
    """

    def __init__(
        self,
        loader: FeatureLoader,
        totals: Callable[[EpochStats], EpochStats] | None = None,
        *,
        one_core: bool | None = None,
    ) -> None:
        self._loader, self._totals = loader, totals
        self._one_core = _one_core() if one_core is None else one_core
        self._counters: dict[str, float] | None = _server_cpu(loader)
        self._t0, self._cpu0 = time.perf_counter(), time.process_time()
        self._write_failures = self._cache_write_failures()

    def _cache_write_failures(self) -> int:
        """The trainer's cache's entries not written so far (its directory refused them)."""
        cache = self._loader.cache
        return 0 if cache is None else cache.cache.stats.write_failures

    def close(
        self,
        epoch: int,
        *,
        cut: int,
        share: float,
        loss: float,
        correct: float,
        seen: float,
        compute: float,
    ) -> EpochStats:
        """The figures of `epoch`, which ends now; the next epoch's window starts.

        Args:
            loss: the sum of the samples' losses; `correct`, `seen`: samples right, samples.
            compute: the training thread's CPU seconds on the epoch's steps.
        """
        server_s = self._server_s()
        t1, cpu1 = time.perf_counter(), time.process_time()
        seconds, process_s = t1 - self._t0, cpu1 - self._cpu0
        self._t0, self._cpu0 = t1, cpu1
        stats = self._loader.stats
        busy = compute + stats.postprocess_s + stats.convert_s
        # The rest of the process's CPU is receiving: the streams' bytes decoded into
        # tensors in the fetching threads. On a trainer confined to one core it competes
        # with training and is part of the stage's busy time; with more cores it runs
        # beside it.
        receive = max(0.0, process_s - busy)
        failures, self._write_failures = self._write_failures, self._cache_write_failures()
        figures = EpochStats(
            epoch=epoch,
            loss=loss / max(seen, 1),
            accuracy=correct / max(seen, 1),
            seconds=seconds,
            server_s=server_s,
            samples=int(seen),
            compute_s=compute,
            decode_s=stats.postprocess_s,
            skipped=tuple(stats.skipped),
            trainer_s=busy + receive if self._one_core else busy,
            receive_s=receive,
            cut=cut,
            share=share,
            chunks_pushed=stats.chunks - stats.chunks_local,
            cache_write_failures=self._write_failures - failures,
            **{name: getattr(stats, name) for name in _AS_COUNTED},
        )
        return figures if self._totals is None else self._totals(figures)

    def _server_s(self) -> float:
        """The servers' time on the epoch's chunks (and the counters for the next one)."""
        loader = self._loader
        if loader.stats.server_reported:
            self._counters = None
            return loader.stats.server_s
        if self._counters is None:  # they report per chunk, and none of theirs was this one's
            return 0.0
        after = _server_cpu(loader)
        before, self._counters = self._counters, after
        return sum(cpu - before.get(s, 0.0) for s, cpu in after.items())


def _server_cpu(loader: FeatureLoader) -> dict[str, float]:
    """The servers' CPU seconds per session of ours, for servers that do not report their
    time per chunk."""
    cpu: dict[str, float] = {}
    for member in loader.servers:
        with contextlib.suppress(HapiError):
            stats = member.connection.stats()
            opened = member.sessions.opened
            cpu.update({s: stats.sessions[s].cpu_s for s in opened if s in stats.sessions})
    return cpu


def _one_core() -> bool:
    """Whether this process runs on one core (pinned, or a one-core machine): its threads
    then take turns on it, and their CPU times add up to the core's busy time."""
    return len(os.sched_getaffinity(0)) == 1
