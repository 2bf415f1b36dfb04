"""`HapiServer`: the storage-side Arrow Flight server, and `serve()` to run one."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.flight as flight
import torch

from hapi._tracing import TRACING
from hapi.data import DatasetManifest, ObjectStore, Store, StoreOptions, Transforms, open_store
from hapi.errors import (
    Forbidden,
    HapiError,
    InternalError,
    InvalidCut,
    InvalidRequest,
    SessionNotFound,
    shorten,
)
from hapi.graph import INPUT, RAW, ModelGraph, load_head
from hapi.server._guard import errors_to_wire
from hapi.server._listen import Listener, serve_metrics
from hapi.server._order import SendOrder
from hapi.server.auth import caller
from hapi.server.budget import MemoryModel, parse_bytes
from hapi.server.config import ServerConfig
from hapi.server.head_cache import HeadCache, HeadLease, LoadedModel
from hapi.server.limits import MemoryLimit, tightest_limit
from hapi.server.memory import device_memory, session_memory, session_name, tensor_bytes
from hapi.server.metrics import Metrics
from hapi.server.profiler import Profiler
from hapi.server.scheduler import Scheduler, never
from hapi.server.session import RAW_BATCH_BYTES, Session
from hapi.server.shaping import TokenBucket, parse_rate
from hapi.server.tenants import Tenant, reload_on_sighup
from hapi.server.tls import flight_location
from hapi.server.uploads import HeadUploads, head_graph, on_device
from hapi.wire import (
    ActionType,
    ChunkTicket,
    CloseSessionRequest,
    ManifestRequest,
    ServerStats,
    SessionInfo,
    SessionRequest,
    SessionStats,
    dtype_width,
    feature_schema,
    parse,
    raw_schema,
)
from hapi.wire.heads import head_digest_of
from hapi.wire.messages import HasHeadRequest, KeepaliveRequest, ProfileRequest, UploadedHead
from hapi.wire.replies import HasHeadReply, ProfileReply

if TYPE_CHECKING:
    from hapi.repo import ModelRepo

__all__ = ["HapiServer", "serve"]

log = logging.getLogger("hapi.server")

CLOSED_KEPT = 1024
"""Closed sessions whose counters `stats` still shows; older ones are forgotten (a server
runs for months), their bytes kept in their tenant's total."""

_READ_AHEAD_OBJECT = 256 << 10
"""Bytes of one object a chunk reads ahead, in its memory model (`Session` bounds its
read-ahead to this much per object on average)."""


class HapiServer(flight.FlightServerBase):
    """Serves chunks of features computed next to the data.

    Every handler sends a `HapiError` back as the error's class and message, and anything
    else as an `InternalError` whose id is logged with the traceback, so one bad request
    fails only itself: other sessions and chunks go on.

    Every call belongs to a tenant (its bearer token's): a session belongs to the tenant
    that opened it, and another tenant's session is answered exactly like an unknown one;
    manifests and chunks read only keys under the tenant's prefixes.

    Args:
        config: the server's settings.
        store: the store to serve instead of opening `config.store` (an embedding
            program's own, or a test's fake).
        clock: monotonic seconds, for session idle times (tests pass a fake clock).
    """

    def __init__(
        self,
        config: ServerConfig,
        *,
        store: ObjectStore | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ready = threading.Event()
        """Set when construction is done: Flight serves calls from its own constructor on,
        and a call (a client polling a restarted server) must not see half a server."""
        self.metrics = Metrics()
        listener = Listener.from_config(config)
        self.tenants, self.tls = listener.tenants, listener.tls
        options = listener.flight_options(on_refused=lambda exc: self.metrics.error(None, exc))
        try:
            super().__init__(listener.location, **options)
        except (pa.ArrowException, OSError) as exc:
            raise InvalidRequest(
                f"cannot listen on {listener.location} ({str(exc).splitlines()[0]}): the port "
                "may be in use; pick another with --port, or 0 for any free port"
            ) from None
        try:
            self._build(config, store, clock)
        except BaseException:
            super().shutdown()  # the Flight port is bound already: free it
            raise
        finally:
            self._ready.set()

    def _build(
        self, config: ServerConfig, store: ObjectStore | None, clock: Callable[[], float]
    ) -> None:
        self.config = config
        self.store: ObjectStore = (
            store
            if store is not None
            # The server only reads: a mistyped directory is an error, not a new store.
            else open_store(config.store, config.store_options, create=False)
        )
        self.repo = _open_repo(config)
        self.memory_limit: MemoryLimit | None = None
        """The limit the default budget came from (None: `memory_budget` was given)."""
        if config.memory_budget is not None:
            budget = parse_bytes(config.memory_budget)
        else:
            self.memory_limit = tightest_limit(config.device)
            budget = self.memory_limit.budget
        slots = config.compute_slots or len(os.sched_getaffinity(0))
        self.scheduler = Scheduler(budget, slots)
        self.heads = HeadCache(
            config.device, repo=self.repo, idle=config.idle_heads, scheduler=self.scheduler
        )
        self.scheduler.reclaimer = self.heads
        self.uploads = HeadUploads(parse_bytes(config.max_head_bytes))
        """Heads trainers uploaded for models of their own, by digest."""
        self.shaper = TokenBucket(parse_rate(config.egress_limit)) if config.egress_limit else None
        self.sending = SendOrder()
        """Each client connection's chunk streams send in chunk order."""
        self._clock = clock
        self._read_ahead = (config.store_options or StoreOptions()).concurrency
        self.profiler = Profiler(
            self.heads,
            self.scheduler,
            self.store,
            read_bytes=self._read_ahead * _READ_AHEAD_OBJECT,
        )
        self._sessions: dict[str, Session] = {}
        self._leases: dict[str, HeadLease] = {}
        self._closed: dict[str, SessionStats] = {}
        self._owners: dict[str, str] = {}
        """Tenant name of every session, open or closed (as long as `_closed` keeps it)."""
        self._forgotten_bytes: dict[str, int] = {}
        """Bytes sent by each tenant's closed sessions that `_closed` no longer keeps."""
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        """Set by `shutdown`: ends the reaper thread `serve` starts."""
        if config.threads:
            torch.set_num_threads(config.threads)
        # Read at each scrape: heads loaded or evicted anywhere, and the scheduler's
        # queue and budget, are never stale and need no calls where they change.
        self.metrics.follow(
            heads=lambda: len(self.heads),
            queue_depth=lambda: self.scheduler.stats().waiting,
            memory=lambda: (self.scheduler.stats().used, self.scheduler.budget),
            device_memory=(
                (lambda: device_memory(self.heads.device) or (0, 0))
                if self.heads.device.type == "cuda"
                else None
            ),
        )
        if config.metrics_port is not None:
            serve_metrics(self.metrics, config)

    @property
    def address(self) -> str:
        """The `grpc://host:port` (`grpc+tls://` with TLS) clients connect to."""
        return flight_location(self.config.host, self.port, tls=self.tls is not None)

    def serve(self) -> None:
        """Serve until `shutdown`, closing abandoned sessions every few seconds meanwhile.

        Every call closes them too; the reaper frees the heads of a server no call reaches.
        """
        reaper = threading.Thread(target=self._reap, name="hapi-reaper", daemon=True)
        reaper.start()
        try:
            super().serve()
        finally:
            self._stopped.set()
            reaper.join(timeout=10)

    def shutdown(self) -> None:
        """Stop serving Flight calls and the metrics endpoint."""
        self._stopped.set()
        super().shutdown()
        self.metrics.close()
        self.uploads.close()

    # Flight handlers -------------------------------------------------------------------

    def list_actions(self, context: flight.ServerCallContext) -> list[tuple[str, str]]:
        with self._guard("list_actions", context):
            return [(action.value, action.description) for action in ActionType]

    def do_action(
        self, context: flight.ServerCallContext, action: flight.Action
    ) -> Iterator[bytes]:
        with self._guard(f"action {shorten(repr(action.type), 100)}", context) as tenant:
            self._close_abandoned()
            body = action.body.to_pybytes() if action.body is not None else b""
            result = self._action(action.type, body, tenant, context)
        return iter([result])

    def _action(
        self, name: str, body: bytes, tenant: Tenant, context: flight.ServerCallContext
    ) -> bytes:
        if name == ActionType.OPEN_SESSION:
            return self.open_session(parse(SessionRequest, body), tenant=tenant).to_bytes()
        if name == ActionType.CLOSE_SESSION:
            session = parse(CloseSessionRequest, body).session
            return self.close_session(session, tenant=tenant).to_bytes()
        if name == ActionType.MANIFEST:
            prefix = parse(ManifestRequest, body).prefix
            return json.dumps(self.manifest(prefix, tenant=tenant)).encode()
        if name == ActionType.STATS:
            return self.stats(tenant=tenant).to_bytes()
        if name == ActionType.PROFILE:
            request = parse(ProfileRequest, body)
            return self.profile(request, tenant=tenant, gone=context.is_cancelled).to_bytes()
        if name == ActionType.HAS_HEAD:
            present = self.uploads.has(parse(HasHeadRequest, body).digest)
            return HasHeadReply(present=present, max_bytes=self.uploads.max_bytes).to_bytes()
        if name == ActionType.KEEPALIVE:
            self._session(parse(KeepaliveRequest, body).session, tenant)  # renews its lease
            return b"{}"
        raise InvalidRequest(
            f"unknown action {shorten(repr(name), 100)}: known actions are "
            f"{[a.value for a in ActionType]}"
        )

    def do_put(
        self,
        context: flight.ServerCallContext,
        descriptor: flight.FlightDescriptor,
        reader: flight.MetadataRecordBatchReader,
        writer: flight.FlightMetadataWriter,
    ) -> None:
        """Take an uploaded head (`hapi.wire.heads`); hapi takes no other puts."""
        with self._guard("do_put", context) as tenant:
            digest = head_digest_of(descriptor)
            batches = (chunk.data for chunk in reader if chunk.data is not None)
            if self.uploads.receive(digest, reader.schema, batches):
                log.info("tenant %s uploaded head %s", tenant.name, digest)

    def do_get(
        self, context: flight.ServerCallContext, ticket: flight.Ticket
    ) -> flight.FlightDataStream:
        started = time.perf_counter()
        with self._guard("do_get", context) as tenant:
            self._close_abandoned()
            chunk = parse(ChunkTicket, ticket.ticket)
            session = self._session(chunk.session, tenant)
            # Every key before any read: a refusal says nothing of what exists.
            self._check_keys(tenant, chunk.keys)
        stream = self._stream(session, chunk, tenant, started, context)
        next(stream)  # the chunk starts now and takes its place in its connection's order
        return flight.GeneratorStream(session.schema, stream)

    def _stream(
        self,
        session: Session,
        chunk: ChunkTicket,
        tenant: Tenant,
        started: float,
        context: flight.ServerCallContext,
    ) -> Iterator[tuple[pa.RecordBatch, pa.Buffer | None] | None]:
        """A chunk's stream; its first item, None, is taken by `do_get`: started so, the
        chunk runs from the request on, not from the stream's first read, and is closed
        (its thread stopped, its place given up) however its stream ends.

        A client that cancels or disconnects stops the chunk within a batch: this thread
        (the call's own, the only one that may ask its context) watches for it wherever it
        waits - for its turn, for the chunk's next batch, for the link - and closes the
        outbox, which the chunk's thread checks before each batch and while queued."""
        # Its errors need their own guard: the stream runs after do_get returned. One lane
        # per connection: its streams share one TCP stream, first in, first out.
        lane = (tenant.name, context.peer())
        gone = context.is_cancelled
        with (
            self._guard(f"chunk {chunk.chunk} of session {session.id}", tenant),
            self.sending.stream(lane, chunk.epoch, chunk.chunk, gone=gone) as send,
        ):
            out = session.run_chunk(chunk, self.store)
            ended = False
            try:
                yield None
                samples = sent = 0
                for batch, report in out.items(gone=gone):
                    send()  # the first waits for the streams before it on the connection
                    nbytes = batch.nbytes
                    if self.shaper is not None:
                        waited = self.shaper.consume(nbytes, gone=gone)
                        session.stats.add(shaping_wait_s=waited)
                    if gone():
                        break  # left while this stream waited for its turn or the link
                    session.stats.add(bytes_sent=nbytes)
                    # A chunk streaming longer than the idle time is use, not abandonment.
                    session.last_used = self._clock()
                    samples, sent = samples + batch.num_rows, sent + nbytes
                    if session.request.cut != RAW and batch.num_rows:
                        # A feature session sends each batch its head ran as one wire batch.
                        self.metrics.observe_batch(batch.num_rows)
                    yield batch, (pa.py_buffer(report) if report is not None else None)
                    ended = report is not None
                if ended:
                    self.metrics.chunk_done(
                        tenant.name,
                        session.id,
                        samples=samples,
                        nbytes=sent,
                        seconds=time.perf_counter() - started,
                    )
            except Exception:
                ended = True  # failed, not abandoned: the guard sends the error
                raise
            finally:
                out.close()
                if not ended:
                    # The client left before the chunk's end (a cancel, a disconnect, or
                    # a write to a call already gone, which ends the generator here).
                    session.stats.add(abandoned=1)
                    self.metrics.chunk_abandoned(tenant.name)
                    log.info("chunk %d of session %s: the client left", chunk.chunk, session.id)

    # The library API behind the handlers -------------------------------------------------

    def open_session(self, request: SessionRequest, *, tenant: Tenant) -> SessionInfo:
        """Load (or reuse) the head a request needs and register a session for `tenant`."""
        self._close_abandoned()
        transforms = Transforms.from_dict(request.transforms)
        if isinstance(request.model, UploadedHead):
            graph, freeze, shape, lease = self._uploaded_head(request, request.model)
            num_cuts = freeze  # as far as the server knows the trainer's model
        else:
            graph, freeze, shape, lease = self._named_head(request, request.model)
            num_cuts = graph.num_cuts
        head = lease.module if lease is not None else None
        if request.cut == RAW:
            schema, per_sample = raw_schema(), 0
        else:
            schema = feature_schema(shape, request.wire_dtype)
            per_sample = dtype_width(request.wire_dtype) * _numel(shape)
        try:
            memory = self._memory(request, transforms, graph, lease, per_sample)
        except BaseException:
            if lease is not None:
                self.heads.release(lease)
            raise
        info = SessionInfo(
            session=uuid.uuid4().hex,
            cut=request.cut,
            freeze=freeze,
            num_cuts=num_cuts,
            feature_shape=shape,
            wire_dtype=request.wire_dtype,
            bytes_per_sample=per_sample,
            batch_size=self.config.batch_size,
            memory_fixed=memory.fixed,
            memory_per_sample=memory.per_sample,
            head_bytes=tensor_bytes(head) if head is not None else 0,
            idle_s=self.config.session_idle_s,
            local_prefixes=[p.strip("/") for p in self.config.local_prefixes],
        )
        session = Session(
            id=info.session,
            request=request,
            info=info,
            schema=schema,
            head=head,
            transforms=transforms,
            device=self.heads.device,
            batch_size=self.config.batch_size,
            last_used=self._clock(),
            read_ahead=self._read_ahead,
            memory=memory,
            scheduler=self.scheduler,
            tenant=tenant.name,
            weight=tenant.weight,
        )
        with self._lock:
            self._sessions[session.id] = session
            self._owners[session.id] = tenant.name
            if lease is not None:
                self._leases[session.id] = lease
        self.metrics.session_opened(tenant.name, session.id)
        log.info(
            "opened session %s for %s: cut %d of %d",
            session.id,
            tenant.name,
            request.cut,
            graph.num_cuts,
        )
        return info

    def _named_head(
        self, request: SessionRequest, model: dict[str, Any] | str
    ) -> tuple[ModelGraph, int, list[int], HeadLease | None]:
        """The graph, freeze point, feature shape and head of a named or repository model."""
        loaded = self.heads.model(model, request.image_size)
        graph = loaded.graph
        freeze = graph.resolve_freeze(request.freeze) if request.freeze is not None else None
        if freeze is None:
            freeze = graph.num_cuts
        if request.cut != RAW:
            graph.check_cut(request.cut, freeze)
        if request.cut == RAW:
            return graph, freeze, [], None
        if request.cut == INPUT:
            return graph, freeze, list(graph.input_shape), None
        shape = list(graph.cut_points[request.cut - 1].shape)
        return graph, freeze, shape, self.heads.acquire(loaded, request.cut)

    def _uploaded_head(
        self, request: SessionRequest, model: UploadedHead
    ) -> tuple[ModelGraph, int, list[int], HeadLease | None]:
        """The same for a head the trainer uploaded: the server knows only its program, so
        it takes the cut and freeze point as the trainer says, and finds the features'
        shape by running the head on one sample."""
        size = request.image_size
        input_shape = (3, size, size)
        freeze = request.freeze
        if isinstance(freeze, bool) or not isinstance(freeze, int) or freeze < request.cut:
            raise InvalidCut(
                f"a session of an uploaded head takes its freeze point as a cut index >= its "
                f"cut {request.cut}, got {shorten(repr(freeze))}"
            )
        if request.cut <= INPUT:
            shape = [] if request.cut == RAW else list(input_shape)
            return head_graph(torch.nn.Identity(), input_shape, ()), freeze, shape, None
        digest = model.artifact
        if digest is None:
            raise InvalidRequest(
                f"a session of {shorten(model.module, 100)} at cut {request.cut} runs the head "
                "the trainer uploaded: name its digest in `artifact` (upload it with do_put)"
            )
        lease = self.heads.acquire_uploaded(
            digest,
            lambda: on_device(load_head(self.uploads.get(digest)), self.heads.device),
            self.uploads.size(digest),
        )
        try:
            out = _output_shape(lease.module, input_shape, self.heads.device)
        except BaseException:
            self.heads.release(lease)
            raise
        return head_graph(lease.module, input_shape, out), freeze, list(out), lease

    def close_session(self, session_id: str, *, tenant: Tenant) -> SessionStats:
        """Forget a session of `tenant`; return its final stats.

        Raises:
            SessionNotFound: no such session, or another tenant's.
        """
        self._session(session_id, tenant)
        return self._close(session_id)

    def _close(self, session_id: str) -> SessionStats:
        with self._lock:
            session = self._sessions.pop(session_id, None)
            if session is None:
                raise SessionNotFound(_unknown_session(session_id))
            lease = self._leases.pop(session_id, None)
            if lease is not None:
                self.heads.release(lease)
            stats = session.stats.snapshot()
            self._closed[session_id] = stats
            self.scheduler.remove_session(session_id)
            owner = self._owners[session_id]
            while len(self._closed) > CLOSED_KEPT:
                oldest = next(iter(self._closed))  # dicts keep the order of closing
                gone = self._closed.pop(oldest)
                tenant_name = self._owners.pop(oldest)
                self._forgotten_bytes[tenant_name] = (
                    self._forgotten_bytes.get(tenant_name, 0) + gone.bytes_sent
                )
        self.metrics.session_closed(owner, session_id)
        return stats

    def profile(
        self, request: ProfileRequest, *, tenant: Tenant, gone: Callable[[], bool] = never
    ) -> ProfileReply:
        """Measure a session's costs per cut on some of its objects (cached by content),
        within the memory budget as its chunks are (`Profiler`).

        Args:
            request: the session, objects, cuts and batch.
            tenant: the caller.
            gone: whether the caller has gone (asked from this thread while it waits).

        Raises:
            SessionNotFound: no such session, or another tenant's.
            Forbidden: a key outside the tenant's prefixes.
            OverBudget: a sample or object that the budget can never hold.
        """
        session = self._session(request.session, tenant)
        self._check_keys(tenant, request.keys)
        model, size = session.request.model, session.request.image_size
        if isinstance(model, UploadedHead):
            # The server holds an uploaded model's head for one cut at most, so it times
            # reading and decoding (cut 0); the trainer estimates the cuts from a chunk at
            # its freeze cut and its own per-cut times (`hapi.client.planning`).
            if any(cut > INPUT for cut in request.cuts or ()):
                raise InvalidCut(
                    "a session of an uploaded head is profiled at the input (cut 0) only: "
                    "the server has no head for the other cuts"
                )
            graph = head_graph(torch.nn.Identity(), (3, size, size), ())
            loaded = LoadedModel(graph=graph, key=json.dumps(["uploaded-input", size]))
            request = request.model_copy(update={"cuts": [INPUT]})
        else:
            loaded = self.heads.model(model, size)
        return self.profiler.profile(session, loaded, request, gone=gone)

    def _memory(
        self,
        request: SessionRequest,
        transforms: Transforms,
        graph: ModelGraph,
        lease: HeadLease | None,
        out_bytes: int,
    ) -> MemoryModel:
        """A new session's memory model, measured; refused when one sample cannot fit."""
        raw = request.cut == RAW
        return session_memory(
            self.scheduler,
            head=lease.module if lease is not None else None,
            graph=graph,
            cut=request.cut,
            device=self.heads.device,
            transforms=transforms,
            out_bytes=RAW_BATCH_BYTES if raw else out_bytes,
            read_bytes=self._read_ahead * _READ_AHEAD_OBJECT,
            what=session_name(request.model, request.cut),
            measured_as=lease.key if lease is not None else "input",
            max_batch=self.config.batch_size,
        )

    def manifest(self, prefix: str, *, tenant: Tenant) -> dict[str, Any]:
        """The dataset under `prefix` in this server's store, if `tenant` may read it.

        Raises:
            Forbidden: `prefix` is outside the tenant's prefixes.
        """
        manifest = DatasetManifest.from_store(self.store, tenant.check_prefix(prefix))
        # check_prefix allows whole segments only; keep a store whose listing matches by
        # characters (`a` listing `ab/...`) from showing keys beyond them.
        allowed = [i for i, key in enumerate(manifest.keys) if self._may_read(tenant, key)]
        if len(allowed) < len(manifest):
            manifest = manifest.subset(allowed)
        return manifest.to_dict()

    def _check_keys(self, tenant: Tenant, keys: list[str]) -> None:
        """Refuse keys outside `tenant`'s prefixes, by name and by where a local store's
        symlinks lead (a link in its own prefix to another tenant's objects).

        Raises:
            Forbidden: a key, or its link's target, outside the tenant's prefixes.
        """
        for key in keys:
            tenant.check_key(key)
        for key in keys:
            if not self._may_read(tenant, key):
                # The target is not named: it is another tenant's key.
                raise Forbidden(
                    f"key {shorten(repr(key))} is refused: a symlink on its path leads "
                    f"outside the prefixes of tenant {tenant.name!r}"
                )

    def _may_read(self, tenant: Tenant, key: str) -> bool:
        """Whether `key`, and where a local store's symlinks lead it, are the tenant's."""
        if not tenant.allows(key):
            return False
        if tenant.reads_all or not isinstance(self.store, Store):
            return True
        real = self.store.real_key(key)
        return real == key or tenant.allows(real)

    def stats(self, *, tenant: Tenant | None = None) -> ServerStats:
        """Counters of `tenant`'s open and closed sessions, and the server's settings.

        Args:
            tenant: whose sessions to show; None (the operator, calling the library in the
                server's own process) shows every tenant's.
        """
        with self._lock:
            mine = {
                sid for sid, owner in self._owners.items() if tenant is None or owner == tenant.name
            }
            sessions = {sid: s.stats.snapshot() for sid, s in self._sessions.items() if sid in mine}
            closed = {sid: s for sid, s in self._closed.items() if sid in mine}
            forgotten = sum(
                n
                for name, n in self._forgotten_bytes.items()
                if tenant is None or name == tenant.name
            )
        budget = self.scheduler.stats()
        allocated, reserved = device_memory(self.heads.device) or (None, None)
        return ServerStats(
            store=self.store.uri,
            egress_limit_bytes_per_s=self.shaper.rate if self.shaper else None,
            heads_cached=len(self.heads),
            heads_bytes=self.heads.nbytes,
            bytes_sent=forgotten
            + sum(s.bytes_sent for s in [*sessions.values(), *closed.values()]),
            sessions=sessions,
            closed_sessions=closed,
            memory_budget=budget.budget,
            memory_used=budget.used,
            memory_peak=budget.peak,
            device_allocated=allocated,
            device_reserved=reserved,
            compute_slots=budget.slots,
            batches_running=budget.running,
            batches_waiting=budget.waiting,
            cpu_s=time.process_time(),
        )

    def _session(self, session_id: str, tenant: Tenant) -> Session:
        with self._lock:
            session = self._sessions.get(session_id)
            owner = self._owners.get(session_id)
        # Another tenant's session is answered like an unknown one: its id tells nothing.
        if session is None or owner != tenant.name:
            raise SessionNotFound(_unknown_session(session_id))
        session.last_used = self._clock()
        # The caller's tenant is as the tenants file says now: a reload's new weight
        # applies to the session's next batches.
        session.weight = tenant.weight
        return session

    @contextlib.contextmanager
    def _guard(self, what: str, who: flight.ServerCallContext | Tenant) -> Iterator[Tenant]:
        """`errors_to_wire` for a call of `who` (its context, or its tenant once known),
        counting each error in the metrics under the tenant."""
        self._ready.wait()
        with errors_to_wire(what):
            tenant = who if isinstance(who, Tenant) else caller(who)
            try:
                yield tenant
            except flight.FlightError:
                raise  # encoded, and counted, by a guard inside this one
            except HapiError as exc:
                self.metrics.error(tenant.name, exc)
                raise
            except Exception:
                self.metrics.error(tenant.name, InternalError.__name__)
                raise

    def _reap(self) -> None:
        # A tenth of the idle time, at most 5 s: a session is closed within 10% of it.
        period = min(5.0, self.config.session_idle_s / 10)
        while not self._stopped.wait(period):
            try:
                self._close_abandoned()
            except Exception:  # the reaper must outlive any one failed close
                log.exception("closing abandoned sessions failed")

    def _close_abandoned(self) -> None:
        """Close sessions neither a chunk nor a keepalive used for `session_idle_s`: their
        jobs died without closing them, and they hold heads in memory."""
        cutoff = self._clock() - self.config.session_idle_s
        with self._lock:
            abandoned = [sid for sid, s in self._sessions.items() if s.last_used < cutoff]
        for sid in abandoned:
            log.info("closing session %s: unused for %.0fs", sid, self.config.session_idle_s)
            with contextlib.suppress(SessionNotFound):
                self._close(sid)


@contextlib.contextmanager
def serve(
    config: ServerConfig | None = None,
    *,
    clock: Callable[[], float] = time.monotonic,
    **options: Any,
) -> Iterator[HapiServer]:
    """Run a server in a background thread for the duration of a `with` block.

    Args:
        config: the server's settings; or give them as keyword arguments (`store=...`).
        clock: monotonic seconds, for session idle times (tests pass a fake clock).
    """
    server = HapiServer(config or ServerConfig(**options), clock=clock)
    # Python lets only the main thread install signal handlers; elsewhere, call
    # `server.tenants.reload()` to re-read the tenants file.
    reloads = (
        server.tenants.path is not None and threading.current_thread() is threading.main_thread()
    )
    restore = reload_on_sighup(server.tenants) if reloads else None
    thread = threading.Thread(target=server.serve, name="hapi-serve", daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        thread.join(timeout=10)
        if restore is not None:
            restore()


def _open_repo(config: ServerConfig) -> ModelRepo | None:
    if config.repo is None:
        return None
    from hapi.repo import ModelRepo

    return ModelRepo.open(config.repo, config.store_options)


def _unknown_session(session_id: str) -> str:
    return (
        f"no session {shorten(repr(session_id), 100)} on this server (closed, unused for "
        "too long, or the server restarted): open a new session"
    )


def _output_shape(
    head: torch.nn.Module, input_shape: tuple[int, ...], device: torch.device
) -> tuple[int, ...]:
    """The shape of one sample of `head`'s output, from shapes alone, refusing a head made
    for other inputs.

    Run on fake tensors, which allocate and compute nothing: a head's real runs are
    `session_memory`'s, under a grant of the budget, once its check has refused what one
    sample could never fit (an uploaded head at 4096 px would otherwise allocate its
    gigabyte activations here, outside the budget). A `torch.export` program, which an
    uploaded head is, runs on fake tensors by construction: export traces it so.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    with (
        TRACING.shared(),
        torch.inference_mode(),
        FakeTensorMode(allow_non_fake_inputs=True),
    ):
        x = torch.zeros(1, *input_shape, device=device)  # a fake tensor: no memory
        return tuple(head(x).shape[1:])


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
