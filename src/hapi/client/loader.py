"""`FeatureLoader`: the trainer's side of the pipeline.

It owns the epoch order (a seeded permutation) and keeps K chunks in flight. Each chunk
is routed when it is issued: pushed down (the server sends features at the plan's cut)
or local (the server sends raw bytes and the trainer computes the features, in a worker
thread). Batches are handed on as they arrive, not when their chunk is complete, and in
epoch order; they are cut and joined into training batches (`hapi.client.rebatch`), so
the request's size, the server's batch and the training batch are three numbers.

The link serves chunks in order: every chunk's request goes out when it is issued, so
the server works ahead, but a chunk's stream is read only once the one before it is
read. Read at once, K streams would share the link and the first chunk would arrive
about when all of them do - the trainer would wait for nearly every byte of the first K
chunks before its first batch. Read in order, chunk i arrives at the link's full rate
while the server computes chunk i+1 into its stream's flow-control window.

A stream that fails (server gone, store gone, stream cut, session lost to a restart) is
retried with backoff up to a time budget, for the keys not yet delivered only: samples
depend on (job seed, epoch, key), not on which request carried them. Every key is
delivered once per epoch or the epoch fails saying which went missing or came twice.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import tenacity
import torch

from hapi.client.connection import ChunkStream, Connection
from hapi.client.history import Event
from hapi.client.local import LocalCompute
from hapi.client.rebatch import Batch, Convert, Piece, Rebatcher
from hapi.client.retry import RetryPolicy
from hapi.client.routing import ChunkRecord, Route, Router
from hapi.client.sessions import Sessions
from hapi.data import DatasetManifest
from hapi.errors import (
    DuplicateDelivery,
    IncompleteEpoch,
    InvalidRequest,
    NotDecoded,
    ServerUnavailable,
    SessionNotFound,
    shorten,
)
from hapi.graph import INPUT
from hapi.wire import ChunkTicket, FeatureBatch, SkippedKey

__all__ = ["FeatureLoader", "LoaderStats"]

# Called in the fetching thread after each part of a chunk is handed on: (chunk, keys).
OnPart = Callable[[int, list[str]], None]


@dataclass
class LoaderStats:
    """What the loader moved, waited for and measured in the current epoch."""

    bytes_received: int = 0
    chunks: int = 0
    chunks_local: int = 0
    samples: int = 0
    retries: int = 0
    wait_s: float = 0.0
    """Time the trainer waited for data (a stall: the pipeline is not keeping up)."""
    postprocess_s: float = 0.0
    """Trainer time on local chunks: decoding, transforming and the head."""
    train_s: float = 0.0
    """Trainer time between batches: what the caller did with them (the tail, the step)."""
    convert_s: float = 0.0
    """Trainer time carrying features across a change of cut."""
    server_s: float = 0.0
    """The server's compute on the epoch's chunks, as it reported it."""
    server_reported: bool = False
    """Whether the server reported its time (older servers do not)."""
    transfer_s: float = 0.0
    """The link's busy time: each chunk's stream while it had the link, less the time
    it can be seen waiting for the server."""
    skipped: list[SkippedKey] = field(default_factory=list)
    records: list[ChunkRecord] = field(default_factory=list)
    """Every chunk, delivered and trained, in order."""

    @property
    def trainer_s(self) -> float:
        """The trainer's busy time."""
        return self.train_s + self.postprocess_s + self.convert_s


class FeatureLoader:
    """Iterates an epoch's features in training batches.

    Args:
        connection: the server.
        session: the session id, or the job's `Sessions` (one per cut, re-opened when lost).
        manifest: the dataset's keys and labels.
        batch_size: the training batch size (the server picks its own batch size).
        chunk_size: keys per chunk request.
        prefetch: chunks in flight at once (K).
        seed: the job seed; the epoch order is a permutation seeded by (seed, epoch).
        shuffle: permute the keys each epoch (off for evaluation).
        retries: at most this many retries per chunk (None: as the budget allows).
        retry_budget_s: seconds a failing chunk is retried before the epoch fails.
        cut: the session's cut, with a session id (it only labels the features).
        router: routes each chunk (pushed down or local); default: all pushed down at `cut`.
        local: computes local chunks from raw bytes; needed by a router with local chunks.
        convert: carries features to a later cut (`ModelGraph.segment`), for plans whose
            cut changes mid-epoch.
        record: receives an `Event` for each retry.
        on_part: called in the fetching thread after each part of a chunk is handed on.

    Raises:
        InvalidRequest: a size below 1, negative retries or budget.
    """

    def __init__(
        self,
        connection: Connection,
        session: str | Sessions,
        manifest: DatasetManifest,
        *,
        batch_size: int,
        chunk_size: int = 64,
        prefetch: int = 4,
        seed: int = 0,
        shuffle: bool = True,
        retries: int | None = None,
        retry_budget_s: float = 60.0,
        cut: int = INPUT,
        router: Router | None = None,
        local: LocalCompute | None = None,
        convert: Convert | None = None,
        record: Callable[[Event], None] | None = None,
        on_part: OnPart | None = None,
    ) -> None:
        for name, value in (
            ("batch_size", batch_size),
            ("chunk_size", chunk_size),
            ("prefetch", prefetch),
        ):
            if value < 1:
                raise InvalidRequest(f"{name} must be >= 1, got {value}")
        self.retry = RetryPolicy(budget_s=retry_budget_s, retries=retries)
        self.connection = connection
        self.sessions = (
            session if isinstance(session, Sessions) else Sessions.fixed(connection, session, cut)
        )
        self.manifest = manifest
        self.batch_size = batch_size
        self.chunk_size = chunk_size
        self.prefetch = prefetch
        self.seed = seed
        self.shuffle = shuffle
        self.router = router if router is not None else Router(cut)
        self.local = local
        self.convert = convert
        self.record = record
        self.on_part = on_part
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

    def chunks(self, epoch: int) -> list[tuple[list[str], list[int]]]:
        """The epoch's chunks in order, each as (keys, labels)."""
        order = self.order(epoch)
        keys, labels = self.manifest.keys, self.manifest.labels
        return [
            (
                [keys[j] for j in order[start : start + self.chunk_size]],
                [labels[j] for j in order[start : start + self.chunk_size]],
            )
            for start in range(0, len(order), self.chunk_size)
        ]

    def epoch(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield `(features, labels)` training batches of one epoch (see `batches`)."""
        for batch in self.batches(epoch):
            yield batch.features, batch.labels

    def batches(self, epoch: int) -> Iterator[Batch]:
        """Yield the epoch's training batches, each at one cut, in epoch order.

        The time the caller spends between batches is the trainer's time on them (the
        tail, the optimizer step), measured here for the plan's stage times.

        Raises:
            HapiError: a chunk failed for good, as the server's error (`CorruptObject`
                naming the key, `ServerUnavailable` after the retry budget, ...).
            DuplicateDelivery: a key arrived twice.
            IncompleteEpoch: keys went missing.
            NotDecoded: raw bytes arrived for a chunk routed as pushed down.
        """
        self.stats = LoaderStats()
        chunks = self.chunks(epoch)
        self.router.start(epoch, len(chunks))
        return _Epoch(self, epoch, chunks).run()


_DONE = object()


class _Flow:
    """One chunk on its way: its route, the pieces it delivered, what it cost."""

    def __init__(
        self, index: int, keys: list[str], labels: list[int], route: Route, previous: _Flow | None
    ) -> None:
        self.index, self.route, self.previous = index, route, previous
        self.remaining = dict(zip(keys, labels, strict=True))
        self.queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.read_done = threading.Event()
        self.stream: ChunkStream | None = None
        self.issued = time.perf_counter()
        self.turn: float | None = None
        self.read_end = 0.0
        self.backoff_s = 0.0
        self.bytes = 0
        self.server_s: float | None = None
        self.queue_s = 0.0
        self.local_s = 0.0
        self.train_s = 0.0
        self.samples = 0
        self.untrained = 0
        self.finished = False
        self.observed = False
        self.skipped: list[SkippedKey] = []

    @property
    def transfer_s(self) -> float:
        """The link's busy time on this chunk: its stream's time while it had the link,
        less backoff and the server's compute still left when its turn came."""
        if self.turn is None:
            return 0.0
        ahead = self.turn - self.issued
        waiting = max(0.0, (self.server_s or 0.0) + self.queue_s - ahead)
        return max(0.0, self.read_end - self.turn - self.backoff_s - waiting)


class _Epoch:
    """One epoch's run: fetching threads, the local worker, and the consuming generator."""

    def __init__(
        self, loader: FeatureLoader, epoch: int, chunks: list[tuple[list[str], list[int]]]
    ) -> None:
        self.loader, self.epoch, self.chunks = loader, epoch, chunks
        self.stats = loader.stats
        self.flows: list[_Flow] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.clock = _busy_clock()

    def run(self) -> Iterator[Batch]:
        loader = self.loader
        rebatcher = Rebatcher(loader.convert, clock=self.clock)
        delivered: set[str] = set()
        n, k = len(self.chunks), loader.prefetch
        self.fetchers = ThreadPoolExecutor(k, thread_name_prefix="hapi-fetch")
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="hapi-local")
        try:
            for j in range(min(k, n)):
                self._issue(j)
            for j in range(n):
                flow = self.flows[j]
                while True:
                    t0 = time.perf_counter()
                    item = flow.queue.get()
                    self.stats.wait_s += time.perf_counter() - t0
                    if isinstance(item, BaseException):
                        raise item
                    if item is _DONE:
                        break
                    assert isinstance(item, Piece)
                    _check_once(item.keys, delivered)
                    flow.samples += len(item)
                    flow.untrained += len(item)
                    rebatcher.add(item)
                    while len(rebatcher) >= loader.batch_size:
                        yield from self._emit(rebatcher.take(loader.batch_size))
                self._finish(flow)
                if j + k < n:
                    self._issue(j + k)
            if len(rebatcher):
                yield from self._emit(rebatcher.take(len(rebatcher)))
            self._check_complete(delivered)
        finally:
            self._shutdown()

    def _issue(self, index: int) -> None:
        keys, labels = self.chunks[index]
        route = self.loader.router.route(index)
        previous = self.flows[-1] if self.flows else None
        flow = _Flow(index, keys, labels, route, previous)
        self.flows.append(flow)
        self.fetchers.submit(self._fetch, flow)

    def _emit(self, batch: Batch) -> Iterator[Batch]:
        t0 = self.clock()
        yield batch
        step = self.clock() - t0
        self.stats.train_s += step
        self.stats.convert_s += batch.convert_s
        for index, count in batch.parts:
            flow = self.flows[index]
            flow.train_s += (step + batch.convert_s) * count / len(batch)
            flow.untrained -= count
            self._settle(flow)

    def _finish(self, flow: _Flow) -> None:
        """Every piece of `flow` was delivered."""
        flow.finished = True
        stats = self.stats
        stats.chunks += 1
        stats.chunks_local += flow.route.local
        stats.samples += flow.samples
        stats.bytes_received += flow.bytes
        stats.skipped += flow.skipped
        stats.postprocess_s += flow.local_s
        stats.transfer_s += flow.transfer_s
        if flow.server_s is not None:
            stats.server_s += flow.server_s
            stats.server_reported = True
        self._settle(flow)

    def _settle(self, flow: _Flow) -> None:
        """Once a chunk is delivered and trained, the router sees what it cost."""
        if flow.observed or not flow.finished or flow.untrained:
            return
        flow.observed = True
        record = ChunkRecord(
            chunk=flow.index,
            epoch=self.epoch,
            route=flow.route,
            samples=flow.samples,
            bytes=flow.bytes,
            server_s=flow.server_s,
            transfer_s=flow.transfer_s,
            trainer_s=flow.local_s + flow.train_s,
        )
        self.stats.records.append(record)
        self.loader.router.observe(record)

    # The fetching threads ------------------------------------------------------------------

    def _fetch(self, flow: _Flow) -> None:
        try:
            if self.stop.is_set():
                return
            self.loader.retry.retrying(on_retry=self._on_retry(flow), stop=self.stop)(
                self._attempt, flow
            )
            flow.read_end = time.perf_counter()
            if flow.route.local:
                # After the chunk's last local piece: the worker runs in order.
                self.worker.submit(flow.queue.put, _DONE)
            else:
                flow.queue.put(_DONE)
        except BaseException as exc:  # handed to the consumer, which raises it
            flow.queue.put(exc)
        finally:
            flow.read_done.set()

    def _attempt(self, flow: _Flow) -> None:
        """One try at the keys of `flow` not yet delivered."""
        if self.stop.is_set():
            raise _Stopped
        loader = self.loader
        cut = flow.route.wire_cut
        session = loader.sessions.get(cut)
        ticket = ChunkTicket(
            session=session,
            chunk=flow.index,
            epoch=self.epoch,
            keys=list(flow.remaining),
            labels=list(flow.remaining.values()),
        )
        try:
            stream = flow.stream = loader.connection.stream(ticket)
            if flow.turn is None:
                if flow.previous is not None:
                    flow.previous.read_done.wait()
                if self.stop.is_set():
                    raise _Stopped
                flow.turn = time.perf_counter()
            report = None
            for part in stream:
                if self.stop.is_set():
                    raise _Stopped
                flow.bytes += part.nbytes
                if part.batch is not None and len(part.batch):
                    self._deliver(flow, part.batch)
                if part.report is not None:
                    report = part.report
        except SessionNotFound:
            loader.sessions.reopen(cut, session)
            raise
        if report is None:
            raise ServerUnavailable(
                f"the stream of chunk {flow.index} ended without its report, "
                f"{len(flow.remaining)} keys short: the server went away mid-chunk"
            )
        for skipped in report.skipped:
            flow.remaining.pop(skipped.key, None)
            flow.skipped.append(skipped)
        if report.server_s > 0:
            flow.server_s = (flow.server_s or 0.0) + report.server_s
        flow.queue_s += report.queue_s
        if flow.remaining:
            raise IncompleteEpoch(
                f"the server ended chunk {flow.index} without {len(flow.remaining)} of its "
                f"keys, e.g. {shorten(repr(list(flow.remaining)[:5]))}, and did not report "
                "them skipped"
            )

    def _deliver(self, flow: _Flow, batch: FeatureBatch) -> None:
        unasked = [k for k in batch.keys if k not in flow.remaining]
        if unasked:
            raise DuplicateDelivery(
                f"chunk {flow.index} brought keys it had delivered or never asked for, e.g. "
                f"{shorten(repr(unasked[:5]))}"
            )
        for key in batch.keys:
            del flow.remaining[key]
        if flow.route.local:
            self.worker.submit(self._compute, flow, batch)
        else:
            if batch.features is None:
                raise NotDecoded(
                    f"chunk {flow.index} came as raw bytes on a route that expects features: "
                    "a RAW session needs a loader that computes its chunks locally"
                )
            flow.queue.put(
                Piece(flow.index, flow.route.cut, batch.keys, batch.labels, batch.features)
            )
        if self.loader.on_part is not None:
            self.loader.on_part(flow.index, batch.keys)

    def _compute(self, flow: _Flow, batch: FeatureBatch) -> None:
        """A local chunk's raw batch to features, in the trainer's worker thread."""
        local = self.loader.local
        if self.stop.is_set():
            return
        try:
            if local is None:
                raise NotDecoded(
                    f"chunk {flow.index} is routed local but this loader has no LocalCompute "
                    "to decode its raw bytes"
                )
            t0 = self.clock()
            decoded, skipped = local(batch, self.epoch, flow.route.cut)
            flow.local_s += self.clock() - t0
        except BaseException as exc:  # handed to the consumer, which raises it
            flow.queue.put(exc)
            return
        flow.skipped += skipped
        if len(decoded):
            assert decoded.features is not None  # LocalCompute returns features
            flow.queue.put(
                Piece(flow.index, flow.route.cut, decoded.keys, decoded.labels, decoded.features)
            )

    def _on_retry(self, flow: _Flow) -> Callable[[tenacity.RetryCallState], None]:
        def on_retry(state: tenacity.RetryCallState) -> None:
            error = state.outcome.exception() if state.outcome is not None else None
            wait = state.next_action.sleep if state.next_action is not None else 0.0
            flow.backoff_s += wait
            with self.lock:
                self.stats.retries += 1
            if self.loader.record is None:
                return
            name = type(error).__name__
            self.loader.record(
                Event(
                    "retry",
                    self.epoch,
                    flow.index,
                    f"chunk {flow.index}: {name}, retry {state.attempt_number} in {wait:.2f} s "
                    f"for its {len(flow.remaining)} keys not yet delivered",
                    {
                        "error": name,
                        "message": shorten(str(error)),
                        "attempt": state.attempt_number,
                        "wait_s": wait,
                        "keys_left": len(flow.remaining),
                    },
                )
            )

        return on_retry

    def _shutdown(self) -> None:
        self.stop.set()
        for flow in self.flows:
            # Release streams waiting for their turn, and cut the ones being read.
            flow.read_done.set()
            stream = flow.stream
            if stream is not None and not flow.finished:
                stream.cancel()
        self.fetchers.shutdown(wait=True, cancel_futures=True)
        self.worker.shutdown(wait=True, cancel_futures=True)

    def _check_complete(self, delivered: set[str]) -> None:
        skipped = {s.key for s in self.stats.skipped}
        wanted = {k for keys, _ in self.chunks for k in keys}
        missing = wanted - delivered - skipped
        if missing:
            raise IncompleteEpoch(
                f"{len(missing)} keys of the epoch were neither delivered nor reported "
                f"skipped, e.g. {shorten(repr(sorted(missing)[:5]))}"
            )


class _Stopped(Exception):
    """The epoch ended (finished, failed or abandoned): a fetching thread gives up."""


def _check_once(keys: list[str], delivered: set[str]) -> None:
    dupes = delivered.intersection(keys)
    if dupes:
        raise DuplicateDelivery(
            f"{len(dupes)} keys delivered twice in one epoch, e.g. "
            f"{shorten(repr(sorted(dupes)[:5]))}: a chunk was delivered more than once"
        )
    delivered.update(keys)


def _busy_clock() -> Callable[[], float]:
    """The clock of a thread's busy time: its CPU time when torch computes in the calling
    thread (one intra-op thread: the trainer's own core, shared by its threads), else
    wall time (CPU time would miss the work of torch's other threads)."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
