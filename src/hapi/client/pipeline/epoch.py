"""One epoch's run of the loader: its chunks issued in order as its windows allow, read by
the fetcher, and handed on in epoch order as training batches (see `hapi.client.pipeline.loader`).
A run starts the next epoch itself while it drains (`then`); the loader takes that run up
when the next epoch is asked for (`take_ahead`)."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field

from hapi.client.pipeline._flow import DONE, Flow
from hapi.client.pipeline.fetch import FetchContext, Fetcher
from hapi.client.pipeline.keys import Chunks, EpochKeys
from hapi.client.pipeline.rebatch import Batch, Piece, Rebatcher
from hapi.client.pipeline.routing import ChunkRecord, Route
from hapi.client.servers.placement import Backlog
from hapi.client.servers.pool import Member
from hapi.data.columns import Versions
from hapi.errors import DuplicateDelivery, IncompleteEpoch, shorten
from hapi.plan import HYBRID_LOCAL_WINDOW
from hapi.wire import SkippedKey

__all__ = ["EpochRun", "LoaderStats", "RunContext", "Windows"]


@dataclass(frozen=True)
class RunContext:
    """What each epoch's run of a loader needs, the same for all of them.

    Args:
        fetch: what fetching needs (servers, router, cache, local compute, hooks).
        keys: each epoch's order, chunks and versions.
        batch_size: the training batch size.
        prefetch: chunks in flight per server and route (K).
    """

    fetch: FetchContext
    keys: EpochKeys
    batch_size: int
    prefetch: int


@dataclass
class LoaderStats:
    """What the loader moved, waited for and measured in the current epoch."""

    bytes_received: int = 0
    chunks: int = 0
    chunks_local: int = 0
    samples: int = 0
    retries: int = 0
    failovers: int = 0
    """Chunks moved to another server after theirs failed."""
    fallbacks: int = 0
    """Chunks computed here from the store's bytes: no server answered."""
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
    cached: int = 0
    """Samples the trainer's feature cache gave (no server, no link)."""
    server_cached: int = 0
    """Samples a server's feature cache gave (no read, no head)."""
    server_compiled: int = 0
    """Samples a server's compiled head computed."""
    server_head: str = ""
    """How the server last said it runs the head (compiled, or why not); empty: eager."""
    read_bytes: int = 0
    placed_bytes: int = 0
    local_bytes: int = 0
    skipped: list[SkippedKey] = field(default_factory=list)
    records: list[ChunkRecord] = field(default_factory=list)
    """Every chunk, delivered and trained, in order."""

    @property
    def trainer_s(self) -> float:
        """The trainer's busy time."""
        return self.train_s + self.postprocess_s + self.convert_s


class Windows:
    """The loader's windows (see the module's note), one per route (local: True): chunks
    issued and not yet read, and issued and not yet trained. An epoch started ahead shares
    its predecessor's: the chunks of both count against them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.issued = threading.Condition(self.lock)
        """Notified as chunks are issued (with `lock` held)."""
        self.unread = {False: 0, True: 0}
        self.untrained = {False: 0, True: 0}


class EpochRun:
    """One epoch's run: fetching threads, the local worker, and the consuming generator."""

    def __init__(
        self,
        context: RunContext,
        epoch: int,
        chunks: Chunks,
        *,
        windows: Windows | None = None,
        before: EpochRun | None = None,
        versions: Versions | None = None,
    ) -> None:
        self.context, self.epoch, self.chunks = context, epoch, chunks
        self.versions = versions
        fetch = context.fetch
        if fetch.cache is not None:
            fetch.cache.set_versions(epoch, versions)
        self.stats = LoaderStats(skipped=context.keys.lost())
        self.flows: list[Flow] = []
        self.before = before.flows if before is not None else []
        self.before_epoch = before.epoch if before is not None else None
        """The epoch before's chunks, when this one started ahead: its first chunk on each
        server is read after that epoch's last there."""
        self.then: int | None = None
        """The epoch to start once every chunk of this one is issued (None: none)."""
        self.ahead: EpochRun | None = None
        self._starting_ahead = False
        self._ahead_dropped = False
        """The next epoch was taken or dropped: none is started after."""
        self.prefetch = context.prefetch * len(fetch.servers)
        # A thread for every chunk in flight: K per route.
        self.fetcher = Fetcher(fetch, epoch, 2 * self.prefetch, on_read=self._read_one)
        self.clock = self.fetcher.clock
        self.windows = windows or Windows()
        self._issued = 0
        self._next: Route | None = None
        """The route of the next chunk to issue, once it has one and waits for its window."""
        self._held = -(-context.batch_size // context.keys.chunk_size) + 1
        self._trained = 0
        self._began = time.monotonic()
        """When this epoch's batches were first asked for (`run`): a run started ahead
        waits for the epoch before, which is not its own time."""
        self._listing_ahead = False
        self._settled: collections.deque[Flow] = collections.deque()
        """Flows settled, in order, whose keys `release` lets go once they are kept."""
        placement = fetch.servers.placement
        self._backlog = (
            Backlog(
                placement.homes,
                chunks.order[chunks.bounds[0] : chunks.bounds[-1]],
                len(fetch.servers),
            )
            if placement is not None
            and isinstance(chunks, Chunks)
            and len(placement.homes) == len(chunks.manifest)
            else None
        )
        """Each server's own keys in the chunks not yet issued, where keys have homes."""

    def _maybe_list_ahead(self) -> None:
        """Begin the next epoch's listing once this epoch's rest is about as long as a
        listing takes (with a margin): the next epoch then starts at once, and its
        versions are still those of this epoch's last seconds."""
        if self.then is None or self._listing_ahead or self._starting_ahead or not self._trained:
            return  # no next epoch, or its listing is begun or taken
        keys = self.context.keys
        elapsed = time.monotonic() - self._began
        rest = elapsed * (len(self.chunks) - self._trained) / self._trained
        # Three times the last listing: beside training on the trainer's core, a listing
        # of 10^5 keys took twice its time alone (4.2 s against 2.0 s).
        if rest <= 3 * keys.listing_s + 0.5:
            self._listing_ahead = True
            keys.list_ahead()

    def run(self) -> Generator[Batch, None, None]:
        batch_size = self.context.batch_size
        rebatcher = Rebatcher(self.context.fetch.convert, clock=self.clock)
        n = len(self.chunks)
        complete = False
        self.before = []  # the epoch before ended: every chunk of it was read
        self._began = time.monotonic()
        try:
            self._advance()
            for j in range(n):
                flow = self._issued_flow(j)
                # Checked chunk by chunk, not against a set of the epoch's every key (a
                # million strings): a chunk's keys are its own in the epoch's order.
                delivered: set[str] = set()
                while True:
                    t0 = time.perf_counter()
                    item = flow.queue.get()
                    self.stats.wait_s += time.perf_counter() - t0
                    if isinstance(item, BaseException):
                        raise item
                    if item is DONE:
                        break
                    assert isinstance(item, Piece)
                    _check_once(item.keys, delivered)
                    flow.samples += len(item)
                    flow.untrained += len(item)
                    rebatcher.add(item)
                    while len(rebatcher) >= batch_size:
                        yield from self._emit(rebatcher.take(batch_size))
                _check_complete(flow, delivered)
                self._finish(flow)
                self._advance(trained=flow)
            if len(rebatcher):
                yield from self._emit(rebatcher.take(len(rebatcher)))
            complete = True
        finally:
            self.fetcher.shutdown(self.flows)
            if not complete:
                self.drop_ahead()  # an epoch that failed or was left has no next one

    def _issued_flow(self, j: int) -> Flow:
        """Chunk `j`, once issued: the chunk before it can be trained before the thread
        that read it has freed its place in the window (its end is queued first)."""
        with self.windows.issued:
            while j >= len(self.flows):
                self.windows.issued.wait(0.1)
            return self.flows[j]

    def _read_one(self, flow: Flow) -> None:
        """A chunk's stream was read (or gave up): its place in flight is free."""
        self._advance(read=flow)

    def _advance(self, *, read: Flow | None = None, trained: Flow | None = None) -> None:
        """Issue, in order, the chunks the windows allow now; from the consumer (a chunk
        trained) and from the fetching threads (a chunk read). Once all are issued, the
        next epoch's chunks, started ahead."""
        windows = self.windows
        with windows.lock:
            if read is not None:
                windows.unread[read.window] -= 1
            if trained is not None:
                windows.untrained[trained.window] -= 1
                self._trained += 1
                self._maybe_list_ahead()
            while self._issued < len(self.chunks) and not self.fetcher.stop.is_set():
                router = self.context.fetch.router
                if self._next is None or router.changing:
                    # Routed again if the plan changed while it waited for its window: the
                    # change applies from it, not from the chunk after.
                    self._next = router.route(self._issued)
                local = self._next.local
                window = self.prefetch
                if local and self._next.share < 1.0:
                    window = HYBRID_LOCAL_WINDOW * len(self.context.fetch.servers)
                if (
                    windows.unread[local] >= window
                    or windows.untrained[local] >= self.prefetch + self._held
                ):
                    break
                self._issue(self._issued, self._next)
                windows.issued.notify_all()
                windows.unread[local] += 1
                windows.untrained[local] += 1
                self._issued += 1
                self._next = None
            start_ahead = (
                self.ahead is None
                and not self._starting_ahead
                and self.then is not None
                and self._issued == len(self.chunks)
                and not self.fetcher.stop.is_set()
            )
            self._starting_ahead |= start_ahead
        if start_ahead:
            assert self.then is not None
            # Listed outside the windows' lock: a listing may take a while.
            keys = self.context.keys
            versions = keys.versions()
            chunks = keys.chunks(self.then)
            with windows.lock:
                if not self.fetcher.stop.is_set() and not self._ahead_dropped:
                    self.context.fetch.router.start(self.then, len(chunks))
                    self.ahead = EpochRun(
                        self.context,
                        self.then,
                        chunks,
                        windows=windows,
                        before=self,
                        versions=versions,
                    )
        if self.ahead is not None:
            self.ahead._advance()

    def take_ahead(self) -> EpochRun | None:
        """The next epoch this run started (None: none), now the caller's to run or shut
        down; none is started after this."""
        with self.windows.lock:
            ahead, self.ahead = self.ahead, None
            self._ahead_dropped = True
        return ahead

    def drop_ahead(self) -> None:
        """Shut down the next epoch this run started, if any: it will not be asked for."""
        ahead = self.take_ahead()
        if ahead is not None:
            ahead.shutdown()

    def _issue(self, index: int, route: Route) -> None:
        keys, labels = self.chunks[index]
        where = self.chunks.indices(index)
        ahead = None
        if self._backlog is not None:
            self._backlog.issue(where)
            ahead = self._backlog.ahead(more=self.then is not None)
        member = self.context.fetch.servers.pick(keys, where=where, ahead=ahead)
        # Each server's link serves its chunks in order: this one's stream is read after
        # the last one issued to the same server.
        previous = _last_on(member, self.flows) or _last_on(member, self.before)
        flow = Flow(index, keys, labels, route, previous, member, self.versions)
        flow.where, flow.manifest_keys = where, self.chunks.manifest.keys
        cache = self.context.fetch.cache
        if (
            self.before
            and self.before_epoch is not None
            and cache is not None
            and cache.repeats(self.before_epoch, self.epoch)
        ):
            wanted = set(keys)
            flow.after = [
                f for f in self.before if not f.kept.is_set() and wanted.intersection(f.keys)
            ]
        self.flows.append(flow)
        self.fetcher.start(flow)

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

    def _finish(self, flow: Flow) -> None:
        """Every piece of `flow` was delivered."""
        flow.finished = True
        stats = self.stats
        stats.chunks += 1
        stats.retries = self.fetcher.retries
        stats.failovers = self.fetcher.failovers
        stats.fallbacks += flow.fell_back
        stats.chunks_local += flow.route.local
        stats.samples += flow.samples
        stats.bytes_received += flow.bytes
        stats.skipped += flow.skipped
        stats.cached += flow.hits
        stats.server_cached += flow.server_cached
        stats.server_compiled += flow.server_compiled
        stats.server_head = flow.server_head or stats.server_head
        stats.read_bytes += flow.read_bytes
        stats.placed_bytes += flow.placed_bytes
        stats.local_bytes += flow.local_bytes
        stats.postprocess_s += flow.local_s
        stats.transfer_s += flow.transfer_s
        if flow.server_s is not None:
            stats.server_s += flow.server_s
            stats.server_reported = True
        self._settle(flow)

    def _settle(self, flow: Flow) -> None:
        """Once a chunk is delivered and trained, the router sees what it cost."""
        if flow.observed or not flow.finished or flow.untrained:
            return
        flow.observed = True
        self.stats.records.append(flow.record(self.epoch))
        # Its server and link were observed when it was read (`Fetcher.fetch`); now its
        # trainer.
        if flow.its_routes_cost:
            self.context.fetch.router.observe(flow.train_measurement())
        self._settled.append(flow)
        while self._settled and self._settled[0].kept.is_set():
            self._settled.popleft().release()

    def shutdown(self) -> None:
        """End its threads and those of any epoch it started ahead."""
        self.fetcher.shutdown(self.flows)
        if self.ahead is not None:
            self.ahead.shutdown()


def _last_on(member: Member, flows: list[Flow]) -> Flow | None:
    return next((f for f in reversed(flows) if f.member is member), None)


def _check_once(keys: list[str], delivered: set[str]) -> None:
    """A piece brings keys not delivered before in its chunk."""
    dupes = delivered.intersection(keys)
    if dupes:
        raise DuplicateDelivery(
            f"{len(dupes)} keys delivered twice in one epoch, e.g. "
            f"{shorten(repr(sorted(dupes)[:5]))}: a chunk was delivered more than once"
        )
    delivered.update(keys)


def _check_complete(flow: Flow, delivered: set[str]) -> None:
    """Every key of `flow`'s chunk was delivered or reported skipped, and no other."""
    wanted = set(flow.keys)
    foreign = delivered - wanted
    if foreign:
        raise DuplicateDelivery(
            f"chunk {flow.index} delivered {len(foreign)} keys of other chunks, e.g. "
            f"{shorten(repr(sorted(foreign)[:5]))}: a key was delivered more than once"
        )
    missing = wanted - delivered - {s.key for s in flow.skipped}
    if missing:
        raise IncompleteEpoch(
            f"{len(missing)} keys of the epoch were neither delivered nor reported "
            f"skipped, e.g. {shorten(repr(sorted(missing)[:5]))}"
        )
