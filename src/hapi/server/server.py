"""`HapiServer`: the storage-side Arrow Flight server, and `serve()` to run one."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, ClassVar

import pyarrow as pa
import pyarrow.flight as flight
import torch

from hapi._sizes import parse_bytes
from hapi.data import DatasetManifest, ObjectStore, open_store
from hapi.errors import InvalidRequest, shorten
from hapi.server._guard import tenant_call
from hapi.server._listen import Listener, serve_metrics
from hapi.server.chunk_streams import ChunkStreams
from hapi.server.chunks._order import SendOrder
from hapi.server.chunks.feature_cache import open_feature_cache
from hapi.server.head_cache import HeadCache
from hapi.server.locality import Locality
from hapi.server.memory.batch_memory import device_memory
from hapi.server.memory.budget import RETAINED_BYTES, give_back, give_back_when_quiet
from hapi.server.memory.limits import MemoryLimit, tightest_limit
from hapi.server.memory.scheduler import Scheduler, never
from hapi.server.metrics import Metrics
from hapi.server.opener import SessionOpener
from hapi.server.profile_action import Profiler
from hapi.server.registry import CLOSED_KEPT, SessionRegistry
from hapi.server.security.access import check_keys, readable_manifest
from hapi.server.security.tenants import Tenant
from hapi.server.security.tls import flight_location
from hapi.server.server_config import ServerConfig
from hapi.server.shaping import TokenBucket, parse_rate
from hapi.server.uploads import HeadUploads
from hapi.wire import (
    ActionType,
    ChunkTicket,
    CloseSessionRequest,
    ManifestRequest,
    ServerStats,
    SessionInfo,
    SessionRequest,
    SessionStats,
    parse,
)
from hapi.wire.heads import head_digest_of
from hapi.wire.messages import HasHeadRequest, KeepaliveRequest, LocateRequest, ProfileRequest
from hapi.wire.packed import packed_schema
from hapi.wire.replies import HasHeadReply, LocateReply, ProfileReply
from hapi.wire.tables import table_to_ipc

if TYPE_CHECKING:
    from hapi.repo import ModelRepo

__all__ = ["HapiServer"]

log = logging.getLogger("hapi.server")

_Handler = Callable[["HapiServer", bytes, Tenant, flight.ServerCallContext], bytes]
"""An action's handler: the server, the action's body, its caller and call; its reply."""


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
        self._build_memory(config)
        self.uploads = HeadUploads(parse_bytes(config.max_head_bytes))
        """Heads trainers uploaded for models of their own, by digest."""
        self.shaper = TokenBucket(parse_rate(config.egress_limit)) if config.egress_limit else None
        self.sending = SendOrder()
        """Each client connection's chunk streams send in chunk order."""
        self.streams = ChunkStreams(
            store=self.store, sending=self.sending, shaper=self.shaper, metrics=self.metrics,
            clock=clock, guard=self._guard,
        )  # fmt: skip
        self.features = open_feature_cache(config.feature_cache, size=config.feature_cache_size)
        """Computed features kept beside the data (`--feature-cache`), shared by sessions."""
        self.locality = Locality.of(
            config.beside, config.filer, config.store, on_read=self.metrics.read_placed
        )
        """Where the server is in a SeaweedFS cluster (`--beside`); None: it does not say."""
        self.opener = SessionOpener(
            config,
            heads=self.heads,
            uploads=self.uploads,
            scheduler=self.scheduler,
            clock=clock,
            features=self.features,
            locality=self.locality,
        )
        self.profiler = Profiler(
            self.heads,
            self.scheduler,
            self.store,
            read_bytes=self.opener.read_bytes,
            compiled=self.opener.compiled,
        )
        self._sessions = SessionRegistry(
            heads=self.heads,
            scheduler=self.scheduler,
            metrics=self.metrics,
            idle_s=config.session_idle_s,
            clock=clock,
            closed_kept=CLOSED_KEPT,
        )
        self._stopped = threading.Event()
        """Set by `shutdown`: ends the reaper thread `serve` starts."""
        if config.threads:
            torch.set_num_threads(config.threads)
        self._follow_metrics()
        if config.metrics_port is not None:
            serve_metrics(self.metrics, config)

    def _build_memory(self, config: ServerConfig) -> None:
        """The memory budget, the scheduler that shares it and the head cache within it."""
        self.memory_limit: MemoryLimit | None = None
        """The limit the default budget came from (None: `memory_budget` was given)."""
        if config.memory_budget is not None:
            budget = parse_bytes(config.memory_budget)
        else:
            self.memory_limit = tightest_limit(config.device)
            budget = self.memory_limit.budget
        slots = config.compute_slots or len(os.sched_getaffinity(0))
        self.scheduler = Scheduler(budget, slots, kept=2 * RETAINED_BYTES, give_back=give_back)
        self.heads = HeadCache(
            config.device, repo=self.repo, idle=config.idle_heads, scheduler=self.scheduler
        )
        self.scheduler.reclaimer = self.heads

    def _follow_metrics(self) -> None:
        """Have the metrics read the heads, the queue and the memory at each scrape."""
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
        self.metrics.follow_feature_cache(self.features.stats)

    @property
    def _owners(self) -> Mapping[str, str]:
        """The tenant of every session the registry remembers (a test counts them)."""
        return self._sessions.owners

    @property
    def address(self) -> str:
        """The `grpc://host:port` (`grpc+tls://` with TLS) clients connect to."""
        return flight_location(self.config.host, self.port, tls=self.tls is not None)

    def serve(self) -> None:
        """Serve until `shutdown`, closing abandoned sessions every few seconds meanwhile.

        Every call closes them too; the reaper frees the heads of a server no call reaches.
        """
        background = [
            threading.Thread(target=self._sessions.reap, args=(self._stopped,), name="hapi-reaper"),
            # The memory the allocator keeps for the next batches, given back when the
            # server goes quiet (`bound_allocator`).
            threading.Thread(
                target=give_back_when_quiet,
                args=(self.scheduler.quiet_since, self._stopped),
                name="hapi-give-back",
            ),
        ]
        for thread in background:
            thread.daemon = True
            thread.start()
        try:
            super().serve()
        finally:
            self._stopped.set()
            for thread in background:
                thread.join(timeout=10)

    @property
    def stopped(self) -> bool:
        """Whether the server stopped serving (shut down, or its serving thread ended)."""
        return self._stopped.is_set()

    def shutdown(self) -> None:
        """Stop serving Flight calls and the metrics endpoint."""
        self._stopped.set()
        super().shutdown()
        self.metrics.close()
        self.uploads.close()
        self.features.close()

    def list_actions(self, context: flight.ServerCallContext) -> list[tuple[str, str]]:
        with self._guard("list_actions", context):
            return [(action.value, action.description) for action in ActionType]

    def do_action(
        self, context: flight.ServerCallContext, action: flight.Action
    ) -> Iterator[bytes]:
        with self._guard(f"action {shorten(repr(action.type), 100)}", context) as tenant:
            self._sessions.close_abandoned()
            body = action.body.to_pybytes() if action.body is not None else b""
            handler = self._ACTIONS.get(action.type)
            if handler is None:
                raise InvalidRequest(
                    f"unknown action {shorten(repr(action.type), 100)}: known actions are "
                    f"{[a.value for a in ActionType]}"
                )
            result = handler(self, body, tenant, context)
        return iter([result])

    # Each action's handler takes its body, the caller and the call, and returns the reply.

    def _on_open_session(self, body: bytes, tenant: Tenant, _: flight.ServerCallContext) -> bytes:
        return self.open_session(parse(SessionRequest, body), tenant=tenant).to_bytes()

    def _on_close_session(self, body: bytes, tenant: Tenant, _: flight.ServerCallContext) -> bytes:
        session = parse(CloseSessionRequest, body).session
        return self.close_session(session, tenant=tenant).to_bytes()

    def _on_manifest(self, body: bytes, tenant: Tenant, _: flight.ServerCallContext) -> bytes:
        request = parse(ManifestRequest, body)
        manifest = self.manifest(request.prefix, tenant=tenant)
        if request.format == "arrow":
            return table_to_ipc(manifest.to_arrow())
        return json.dumps(manifest.to_dict()).encode()

    def _on_stats(self, _body: bytes, tenant: Tenant, _: flight.ServerCallContext) -> bytes:
        return self.stats(tenant=tenant).to_bytes()

    def _on_profile(self, body: bytes, tenant: Tenant, context: flight.ServerCallContext) -> bytes:
        request = parse(ProfileRequest, body)
        return self.profile(request, tenant=tenant, gone=context.is_cancelled).to_bytes()

    def _on_has_head(self, body: bytes, _tenant: Tenant, _: flight.ServerCallContext) -> bytes:
        present = self.uploads.has(parse(HasHeadRequest, body).digest)
        return HasHeadReply(present=present, max_bytes=self.uploads.max_bytes).to_bytes()

    def _on_keepalive(self, body: bytes, tenant: Tenant, _: flight.ServerCallContext) -> bytes:
        self._sessions.get(parse(KeepaliveRequest, body).session, tenant)  # renews its lease
        return b"{}"

    def _on_locate(self, body: bytes, tenant: Tenant, _: flight.ServerCallContext) -> bytes:
        keys = parse(LocateRequest, body).keys
        if self.locality is None:
            raise InvalidRequest(
                "this server does not know where objects lie: start it with --beside and "
                "--filer beside a SeaweedFS volume server"
            )
        check_keys(self.store, tenant, keys)  # where an object lies is read access too
        local, total = self.locality.locate(keys)
        return LocateReply(local=local, total=total).to_bytes()

    _ACTIONS: ClassVar[Mapping[str, _Handler]] = {
        ActionType.OPEN_SESSION: _on_open_session,
        ActionType.CLOSE_SESSION: _on_close_session,
        ActionType.MANIFEST: _on_manifest,
        ActionType.STATS: _on_stats,
        ActionType.PROFILE: _on_profile,
        ActionType.HAS_HEAD: _on_has_head,
        ActionType.KEEPALIVE: _on_keepalive,
        ActionType.LOCATE: _on_locate,
    }
    """The handler of each action, by name."""

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
            self._sessions.close_abandoned()
            chunk = parse(ChunkTicket, ticket.ticket)
            session = self._sessions.get(chunk.session, tenant)
            # Every key before any read: a refusal says nothing of what exists.
            check_keys(self.store, tenant, chunk.keys)
        stream = self.streams.stream(session, chunk, tenant, started, context)
        next(stream)  # the chunk starts now and takes its place in its connection's order
        schema = packed_schema(session.schema, session.info.compression)
        return flight.GeneratorStream(schema, stream)

    def open_session(self, request: SessionRequest, *, tenant: Tenant) -> SessionInfo:
        """Load (or reuse) the head a request needs and register a session for `tenant`."""
        self._sessions.close_abandoned()
        session, lease, graph = self.opener.open(request, tenant=tenant)
        self._sessions.open(session, tenant=tenant.name, lease=lease)
        log.info(
            "opened session %s for %s: cut %d of %d",
            session.id,
            tenant.name,
            request.cut,
            graph.num_cuts,
        )
        return session.info

    def close_session(self, session_id: str, *, tenant: Tenant) -> SessionStats:
        """Forget a session of `tenant`; return its final stats.

        Raises:
            SessionNotFound: no such session, or another tenant's.
        """
        self._sessions.get(session_id, tenant)
        return self._sessions.close(session_id)

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
        session = self._sessions.get(request.session, tenant)
        check_keys(self.store, tenant, request.keys)
        return self.profiler.profile(session, request, gone=gone)

    def manifest(self, prefix: str, *, tenant: Tenant) -> DatasetManifest:
        """The dataset under `prefix` in this server's store, if `tenant` may read it.

        Raises:
            Forbidden: `prefix` is outside the tenant's prefixes.
        """
        return readable_manifest(self.store, tenant, prefix)

    def stats(self, *, tenant: Tenant | None = None) -> ServerStats:
        """Counters of `tenant`'s open and closed sessions, and the server's settings.

        Args:
            tenant: whose sessions to show; None (the operator, calling the library in the
                server's own process) shows every tenant's.
        """
        usage = self._sessions.usage(tenant.name if tenant is not None else None)
        budget = self.scheduler.stats()
        allocated, reserved = device_memory(self.heads.device) or (None, None)
        return ServerStats(
            store=self.store.uri,
            egress_limit_bytes_per_s=self.shaper.rate if self.shaper else None,
            heads_cached=len(self.heads),
            heads_bytes=self.heads.nbytes,
            bytes_sent=usage.bytes_sent,
            sessions=usage.open,
            closed_sessions=usage.closed,
            memory_budget=budget.budget,
            memory_used=budget.used,
            memory_peak=budget.peak,
            device_allocated=allocated,
            device_reserved=reserved,
            compute_slots=budget.slots,
            batches_running=budget.running,
            batches_waiting=budget.waiting,
            cpu_s=time.process_time(),
            feature_cache=self.features.stats(),
            compiled_heads=self.opener.compiled.describe(),
        )

    def _guard(
        self, what: str, who: flight.ServerCallContext | Tenant
    ) -> contextlib.AbstractContextManager[Tenant]:
        """`tenant_call` for a call of `who`, once the server is built."""
        self._ready.wait()
        return tenant_call(what, who, self.metrics)


def _open_repo(config: ServerConfig) -> ModelRepo | None:
    if config.repo is None:
        return None
    from hapi.repo import ModelRepo

    return ModelRepo.open(config.repo, config.store_options)
