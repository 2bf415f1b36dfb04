"""`Flow`: one chunk on its way from its sources to the trainer, and what it cost."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from hapi.client.pipeline._merge import ChunkMerge
from hapi.client.pipeline.routing import ChunkRecord, Route
from hapi.client.servers.pool import Member
from hapi.client.servers.source import PartStream
from hapi.data.columns import Column, Versions
from hapi.plan import ReadMeasurement, TrainMeasurement
from hapi.wire import SkippedKey

__all__ = ["DONE", "Flow", "Stopped", "busy_clock"]

DONE = object()
"""The last item of a chunk's queue once all its pieces are in it."""

_OVER = threading.Event()
_OVER.set()
"""The `kept` and `read_done` of every released flow: nothing waits on one any more, and
an Event of its own is ten objects each full garbage collection walks (an epoch keeps
its flows: at a million samples, 7,800 of them)."""


class Flow:
    """One chunk on its way: its route, the pieces it delivered, what it cost.

    What starts the same for every chunk is declared here with its default; `__init__`
    sets what depends on the chunk and the objects each needs of its own.
    """

    failed = False
    """Some try of it failed (its stream time then says little of the server's rate)."""
    moved = False
    """Its last failed try moved it to another server: retry at once."""
    fell_back = False
    """No server answered: its keys were read from the store and computed here."""
    computed_here = False
    """Some of its keys went to the trainer's worker (a local route, a fallback): its
    end is queued behind them."""
    rerouted = False
    """The plan's cut changed while it was in flight and it followed (`Router.reroute`):
    its stages' times mix two routes."""
    recalled = False
    """A change of plan cut its stream (`FeatureLoader.recall`) and it was asked again:
    its stages' times mix two streams."""
    merge: ChunkMerge | None = None
    """With the trainer's cache: puts its samples in order, cached or computed."""
    hits = 0
    """Keys the trainer's cache gave."""
    server_cached = 0
    """Keys the server's feature cache gave."""
    server_compiled = 0
    """Keys the server's compiled head computed."""
    server_head: str | None = None
    """How the server ran the head, when it said (`ChunkReport.head`)."""
    stream: PartStream | None = None
    turn: float | None = None
    read_end = 0.0
    backoff_s = 0.0
    bytes = 0
    server_s: float | None = None
    queue_s = 0.0
    local_s = 0.0
    train_s = 0.0
    samples = 0
    untrained = 0
    finished = False
    observed = False
    samples_read = 0
    read_bytes = 0
    """Object bytes servers read for it."""
    placed_bytes = 0
    """Of those, the bytes of servers that know where they are (`hapi serve --beside`)."""
    local_bytes = 0
    """Of `placed_bytes`, the bytes read from the reading server's own node."""
    where: np.ndarray | None = None
    """Its places in the manifest, for the servers' `Placement` and the cache's versions."""
    manifest_keys: Column[str] | None = None
    """The manifest's key column `where` indexes."""

    def __init__(
        self,
        index: int,
        keys: list[str],
        labels: list[int],
        route: Route,
        previous: Flow | None,
        member: Member,
        versions: Versions | None = None,
    ) -> None:
        self.index, self.route, self.previous = index, route, previous
        self.keys, self.labels = keys, labels
        self.versions = versions
        """The objects' versions as listed for the epoch: tickets carry them, for a server's
        feature cache. None: not listed."""
        self.window = route.local
        """The loader's window it holds a place in: its route's when issued (local or
        pushed down), whatever route it follows later."""
        self.member = member
        """The server it is asked of now."""
        self.held = len(keys)
        """Keys counted in flight on `member`."""
        self.size = len(keys)
        """Keys of its chunk (kept once `release` has let the keys go)."""
        self.remaining = dict(zip(keys, labels, strict=True))
        self.after: list[Flow] = []
        """Chunks of the epoch before with some of its keys, not yet kept in the cache
        when it was issued: it looks its keys up once they are."""
        self.kept = threading.Event()
        """Set once its samples are all in the cache (or it ended otherwise)."""
        self.queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.read_done = threading.Event()
        self.skipped: list[SkippedKey] = []
        self.issued = time.perf_counter()
        """When its request went out: after its session was open (the first chunk at a cut
        waits for the session to open, and the turn's wait for the server is timed from
        here - timed from before, the opening read as the link's, 1 Gbit/s as 2 MB/s)."""

    @property
    def its_routes_cost(self) -> bool:
        """Whether its stage times are its route's: not computed here for want of a
        server, nor re-routed or recalled in flight (the plan learns nothing from those)."""
        return not (self.fell_back or self.rerouted or self.recalled or self.hits == self.size)

    def release(self) -> None:
        """Let its keys, labels and events go, once delivered, trained and kept: an epoch
        keeps its flows to the end, and a million keys as strings take about 90 MB."""
        self.keys, self.labels, self.merge = [], [], None
        self.stream = None
        self.remaining.clear()
        # Its reading is over (its end was delivered), but its thread may not have said
        # so yet: a chunk waiting on the Event it holds goes on, and later ones find
        # `_OVER`.
        self.kept.set()
        self.read_done.set()
        self.kept = self.read_done = _OVER

    def read_measurement(self) -> ReadMeasurement:
        """What its read measured, for the router: its server's and link's times."""
        return ReadMeasurement(
            samples=self.samples_read,
            bytes=self.bytes,
            cut=self.route.wire_cut,
            server_s=self.server_s,
            transfer_s=self.link_s,
            transfer_buffered=self.link_buffered,
            issued=self.issued,
            read_end=self.read_end,
            chunk=self.index,
        )

    def train_measurement(self) -> TrainMeasurement:
        """What its training measured, for the router: its trainer's time."""
        route = self.route
        return TrainMeasurement(
            samples=self.samples,
            cut=route.wire_cut,
            trainer_s=self.trainer_s,
            feature_cut=route.cut if route.local else None,
            issued=self.issued,
            chunk=self.index,
        )

    def record(self, epoch: int) -> ChunkRecord:
        """What it cost in all, once delivered and trained: the epoch's record of it."""
        return ChunkRecord(
            chunk=self.index,
            epoch=epoch,
            route=self.route,
            samples=self.samples,
            bytes=self.bytes,
            server_s=self.server_s,
            transfer_s=self.link_s,
            transfer_buffered=self.link_buffered,
            trainer_s=self.trainer_s,
            issued=self.issued,
            read_end=self.read_end,
        )

    @property
    def trainer_s(self) -> float:
        """The trainer's compute on it: decoding and the head for a local chunk, the tail."""
        return self.local_s + self.train_s

    @property
    def stream_s(self) -> float:
        """The chunk's stream time while it had the link, less backoff."""
        return 0.0 if self.turn is None else max(0.0, self.read_end - self.turn - self.backoff_s)

    @property
    def transfer_s(self) -> float:
        """The link's busy time on this chunk: its stream's time while it had the link,
        less the server's compute still left when its turn came."""
        if self.turn is None:
            return 0.0
        waiting = max(0.0, (self.server_s or 0.0) + self.queue_s - (self.turn - self.issued))
        return max(0.0, self.stream_s - waiting)

    @property
    def link_buffered(self) -> bool:
        """Whether its bytes may have crossed before its turn: the server was done with it
        first, and its stream shares the connection with the chunk being read, so they
        can wait in the buffers between (TCP's, HTTP/2's windows). Its link time is then
        a lower bound: evidence of a link as slow as that, not of a faster one."""
        if self.turn is None or self.server_s is None:
            return False
        return self.server_s + self.queue_s <= self.turn - self.issued

    @property
    def link_s(self) -> float | None:
        """`transfer_s` when the stream shows the link's rate, else None: a stream that
        spent most of its time waiting for the server (or whose server does not report
        its time) says how fast the server was, not the link."""
        if self.server_s is None and not self.route.local:
            return None
        transfer = self.transfer_s
        return transfer if transfer > 0.5 * self.stream_s else None


class Stopped(Exception):
    """The epoch ended (finished, failed or abandoned): a fetching thread gives up."""


def busy_clock() -> Callable[[], float]:
    """The clock of a thread's busy time: its CPU time when torch computes in the calling
    thread (one intra-op thread: the trainer's own core, shared by its threads), else
    wall time (CPU time would miss the work of torch's other threads)."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
