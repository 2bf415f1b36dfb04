"""`FeatureLoader`: the trainer's side of the pipeline.

It owns the epoch order (a seeded permutation), keeps K chunks in flight so the server
computes chunk i+K while the trainer trains on chunk i, rebatches to the training batch
size, and checks that every key of the epoch was delivered exactly once (or reported as
skipped by the server).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from hapi.client.connection import ChunkResult, Connection
from hapi.data import DatasetManifest
from hapi.errors import (
    DuplicateDelivery,
    IncompleteEpoch,
    InvalidRequest,
    NotDecoded,
    ServerUnavailable,
    shorten,
)
from hapi.wire import ChunkTicket, FeatureBatch, SkippedKey

__all__ = ["FeatureLoader", "LoaderStats"]

# Takes a received batch and the epoch; returns the batch to train on and the keys it dropped.
Postprocess = Callable[[FeatureBatch, int], tuple[FeatureBatch, list[SkippedKey]]]


@dataclass
class LoaderStats:
    """What the loader moved and waited for in the current epoch."""

    bytes_received: int = 0
    chunks: int = 0
    samples: int = 0
    retries: int = 0
    wait_s: float = 0.0
    """Time the trainer waited for data (a stall: the pipeline is not keeping up)."""
    postprocess_s: float = 0.0
    """CPU time spent decoding raw bytes in the trainer (the local baseline only)."""
    skipped: list[SkippedKey] = field(default_factory=list)


class FeatureLoader:
    """Iterates one session's features in training batches.

    Args:
        connection: the server holding the session.
        session: the session id.
        manifest: the dataset's keys and labels.
        batch_size: the training batch size (the server picks its own batch size).
        chunk_size: keys per chunk request.
        prefetch: chunks in flight at once (K).
        seed: the job seed; the epoch order is a permutation seeded by (seed, epoch).
        shuffle: permute the keys each epoch (off for evaluation).
        retries: times a chunk is retried when the server is unreachable.
        postprocess: run on each received batch in the fetching thread (the local
            baseline decodes and transforms raw bytes there, as DataLoader workers would).

    Raises:
        InvalidRequest: a size below 1, or negative retries.
    """

    def __init__(
        self,
        connection: Connection,
        session: str,
        manifest: DatasetManifest,
        *,
        batch_size: int,
        chunk_size: int = 64,
        prefetch: int = 4,
        seed: int = 0,
        shuffle: bool = True,
        retries: int = 2,
        postprocess: Postprocess | None = None,
    ) -> None:
        for name, value in (
            ("batch_size", batch_size),
            ("chunk_size", chunk_size),
            ("prefetch", prefetch),
        ):
            if value < 1:
                raise InvalidRequest(f"{name} must be >= 1, got {value}")
        if retries < 0:
            raise InvalidRequest(f"retries must be >= 0 (0: never retry), got {retries}")
        self.connection = connection
        self.session = session
        self.manifest = manifest
        self.batch_size = batch_size
        self.chunk_size = chunk_size
        self.prefetch = prefetch
        self.seed = seed
        self.shuffle = shuffle
        self.retries = retries
        self.postprocess = postprocess
        self.stats = LoaderStats()

    def __len__(self) -> int:
        """Training batches per epoch (the last one may be smaller)."""
        return -(-len(self.manifest) // self.batch_size)

    def order(self, epoch: int) -> np.ndarray:
        """The epoch's order of manifest indices."""
        n = len(self.manifest)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def tickets(self, epoch: int) -> list[ChunkTicket]:
        """The epoch's chunks, in order."""
        order = self.order(epoch)
        keys, labels = self.manifest.keys, self.manifest.labels
        return [
            ChunkTicket(
                session=self.session,
                chunk=i,
                epoch=epoch,
                keys=[keys[j] for j in order[start : start + self.chunk_size]],
                labels=[labels[j] for j in order[start : start + self.chunk_size]],
            )
            for i, start in enumerate(range(0, len(order), self.chunk_size))
        ]

    def epoch(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield `(features, labels)` training batches of one epoch.

        Raises:
            HapiError: a chunk failed, as the server's error (`CorruptObject` naming the
                key, ...).
            DuplicateDelivery: a key arrived twice.
            IncompleteEpoch: keys went missing.
            NotDecoded: raw bytes arrived and there is no `postprocess` to decode them.
        """
        self.stats = LoaderStats()
        tickets = self.tickets(epoch)
        pending: deque[Future[ChunkResult]] = deque()
        feats: list[torch.Tensor] = []
        labels: list[torch.Tensor] = []
        buffered = 0
        delivered: set[str] = set()
        with ThreadPoolExecutor(self.prefetch, thread_name_prefix="hapi-fetch") as pool:
            queue = iter(tickets)
            try:
                for ticket in queue:
                    pending.append(pool.submit(self._fetch, ticket, epoch))
                    if len(pending) >= self.prefetch:
                        break
                while pending:
                    t0 = time.perf_counter()
                    result = pending.popleft().result()
                    self.stats.wait_s += time.perf_counter() - t0
                    next_ticket = next(queue, None)
                    if next_ticket is not None:
                        pending.append(pool.submit(self._fetch, next_ticket, epoch))
                    self._account(result, delivered)
                    for batch in result.batches:
                        if batch.features is None:
                            raise NotDecoded(
                                "the loader received raw bytes: give it a postprocess that "
                                "decodes them (TransferJob does so in local mode)"
                            )
                        feats.append(batch.features)
                        labels.append(batch.labels)
                        buffered += len(batch)
                    while buffered >= self.batch_size:
                        x, y, feats, labels = _take(feats, labels, self.batch_size)
                        buffered -= self.batch_size
                        yield x, y
            finally:
                for future in pending:
                    future.cancel()
        if buffered:
            x, y, _, _ = _take(feats, labels, buffered)
            yield x, y
        self._check_complete(delivered)

    def _fetch(self, ticket: ChunkTicket, epoch: int) -> ChunkResult:
        for attempt in range(self.retries + 1):
            try:
                result = self.connection.fetch(ticket)
                break
            except ServerUnavailable:
                if attempt == self.retries:
                    raise
                self.stats.retries += 1
                time.sleep(0.2 * 2**attempt)
        if self.postprocess is None:
            return result
        t0 = time.thread_time()
        batches, skipped = [], list(result.skipped)
        for raw in result.batches:
            batch, dropped = self.postprocess(raw, epoch)
            skipped += dropped
            if len(batch):
                batches.append(batch)
        self.stats.postprocess_s += time.thread_time() - t0
        return ChunkResult(batches, skipped, result.nbytes)

    def _account(self, result: ChunkResult, delivered: set[str]) -> None:
        self.stats.chunks += 1
        self.stats.bytes_received += result.nbytes
        self.stats.skipped += result.skipped
        for batch in result.batches:
            self.stats.samples += len(batch)
            dupes = delivered.intersection(batch.keys)
            if dupes:
                raise DuplicateDelivery(
                    f"{len(dupes)} keys delivered twice in one epoch, e.g. "
                    f"{shorten(repr(sorted(dupes)[:5]))}: a chunk was delivered more than once"
                )
            delivered.update(batch.keys)

    def _check_complete(self, delivered: set[str]) -> None:
        skipped = {s.key for s in self.stats.skipped}
        missing = set(self.manifest.keys) - delivered - skipped
        if missing:
            raise IncompleteEpoch(
                f"{len(missing)} keys of the epoch were neither delivered nor reported "
                f"skipped, e.g. {shorten(repr(sorted(missing)[:5]))}"
            )


def _take(
    feats: list[torch.Tensor], labels: list[torch.Tensor], n: int
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Split the first `n` rows off the buffered tensors."""
    x, y = torch.cat(feats), torch.cat(labels)
    return x[:n], y[:n], [x[n:]] if len(x) > n else [], [y[n:]] if len(y) > n else []
