"""`Metrics`: what a server does, per tenant and session, for Prometheus (`--metrics-port`).

Each `Metrics` has a registry of its own, not prometheus_client's global one, so several
servers in one process (tests, benchmarks) count separately.

Per-tenant series live as long as the server, so `rate()` over them never sees a reset;
per-session series are removed when the session closes, so a server that runs for months
keeps a bounded number of series.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
    start_wsgi_server,
)

from hapi.errors import InvalidRequest

if TYPE_CHECKING:
    from collections.abc import Iterator

    from prometheus_client.metrics_core import Metric

    from hapi.wire.replies import FeatureCacheStats

__all__ = ["NO_TENANT", "Metrics"]

NO_TENANT = "-"
"""`tenant` label of errors before a tenant is known (a bad token); no tenant's name."""

# Chunk latencies run from milliseconds (a few cached images) to minutes (a big chunk on a
# busy CPU server); batch sizes are the scheduler's, at most a few thousand.
_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 150, 300)
_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


class Metrics:
    """Counters, gauges and histograms of one server, served over HTTP by `serve_http`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        tenant, session = ["tenant"], ["tenant", "session"]
        self._bytes = Counter("hapi_sent_bytes", "Feature bytes sent.", tenant, registry=r)
        self._samples = Counter("hapi_samples", "Samples sent.", tenant, registry=r)
        self._chunks = Counter("hapi_chunks", "Chunks completed.", tenant, registry=r)
        self._abandoned = Counter(
            "hapi_chunks_abandoned",
            "Chunk streams whose client left before their end (stopped within a batch).",
            tenant,
            registry=r,
        )
        self._session_bytes = Counter(
            "hapi_session_sent_bytes", "Feature bytes sent, per open session.", session, registry=r
        )
        self._session_samples = Counter(
            "hapi_session_samples", "Samples sent, per open session.", session, registry=r
        )
        self._session_chunks = Counter(
            "hapi_session_chunks", "Chunks completed, per open session.", session, registry=r
        )
        self._local_read, self._remote_read = (
            Counter(f"hapi_{where}_read_bytes", f"Object bytes read from {whose} (--beside).",
                    registry=r)
            for where, whose in (("local", "the server's own node"), ("remote", "other nodes"))
        )  # fmt: skip
        self._per_session = (self._session_bytes, self._session_samples, self._session_chunks)
        self._sessions = Gauge("hapi_sessions_open", "Sessions open.", tenant, registry=r)
        self._latency = Histogram(
            "hapi_chunk_seconds",
            "Time from a chunk's request to its last batch sent.",
            tenant,
            buckets=_SECONDS,
            registry=r,
        )
        self._errors = Counter(
            "hapi_errors", "Requests that failed, by error class.", ["tenant", "error"], registry=r
        )
        self._queue = Gauge("hapi_queue_depth", "Chunks waiting for memory.", registry=r)
        self._batch = Histogram(
            "hapi_batch_size", "Feature-extraction batch sizes run.", buckets=_BATCHES, registry=r
        )
        self._batch_now = Gauge("hapi_batch_size_current", "The latest batch size.", registry=r)
        self._used = Gauge("hapi_memory_used_bytes", "Memory held by heads and chunks.", registry=r)
        self._budget = Gauge("hapi_memory_budget_bytes", "The server's memory budget.", registry=r)
        self._heads = Gauge("hapi_heads_loaded", "Heads in memory.", registry=r)
        self._device = Gauge(
            "hapi_device_memory_bytes",
            "A GPU server's CUDA allocator: bytes allocated to tensors, or reserved from the GPU.",
            ["kind"],
            registry=r,
        )
        ProcessCollector(registry=r)
        self._open: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._httpd: Any = None
        self._thread: threading.Thread | None = None
        self._url: str | None = None

    def session_opened(self, tenant: str, session: str) -> None:
        """Start the per-session series of `session`, which `tenant` opened."""
        with self._lock:
            if (tenant, session) not in self._open:
                self._open.add((tenant, session))
                self._sessions.labels(tenant).inc()
                # At zero from the start: a scrape shows the session before its first chunk.
                for metric in self._per_session:
                    metric.labels(tenant, session)

    def session_closed(self, tenant: str, session: str) -> None:
        """Remove the series of `session` (its work stays in the tenant's totals)."""
        with self._lock:
            if (tenant, session) not in self._open:
                return
            self._open.discard((tenant, session))
            self._sessions.labels(tenant).dec()
            for metric in self._per_session:
                metric.remove(tenant, session)

    def chunk_done(
        self, tenant: str, session: str, *, samples: int, nbytes: int, seconds: float
    ) -> None:
        """Count a chunk sent: `samples` samples in `nbytes` bytes, `seconds` after its request.

        A session not opened (or already closed) counts in its tenant's totals only, so a
        chunk that ends after its session closed cannot bring the session's series back.
        """
        self._bytes.labels(tenant).inc(nbytes)
        self._samples.labels(tenant).inc(samples)
        self._chunks.labels(tenant).inc()
        self._latency.labels(tenant).observe(seconds)
        with self._lock:
            if (tenant, session) in self._open:
                self._session_bytes.labels(tenant, session).inc(nbytes)
                self._session_samples.labels(tenant, session).inc(samples)
                self._session_chunks.labels(tenant, session).inc()

    def read_placed(self, local: int, remote: int) -> None:
        """Count a chunk's object bytes read from the server's own node and from others."""
        self._local_read.inc(local)
        self._remote_read.inc(remote)

    def chunk_abandoned(self, tenant: str) -> None:
        """Count a chunk stream of `tenant` whose client cancelled or disconnected."""
        self._abandoned.labels(tenant).inc()

    def error(self, tenant: str | None, error: str | BaseException) -> None:
        """Count a failed request of `tenant` (None: before one was known).

        Args:
            tenant: the tenant's name, or None for a call refused before authentication.
            error: the error or its class name; pass hapi's classes (and `InternalError`
                for the unexpected) so the label keeps few values.
        """
        name = error if isinstance(error, str) else type(error).__name__
        self._errors.labels(NO_TENANT if tenant is None else tenant, name).inc()

    def set_queue_depth(self, chunks: int) -> None:
        """Set how many chunks wait for the scheduler to admit them."""
        self._queue.set(chunks)

    def observe_batch(self, size: int) -> None:
        """Count a feature-extraction batch of `size` samples started."""
        self._batch.observe(size)
        self._batch_now.set(size)

    def set_memory(self, used: int, budget: int) -> None:
        """Set the bytes heads and running chunks hold, and the budget they must stay under."""
        self._used.set(used)
        self._budget.set(budget)

    def set_heads(self, loaded: int) -> None:
        """Set how many heads are in memory."""
        self._heads.set(loaded)

    def follow(
        self,
        *,
        queue_depth: Callable[[], float] | None = None,
        memory: Callable[[], tuple[float, float]] | None = None,
        heads: Callable[[], float] | None = None,
        device_memory: Callable[[], tuple[float, float]] | None = None,
    ) -> None:
        """Read gauges from the server's own state at each scrape instead of setting them.

        A gauge read when scraped is never stale, and the code that changes the state
        needs no call into the metrics. A gauge followed ignores its `set_*` method.

        Args:
            queue_depth: chunks waiting for the scheduler.
            memory: bytes held by heads and running chunks, and the budget.
            heads: heads in memory.
            device_memory: a GPU server's CUDA allocator, bytes allocated and reserved
                (the series exist only when it is given).
        """
        if queue_depth is not None:
            self._queue.set_function(queue_depth)
        if memory is not None:
            self._used.set_function(lambda: memory()[0])
            self._budget.set_function(lambda: memory()[1])
        if heads is not None:
            self._heads.set_function(heads)
        if device_memory is not None:
            self._device.labels("allocated").set_function(lambda: device_memory()[0])
            self._device.labels("reserved").set_function(lambda: device_memory()[1])

    def follow_feature_cache(self, stats: Callable[[], FeatureCacheStats | None]) -> None:
        """Report the feature cache's hits, misses, evictions and bytes held, read from
        `stats` at each scrape (no series while it gives None: the server keeps no cache)."""
        self.registry.register(_FeatureCacheCollector(stats))

    def render(self) -> bytes:
        """The metrics in Prometheus' text format, as a scrape would get them."""
        return generate_latest(self.registry)

    def serve_http(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        certfile: str | None = None,
        keyfile: str | None = None,
    ) -> int:
        """Serve the metrics at `http(s)://host:port/metrics` from a daemon thread until `close`.

        Args:
            host: address to listen on; the metrics name tenants and sessions, so keep it
                on loopback or a private network.
            port: port to listen on; 0 picks a free one.
            certfile: PEM certificate to serve HTTPS with (the server's TLS certificate).
            keyfile: its private key.

        Returns:
            The port bound.

        Raises:
            InvalidRequest: the port cannot be bound, or the metrics are already served.
        """
        if self._httpd is not None:
            raise InvalidRequest(f"metrics are already served at {self._url}")
        try:
            self._httpd, self._thread = start_wsgi_server(
                port, host, self.registry, certfile=certfile, keyfile=keyfile
            )
        except OSError as exc:
            raise InvalidRequest(
                f"cannot serve metrics on {host}:{port} ({exc.strerror or exc}): the port may "
                "be in use; pick another with --metrics-port, or 0 for any free port"
            ) from None
        bound = int(self._httpd.server_port)
        scheme = "https" if certfile else "http"
        self._url = f"{scheme}://{_url_host(host)}:{bound}/metrics"
        return bound

    @property
    def url(self) -> str | None:
        """Where the metrics are served; None before `serve_http` and after `close`."""
        return self._url

    def close(self) -> None:
        """Stop serving the metrics over HTTP (the counters stay readable by `render`)."""
        httpd, thread = self._httpd, self._thread
        self._httpd, self._thread, self._url = None, None, None
        if httpd is not None:
            _shutdown(httpd)
            httpd.server_close()
        if thread is not None:
            thread.join()

    def __enter__(self) -> Metrics:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _FeatureCacheCollector:
    """The feature cache's counters as Prometheus series, read when scraped."""

    def __init__(self, stats: Callable[[], FeatureCacheStats | None]) -> None:
        self._stats = stats

    def describe(self) -> list[Metric]:
        return []  # the series exist only when the server keeps a cache

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self._stats()
        if s is None:
            return
        prefix = "hapi_feature_cache"
        yield CounterMetricFamily(f"{prefix}_hits", "Samples sent from the cache.", s.hits)
        yield CounterMetricFamily(
            f"{prefix}_misses", "Samples of cacheable sessions computed.", s.misses
        )
        yield CounterMetricFamily(f"{prefix}_writes", "Entries written.", s.writes)
        yield CounterMetricFamily(
            f"{prefix}_evictions", "Entries evicted under the size bound.", s.evictions
        )
        yield CounterMetricFamily(
            f"{prefix}_corrupt", "Entries that failed their checksum (removed).", s.corrupt
        )
        yield CounterMetricFamily(
            f"{prefix}_dropped", "Computed features not kept: the writer was behind.", s.dropped
        )
        yield CounterMetricFamily(
            f"{prefix}_write_failures",
            "Computed features not kept: the directory refused them (full, read-only).",
            s.write_failures,
        )
        yield GaugeMetricFamily(f"{prefix}_bytes", "Entries' bytes on disk.", s.bytes_held)
        yield GaugeMetricFamily(f"{prefix}_max_bytes", "The cache's size bound.", s.max_bytes)


def _url_host(host: str) -> str:
    try:
        return f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:
        return host


def _shutdown(httpd: Any) -> None:
    """`httpd.shutdown()` without waiting out `serve_forever`'s half-second poll: a
    connection wakes its `select`, and the loop then sees the shutdown (a server's stop,
    and every test that starts one, waited 0.5 s for it)."""
    stopper = threading.Thread(target=httpd.shutdown, daemon=True)
    stopper.start()
    host, port = httpd.server_address[:2]
    if host in ("0.0.0.0", "::", ""):  # bound to every address: loopback is one of them
        host = "::1" if ":" in host else "127.0.0.1"
    while stopper.is_alive():
        with contextlib.suppress(OSError):
            socket.create_connection((host, port), timeout=0.1).close()
        stopper.join(0.02)
