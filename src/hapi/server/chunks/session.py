"""A session: one job's head, transforms and wire format on a server, and its chunk pipeline."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import pyarrow as pa
import torch
from torch import nn

from hapi._fx_lock import TRACING
from hapi.data import ObjectStore, Transforms
from hapi.data.samples import (
    Sample,
    Skipped,
    load_one,
    read_objects,
    skip_or_raise,
)
from hapi.data.shards.blob import Blob
from hapi.errors import InvalidRequest, OverBudget, shorten
from hapi.graph import RAW
from hapi.graph.precision import running_in
from hapi.server.chunks._batch_tuner import START, BatchTuner
from hapi.server.chunks._batches import WIRE_BATCH_BYTES, Sent, Wire, encode, samples_per_batch
from hapi.server.chunks._compiled import CompiledHead
from hapi.server.chunks._counters import SessionCounters, TimedReads
from hapi.server.chunks._outbox import Outbox
from hapi.server.chunks.tier import NO_FEATURE_CACHE, ChunkLookup, FeatureTier
from hapi.server.locality import Locality
from hapi.server.memory.batch_memory import decoding, object_decode_bytes
from hapi.server.memory.budget import MemoryModel
from hapi.server.memory.scheduler import Demand, Grant, Place, Scheduler
from hapi.wire import (
    ChunkReport,
    ChunkTicket,
    SessionInfo,
    SessionRequest,
    SkippedKey,
)

__all__ = ["Session", "SessionCounters"]

RAW_BATCH_BYTES = WIRE_BATCH_BYTES
"""RAW batches are cut at about this many bytes (`WIRE_BATCH_BYTES`)."""
_Out = Outbox[Wire]
AHEAD_BATCHES = 2
"""Batches a chunk computes ahead of its stream (the one it is sending apart): enough to
overlap computing and sending, few enough that a chunk held up by a slow link holds
little, and that one whose client leaves computed little for nobody."""


@dataclass
class _ChunkClock:
    """A chunk's time at the scheduler: what its report says."""

    server_s: float = 0.0
    queue_s: float = 0.0
    compiled: int = 0
    """Samples the compiled head computed."""


@dataclass
class Session:
    """One job's state on a server. Chunks of a session may run concurrently; each of
    their batches runs under a grant of the server's `Scheduler`."""

    id: str
    request: SessionRequest
    info: SessionInfo
    schema: pa.Schema
    head: nn.Module | None
    transforms: Transforms
    device: torch.device
    batch_size: int
    """The largest feature-extraction batch; the scheduler may grant smaller ones."""
    last_used: float
    """When a chunk of this session last started (the server's clock)."""
    read_ahead: int = 16
    """Objects a chunk reads ahead of the one it decodes."""
    memory: MemoryModel = field(default_factory=lambda: MemoryModel(fixed=0, per_sample=0))
    """What a batch of this session holds in the budget (measured at open)."""
    scheduler: Scheduler = field(default_factory=lambda: Scheduler(1 << 62, 1 << 10))
    """The server's scheduler (a private, unbounded one by default)."""
    tenant: str | None = None
    """The tenant that opened the session."""
    weight: float = 1.0
    """Its tenant's weight in the server's fair share."""
    stats: SessionCounters = field(default_factory=SessionCounters)
    features: FeatureTier = NO_FEATURE_CACHE
    """The server's feature cache: chunks send its hits and offer it their misses."""
    head_dtype: torch.dtype = torch.float32
    """What the head computes in (`hapi.graph.precision`)."""
    locality: Locality | None = None
    """Where the server is in a storage cluster: its chunks count their local bytes."""
    tuner: BatchTuner | None = None
    """Chooses the batch size asked for, up to `batch_size`, by the head's measured time
    a sample (shared by the sessions of one head: `BatchTuners`); None: one of its own."""
    compiled: CompiledHead | None = None
    """The head's compiled form, shared by its sessions (`CompiledHeads`); None: eager."""

    def __post_init__(self) -> None:
        if self.tuner is None:
            self.tuner = BatchTuner(self.batch_size)

    @property
    def _tuner(self) -> BatchTuner:
        assert self.tuner is not None  # set in __post_init__
        return self.tuner

    def run_chunk(self, ticket: ChunkTicket, store: ObjectStore) -> Outbox[Wire]:
        """Start reading, decoding, transforming and running the head over a chunk, now;
        iterate the returned outbox for its wire batches, and close it when done.

        Batches are computed in a thread of the chunk's own, up to `AHEAD_BATCHES` ahead
        of the stream, and come as soon as each is ready. The chunk starts when asked, not
        when its stream is first read: a stream's first message waits behind the bytes
        the connection holds already (a raw chunk's, a second at 10 Mbit/s), and the
        server would wait with it. The stream ends with an empty batch whose app metadata
        is a `ChunkReport`: the keys skipped under `on_error="skip"` with the reason, so
        nothing is lost silently, and the chunk's time computing and waiting for the
        scheduler. Closing the outbox early (the stream's client left) stops the thread
        after its current batch; a batch still waiting for its grant leaves the
        scheduler's queue without running.

        Raises:
            InvalidRequest: a label missing or too many (here); from iterating, a
                `HapiError` for a missing or corrupt object under `on_error="raise"`
                (naming the key), `OverBudget` for one too large for the memory budget.
        """
        if len(ticket.labels) != len(ticket.keys):
            raise InvalidRequest(
                f"chunk {ticket.chunk} has {len(ticket.keys)} keys but {len(ticket.labels)} "
                "labels: send one label per key"
            )
        out: _Out = Outbox(AHEAD_BATCHES)
        worker = threading.Thread(
            target=self._produce,
            args=(ticket, store, out),
            name=f"hapi-chunk-{self.id[:8]}-{ticket.chunk}",
            daemon=True,
        )
        worker.start()
        return out

    def _produce(
        self,
        ticket: ChunkTicket,
        store: ObjectStore,
        out: _Out,
    ) -> None:
        """Compute the chunk's batches into `out`; the chunk's thread."""
        cpu0 = time.thread_time()
        skipped: list[SkippedKey] = []
        clock = _ChunkClock()
        try:
            # After do_get's prefix check of every key: the cache never widens access.
            lookup = self.features.lookup(self, ticket)
            # Read-ahead is bounded in bytes too, so a chunk of large objects holds a few,
            # and counted in each batch's fixed bytes (`Session.memory`).
            read = read_objects(
                lookup.reader(store),
                lookup.to_read,
                ahead=self.read_ahead,
                max_bytes=self.read_ahead << 18,
            )
            with contextlib.closing(read):
                reads = TimedReads(read)
                try:
                    if self.request.cut == RAW:
                        self._raw_batches(ticket, reads, skipped, clock, out)
                    else:
                        lookup.produce(
                            lambda part, objects, sent: self._feature_batches(
                                part, objects, skipped, clock, out, sent
                            ),
                            reads,
                            out,
                        )
                finally:
                    self.stats.add(read_s=reads.waited, bytes_read=reads.nbytes)
            if out.closed:
                return  # the client left: the chunk is not done, and nobody reads a report
            report = self._report(ticket, skipped, clock, lookup, reads)
            self.stats.add(chunks=1, skipped=len(skipped))
            out.put((pa.RecordBatch.from_pylist([], schema=self.schema), report))
            out.finish()
        except BaseException as exc:  # the stream raises it, in the server's guard
            out.finish(exc)
        finally:
            self.stats.add(cpu_s=time.thread_time() - cpu0)

    def _report(
        self,
        ticket: ChunkTicket,
        skipped: list[SkippedKey],
        clock: _ChunkClock,
        lookup: ChunkLookup,
        reads: TimedReads,
    ) -> bytes:
        """The chunk's report: what it left out, its times, where its bytes came from."""
        local = (
            self.locality.count(lookup.to_read, reads.nbytes) if self.locality is not None else None
        )
        return ChunkReport(
            chunk=ticket.chunk,
            skipped=skipped,
            server_s=clock.server_s + lookup.hit_s,
            queue_s=clock.queue_s,
            free_share=self.scheduler.free_share(running_self=0),
            cached=lookup.cached,
            read_bytes=reads.nbytes,
            local_bytes=local,
            compiled=clock.compiled,
            head=self._head_runs(),
        ).to_bytes()

    @contextlib.contextmanager
    def _grant(
        self,
        ticket: ChunkTicket,
        demand: Demand,
        clock: _ChunkClock,
        place: Place | None,
        out: _Out,
    ) -> Iterator[Grant]:
        order = (ticket.epoch, ticket.chunk)
        # The outbox closed: the stream's client left, and a batch still queued for its
        # grant leaves the queue (`Abandoned`) rather than compute for nobody.
        with self.scheduler.run(
            self.id, order, demand, weight=self.weight, place=place, gone=lambda: out.closed
        ) as grant:
            clock.queue_s += grant.queue_s
            t0 = time.perf_counter()
            try:
                yield grant
            finally:
                clock.server_s += time.perf_counter() - t0

    def _raw_batches(
        self,
        ticket: ChunkTicket,
        reads: TimedReads,
        skipped: list[SkippedKey],
        clock: _ChunkClock,
        out: _Out,
    ) -> None:
        items = iter(zip(ticket.keys, ticket.labels, reads, strict=True))
        # A RAW batch only reads and sends: it takes memory, not a compute slot.
        demand = Demand(model=self.memory, max_batch=1, compute=False)
        done = False
        while not done and not out.closed:
            if not out.wait_room():  # see `_feature_batches`
                return
            keys: list[str] = []
            labels: list[int] = []
            data: list[Blob] = []
            size = 0
            with self._grant(ticket, demand, clock, None, out):
                if out.closed:  # the client left while the batch waited
                    return
                for key, label, blob in items:
                    if isinstance(blob, BaseException):
                        left_out = skip_or_raise(key, blob, skip=self.request.on_error == "skip")
                        skipped.append(SkippedKey.of(left_out.key, left_out.error))
                        continue
                    keys.append(key)
                    labels.append(label)
                    data.append(blob)
                    size += len(blob)
                    if size >= RAW_BATCH_BYTES:
                        break
                else:
                    done = True
                batch = self._encode(keys, labels, data=data) if keys else None
            if batch is not None:
                out.put((batch, None))

    def _feature_batches(
        self,
        ticket: ChunkTicket,
        reads: Iterable[Blob | BaseException],
        skipped: list[SkippedKey],
        clock: _ChunkClock,
        out: _Out,
        sent: Sent,
    ) -> None:
        items = iter(zip(ticket.keys, ticket.labels, reads, strict=True))
        left = len(ticket.keys)
        self._tuner.chunk(left)
        held: _Item | None = None  # an object whose decoding needed more than a batch had
        place: Place | None = None  # the next batch's place, queued before this one ended
        try:
            while left and not out.closed:
                # At most AHEAD_BATCHES ahead of the stream: a batch waits for room in the
                # outbox before it asks for a grant (one `follow` queued found room then),
                # so a chunk whose client reads slowly holds no more than that, and one
                # whose client leaves computed no more for nobody.
                if place is None and not out.wait_room():
                    return
                demand = self._demand(left, held)
                samples: list[Sample] = []
                with self._grant(ticket, demand, clock, place, out) as grant:
                    place = None
                    if out.closed:  # the client left while the batch waited
                        return
                    decode = demand.model.decode
                    while len(samples) < grant.batch and left:
                        item = held if held is not None else self._item(next(items), ticket.epoch)
                        held = None
                        if item.decode > decode and not isinstance(item.data, BaseException):
                            refusal = self._too_large(item)
                            if refusal is not None:
                                item = dataclasses.replace(item, data=refusal)
                            elif grant.grow(item.decode - decode):
                                decode = item.decode
                            else:
                                # Run what the batch has; the next grant makes room for it.
                                held = item
                                break
                        left -= 1
                        sample = self._load(item, ticket.epoch)
                        if isinstance(sample, Sample):
                            samples.append(sample)
                        else:
                            skipped.append(SkippedKey.of(sample.key, sample.error))
                    batch = self._forward(samples, clock) if samples else None
                    # Room was there before the grant, and only the stream takes items.
                    if batch is not None:
                        if not out.offer((batch, None)):
                            return  # the client left
                        sent(batch)
                    if left and out.room:
                        place = grant.follow(self._demand(left, held))
        finally:
            if place is not None:
                self.scheduler.cancel(place)

    def _demand(self, left: int, held: _Item | None) -> Demand:
        """What the chunk's next batch asks for: room to decode `held` too, if there is one."""
        decode = max(self.memory.decode, held.decode if held is not None else 0)
        wire = samples_per_batch(self.info.bytes_per_sample)
        # Exact sessions run the head a sample at a time: no size to choose.
        size = min(self.batch_size, START) if self.request.exact else self._tuner.size
        most = min(size, left, wire)
        return Demand(model=decoding(self.memory, decode), max_batch=most)

    def _load(self, item: _Item, epoch: int) -> Sample | Skipped:
        t0 = time.perf_counter()
        loaded = load_one(
            item.key,
            item.label,
            item.data,
            self.transforms,
            seed=self.request.seed,
            epoch=epoch,
            skip=self.request.on_error == "skip",
            finish=False,  # converted and normalized with its batch (`_forward`)
        )
        self.stats.add(transform_s=time.perf_counter() - t0)
        return loaded

    def _item(self, item: tuple[str, int, Blob | BaseException], epoch: int) -> _Item:
        key, label, data = item
        decode = 0
        if not isinstance(data, BaseException):
            seed = self.transforms.seed(self.request.seed, epoch, key)
            decode = object_decode_bytes(data, self.transforms, seed)
        return _Item(key, label, data, decode)

    def _too_large(self, item: _Item) -> OverBudget | None:
        """The refusal of an object that could never be decoded within the budget."""
        try:
            self.scheduler.check_fits(
                decoding(self.memory, item.decode), f"object {shorten(repr(item.key))}"
            )
        except OverBudget as exc:
            return exc
        return None

    def _head_runs(self) -> str | None:
        """How the head runs, for the chunk's report: said once it is more than eager."""
        compiled = self.compiled
        return None if compiled is None or compiled.state == "eager" else compiled.describe()

    def _forward(self, samples: list[Sample], clock: _ChunkClock) -> pa.RecordBatch:
        t0 = time.perf_counter()
        # A batch's 8-bit pixels become the model's input in one pass: per sample, the
        # conversion's small torch calls cost a 32 px sample a fifth of its time.
        x = self.transforms.finish([s.tensor for s in samples]).to(self.device)
        if self.head is not None:
            # Shared with other heads, exclusive of tracing (see `hapi._fx_lock`).
            with (
                TRACING.shared(),
                torch.inference_mode(),
                running_in(self.head_dtype, self.device),
            ):
                if self.request.exact:
                    # Per sample: kernels' results depend on the batch size, and the trainer
                    # computes local features per sample too (`TransferJob(exact=True)`).
                    x = torch.cat([self.head(x[i : i + 1]) for i in range(len(x))])
                else:
                    x = self._batch_head(x, clock)
            x = x.float()  # the wire's codecs take fp32 (a no-op unless the head ran bf16)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stats.add(head_s=time.perf_counter() - t0)
        return self._encode([s.key for s in samples], [s.label for s in samples], features=x)

    def _batch_head(self, x: torch.Tensor, clock: _ChunkClock) -> torch.Tensor:
        """The head over a batch: compiled where that runs, and timed for the tuner."""
        assert self.head is not None
        t0 = time.perf_counter()
        if self.compiled is None:
            y, fast = self.head(x), False
        else:
            tuner = self._tuner
            y, fast = self.compiled(x, tuner.size if tuner.settled else None)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if fast:
            clock.compiled += len(x)
            self.stats.add(compiled_samples=len(x))
        else:  # the tuner compares eager batches with eager batches
            self._tuner.record(len(x), time.perf_counter() - t0)
        return y

    def _encode(self, keys: list[str], labels: list[int], **payload: object) -> pa.RecordBatch:
        return encode(self.schema, self.stats, keys, labels, **payload)


@dataclass(frozen=True)
class _Item:
    """A chunk's object, read, with the bytes decoding it will take."""

    key: str
    label: int
    data: Blob | BaseException
    decode: int
