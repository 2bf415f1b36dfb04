"""Fetching an epoch's chunks: one thread per chunk in flight, one local worker.

Each chunk's request goes out when it is issued; its stream is read when the chunk
before it has been read (the link serves chunks in order, see `hapi.client.pipeline.loader`).
Pieces go to the chunk's queue as they arrive: features as they are, raw bytes through
the local worker, which decodes them and runs the head in the trainer. A failed stream
is retried for the keys it has not delivered - on another server when its own is
unreachable - and the error that ends the retries goes to the queue, for the consumer to
raise.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import tenacity
import torch

from hapi.client.pipeline import _fetch_events as events
from hapi.client.pipeline._flow import DONE, Flow, Stopped, busy_clock
from hapi.client.pipeline._merge import ChunkMerge
from hapi.client.pipeline.history import Event, ignore_event
from hapi.client.pipeline.rebatch import Convert, Piece
from hapi.client.pipeline.routing import Router
from hapi.client.pipeline.trainer_cache import TrainerCache
from hapi.client.servers.local import LocalCompute
from hapi.client.servers.pool import Servers
from hapi.client.servers.retry import RetryPolicy
from hapi.client.servers.source import PartStream
from hapi.data import ObjectStore
from hapi.errors import (
    DuplicateDelivery,
    IncompleteEpoch,
    NotDecoded,
    ServerUnavailable,
    SessionNotFound,
    StoreUnavailable,
    StreamRecalled,
    shorten,
)
from hapi.wire import ChunkReport, ChunkTicket, FeatureBatch

__all__ = ["DONE", "FetchContext", "Fetcher", "Flow", "busy_clock"]


@dataclass(frozen=True)
class FetchContext:
    """What fetching a loop's chunks needs, the same for each of its epochs.

    Args:
        servers: the loop's servers and their sessions.
        retry: how long a failing chunk is retried.
        router: each chunk's route, and where its measurements go.
        local: computes local chunks from raw bytes (None: a loop with none).
        convert: carries features to a later cut.
        cache: the trainer's feature cache of the loop (None: none).
        fallback: the store, read while no server answers (None: chunks wait).
        record: receives the loop's events (retries, failovers, re-routes).
        on_part: called after each part of a chunk is handed on: (chunk, keys).
    """

    servers: Servers
    retry: RetryPolicy
    router: Router
    local: LocalCompute | None = None
    convert: Convert | None = None
    cache: TrainerCache | None = None
    fallback: ObjectStore | None = None
    record: Callable[[Event], None] = ignore_event
    on_part: Callable[[int, list[str]], None] | None = None


class Fetcher:
    """The threads that fetch one epoch's chunks and compute its local ones.

    Args:
        context: the loop's servers, retry policy, router, local compute, cache and hooks.
        epoch: the epoch (seeds the samples; tickets carry it).
        in_flight: chunks in flight at most, one thread each.
        on_read: called in the fetching thread with each chunk whose stream is done
            (read, or given up): the loader issues the next chunk then.
    """

    def __init__(
        self,
        context: FetchContext,
        epoch: int,
        in_flight: int,
        *,
        on_read: Callable[[Flow], None] | None = None,
    ) -> None:
        self.context, self.epoch = context, epoch
        self.on_read = on_read
        self.stop = threading.Event()
        self.clock = busy_clock()
        self.retries = 0
        self.failovers = 0
        self._lock = threading.Lock()
        self._threads = ThreadPoolExecutor(in_flight, thread_name_prefix="hapi-fetch")
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="hapi-local")

    def start(self, flow: Flow) -> None:
        """Fetch `flow` in a thread of its own."""
        self._threads.submit(self.fetch, flow)

    def fetch(self, flow: Flow) -> None:
        """Read `flow`'s chunk in its turn, retrying; in a fetching thread."""
        try:
            if self.stop.is_set():
                return
            if self.context.cache is not None:
                self._from_cache(flow)
            if flow.remaining:
                self.context.retry.retrying(
                    on_retry=self._on_retry(flow), stop=self.stop, at_once=lambda _: flow.moved
                )(self._attempt, flow)
            flow.read_end = time.perf_counter()
            if flow.fell_back or not flow.samples_read:
                # Its server did not finish it (or had none of it): nothing to learn of it.
                self.context.servers.release(flow.member, flow.held)
            else:
                self.context.servers.finished(
                    flow.member,
                    flow.held,
                    flow.samples_read,
                    measured=not (flow.failed or flow.rerouted or flow.recalled),
                    where=flow.where,
                )
            flow.held = 0
            if flow.its_routes_cost:
                # Its server's and link's times are known now, a batch or more before it
                # is trained: the re-planner sees a drift that much sooner.
                self.context.router.observe(flow.read_measurement())
            if flow.merge is not None:
                # After its last computed piece (the worker runs in order): the skipped
                # keys let the rest of the chunk go.
                self.worker.submit(self._end_merge, flow)
            elif flow.computed_here:
                # After the chunk's last local piece: the worker runs in order.
                self.worker.submit(flow.queue.put, DONE)
            else:
                flow.queue.put(DONE)
            if flow.merge is None:
                flow.kept.set()  # nothing of it is kept: no chunk need wait for it
        except BaseException as exc:  # handed to the consumer, which raises it
            flow.queue.put(exc)
            flow.kept.set()
        finally:
            flow.read_done.set()
            if self.on_read is not None:
                self.on_read(flow)

    def _attempt(self, flow: Flow) -> None:
        """One try at the keys of `flow` not yet delivered; again at once on a new route
        while the plan's cut changes under it."""
        while not self._stream_once(flow):
            pass

    def _stream_once(self, flow: Flow) -> bool:
        """Stream the keys of `flow` not yet delivered; False: it was re-routed (its
        stream cut) and its remaining keys go again on its new route."""
        if self.stop.is_set():
            raise Stopped
        if not flow.remaining:
            return True  # every key came before its stream was cut, only the report did not
        servers = self.context.servers
        flow.moved = False
        if self.context.fallback is not None and not any(servers.usable(m) for m in servers):
            self._fall_back(flow)
            return True
        if not servers.usable(flow.member) and servers.others_usable(flow.member):
            self._move(flow, None)  # its server failed another chunk meanwhile
        member = flow.member
        cut = flow.route.wire_cut
        session: str | None = None
        try:
            session = member.sessions.get(cut)
            ticket = self._ticket(flow, session)
            if flow.turn is None:
                flow.issued = time.perf_counter()
            report = self._read(flow, member.connection.stream(ticket))
            if report is None:
                return False
        except StreamRecalled:
            # A change of plan moved the chunks in flight and cut their connection, with
            # what the server had sent ahead: the keys not yet delivered go again at once,
            # on the route the plan gives them now.
            flow.recalled = True
            self._reroute(flow)
            return False
        except SessionNotFound:
            flow.failed = True
            if session is not None:
                member.sessions.reopen(cut, session)
            raise
        except ServerUnavailable as exc:
            # Set its server aside and give the chunk to another, if one is up; a store
            # that is away is every server's, so StoreUnavailable stays and backs off.
            flow.failed = True
            servers.failed(member)
            if servers.others_usable(member):
                self._move(flow, exc)
            raise
        except StoreUnavailable:
            flow.failed = True
            raise
        self._take_report(flow, report)
        return True

    def _ticket(self, flow: Flow, session: str) -> ChunkTicket:
        """The request for the keys of `flow` not yet delivered, in `session`."""
        return ChunkTicket(
            session=session,
            chunk=flow.index,
            epoch=self.epoch,
            keys=list(flow.remaining),
            labels=list(flow.remaining.values()),
            versions=(
                flow.versions.of(list(flow.remaining)) if flow.versions is not None else None
            ),
        )

    def _read(self, flow: Flow, stream: PartStream) -> ChunkReport | None:
        """Read the stream of `flow` when its turn comes, delivering its batches; its
        report, or None when it was re-routed meanwhile (the stream cancelled)."""
        flow.stream = stream
        if flow.turn is None:
            self._wait_turn(flow)
        if self._reroute(flow):  # the cut changed while it waited for its turn
            stream.cancel()
            return None
        report = None
        for part in stream:
            if self.stop.is_set():
                raise Stopped
            flow.bytes += part.nbytes
            if part.batch is not None and len(part.batch):
                self._deliver(flow, part.batch)
            if part.report is not None:
                report = part.report
            elif flow.remaining and self._reroute(flow):
                stream.cancel()
                return None
        if report is None:
            raise ServerUnavailable(
                f"the stream of chunk {flow.index} ended without its report, "
                f"{len(flow.remaining)} keys short: the server went away mid-chunk"
            )
        return report

    def _wait_turn(self, flow: Flow) -> None:
        """Wait until the chunk before `flow` is read: the link serves chunks in order."""
        if flow.previous is not None:
            flow.previous.read_done.wait()
            # Its turn came: let go of the chunk before it, or through the chain
            # every chunk of a fit's epochs would stay reachable.
            flow.previous = None
        if self.stop.is_set():
            raise Stopped
        flow.turn = time.perf_counter()

    def _take_report(self, flow: Flow, report: ChunkReport) -> None:
        """Count what the server's report of `flow` says: its skipped keys, its times.

        Raises:
            IncompleteEpoch: the server left keys out without reporting them skipped.
        """
        for skipped in report.skipped:
            flow.remaining.pop(skipped.key, None)
            flow.skipped.append(skipped)
        flow.server_cached += report.cached
        flow.server_compiled += report.compiled
        flow.server_head = report.head or flow.server_head
        flow.read_bytes += report.read_bytes
        if report.local_bytes is not None:
            flow.placed_bytes += report.read_bytes
            flow.local_bytes += report.local_bytes
        if report.server_s > 0:
            flow.server_s = (flow.server_s or 0.0) + report.server_s
        flow.queue_s += report.queue_s
        if flow.remaining:
            raise IncompleteEpoch(
                f"the server ended chunk {flow.index} without {len(flow.remaining)} of its "
                f"keys, e.g. {shorten(repr(list(flow.remaining)[:5]))}, and did not report "
                "them skipped"
            )

    def _reroute(self, flow: Flow) -> bool:
        """Move `flow` to the route the plan in force gives it, if that changed."""
        route = self.context.router.reroute(flow.route)
        if route == flow.route:
            return False
        old, flow.route, flow.rerouted = flow.route, route, True
        self.context.record(events.reroute(self.epoch, flow, old))
        return True

    def _move(self, flow: Flow, error: BaseException | None) -> None:
        """Give `flow`'s undelivered keys to another server (for its next try)."""
        servers = self.context.servers
        old = flow.member
        servers.release(old, flow.held)
        new = servers.pick(list(flow.remaining), avoid=old, where=flow.where)
        flow.held = len(flow.remaining)
        if new is old:
            return
        flow.member, flow.moved = new, error is not None
        # Its place in the old server's order means nothing on the new one's link.
        flow.previous = None
        with self._lock:
            self.failovers += 1
        why = type(error).__name__ if error is not None else "set aside"
        self.context.record(events.failover(self.epoch, flow, old, why))

    def _fall_back(self, flow: Flow) -> None:
        """Read `flow`'s undelivered keys from the store and compute them here, as a local
        chunk is: every server is set aside. A store that is away is retried like a
        server; a missing or corrupt object is the decoder's (`on_error`)."""
        store = self.context.fallback
        assert store is not None  # the caller checks
        keys, labels = list(flow.remaining), list(flow.remaining.values())
        blobs = store.get_many(keys)
        for blob in blobs:
            if isinstance(blob, StoreUnavailable):
                raise blob
        if not flow.fell_back:
            self.context.record(events.fallback(self.epoch, flow, store))
        flow.fell_back = True
        for key in keys:
            del flow.remaining[key]
        flow.samples_read += len(keys)
        flow.bytes += sum(len(b) for b in blobs if isinstance(b, bytes))
        flow.computed_here = True
        # The decoder takes a read's exception in place of its bytes (`load_samples`).
        raw = FeatureBatch(keys, torch.tensor(labels, dtype=torch.int64), data=blobs)  # type: ignore[arg-type]
        self.worker.submit(self._compute, flow, raw, flow.route.cut)

    def _deliver(self, flow: Flow, batch: FeatureBatch) -> None:
        unasked = [k for k in batch.keys if k not in flow.remaining]
        if unasked:
            raise DuplicateDelivery(
                f"chunk {flow.index} brought keys it had delivered or never asked for, e.g. "
                f"{shorten(repr(unasked[:5]))}"
            )
        for key in batch.keys:
            del flow.remaining[key]
        flow.samples_read += len(batch.keys)
        if flow.route.local:
            flow.computed_here = True
            self.worker.submit(self._compute, flow, batch, flow.route.cut)
        else:
            if batch.features is None:
                raise NotDecoded(
                    f"chunk {flow.index} came as raw bytes on a route that expects features: "
                    "a RAW session needs a loader that computes its chunks locally"
                )
            piece = Piece(flow.index, flow.route.cut, batch.keys, batch.labels, batch.features)
            if flow.merge is not None:
                # Kept at the freeze point and ordered with the cached samples, in the
                # worker: carrying features to the freeze point is the trainer's compute.
                flow.computed_here = True
                self.worker.submit(self._cache_in, flow, piece)
            elif flow.computed_here:
                # Re-routed from local: behind its raw pieces still in the worker, so the
                # chunk's samples keep their order (and the batches theirs).
                self.worker.submit(flow.queue.put, piece)
            else:
                flow.queue.put(piece)
        if self.context.on_part is not None:
            self.context.on_part(flow.index, batch.keys)

    def _compute(self, flow: Flow, batch: FeatureBatch, cut: int) -> None:
        """A local chunk's raw batch to features at `cut` (its route's when it came: a
        re-route may change the route meanwhile), in the trainer's worker thread."""
        local = self.context.local
        if self.stop.is_set():
            return
        try:
            if local is None:
                raise NotDecoded(
                    f"chunk {flow.index} is routed local but this loader has no LocalCompute "
                    "to decode its raw bytes"
                )
            cache = self.context.cache
            if flow.merge is not None and cache is not None:
                cut = cache.cut  # kept at the freeze point
            t0 = self.clock()
            decoded, skipped = local(batch, self.epoch, cut)
            flow.local_s += self.clock() - t0
        except BaseException as exc:  # handed to the consumer, which raises it
            flow.queue.put(exc)
            return
        flow.skipped += skipped
        if flow.merge is not None:
            flow.merge.skip([s.key for s in skipped])
        if len(decoded):
            assert decoded.features is not None  # LocalCompute returns features
            piece = Piece(flow.index, cut, decoded.keys, decoded.labels, decoded.features)
            if flow.merge is not None:
                self._cache_in(flow, piece)
            else:
                flow.queue.put(piece)

    def _from_cache(self, flow: Flow) -> None:
        """Take `flow`'s cached samples: only the others are asked of a server. Its
        samples then go on in order through a merge, at the freeze point."""
        cache = self.context.cache
        assert cache is not None  # the caller checks
        if cache.versions(self.epoch) is None:
            return  # not listed this epoch: nothing to look up or keep
        for before in flow.after:
            # The epoch before is still computing some of its keys (this epoch started
            # ahead): they are hits once kept.
            while not before.kept.wait(0.05):
                if self.stop.is_set():
                    raise Stopped
        flow.after = []
        flow.merge = ChunkMerge(flow.index, cache.cut, flow.keys, flow.labels, flow.queue.put)
        column, where = flow.manifest_keys, flow.where
        places = (column, where) if column is not None and where is not None else None
        hits, rows = cache.lookup(self.epoch, flow.keys, places)
        if rows is None:
            return
        for key in hits:
            del flow.remaining[key]
        flow.hits = len(hits)
        self.context.servers.release(flow.member, len(hits))
        flow.held -= len(hits)
        flow.merge.add(hits, rows)

    def _cache_in(self, flow: Flow, piece: Piece) -> None:
        """A computed piece into the cache and on in order, at the freeze point; in the
        worker thread."""
        cache, merge = self.context.cache, flow.merge
        assert cache is not None and merge is not None  # the caller checks
        if self.stop.is_set():
            return
        try:
            features = piece.features
            if piece.cut < cache.cut:
                convert = self.context.convert
                if convert is None:
                    raise NotDecoded(
                        f"chunk {flow.index} came at cut {piece.cut}, before the freeze point "
                        f"{cache.cut}, and this loader cannot carry features forward"
                    )
                t0 = self.clock()
                features = convert(features, piece.cut, cache.cut)
                flow.local_s += self.clock() - t0
            # As the cache keeps it: a sample is the same from either source.
            features = features.to(cache.dtype)
            cache.store(self.epoch, piece.keys, features)
        except BaseException as exc:  # handed to the consumer, which raises it
            flow.queue.put(exc)
            return
        merge.add(piece.keys, features)

    def _end_merge(self, flow: Flow) -> None:
        """Every piece of `flow` is in: its skipped keys let the rest go, then its end."""
        assert flow.merge is not None
        flow.kept.set()
        flow.merge.skip([s.key for s in flow.skipped])
        if flow.merge.pending and not self.stop.is_set():
            flow.queue.put(
                IncompleteEpoch(
                    f"chunk {flow.index} ended with {flow.merge.pending} of its keys neither "
                    "delivered nor reported skipped"
                )
            )
            return
        flow.queue.put(DONE)

    def _on_retry(self, flow: Flow) -> Callable[[tenacity.RetryCallState], None]:
        def on_retry(state: tenacity.RetryCallState) -> None:
            error = state.outcome.exception() if state.outcome is not None else None
            wait = state.next_action.sleep if state.next_action is not None else 0.0
            flow.backoff_s += wait
            with self._lock:
                self.retries += 1
            self.context.record(events.retry(self.epoch, flow, error, state.attempt_number, wait))

        return on_retry

    def shutdown(self, flows: list[Flow]) -> None:
        """End the epoch's threads: streams are cut, backoffs end, nothing is left running."""
        self.stop.set()
        for flow in flows:
            self.context.servers.release(flow.member, flow.held)
            flow.held = 0
            flow.kept.set()
            # Release streams waiting for their turn, and cut the ones being read.
            flow.read_done.set()
            stream = flow.stream
            if stream is not None and not flow.finished:
                stream.cancel()
        self._threads.shutdown(wait=True, cancel_futures=True)
        self.worker.shutdown(wait=True, cancel_futures=True)
