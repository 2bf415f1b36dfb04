"""Metrics: recorded work scraped back over real HTTP on 127.0.0.1 and checked."""

from __future__ import annotations

import socket
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hapi.errors import InvalidRequest, ObjectNotFound
from hapi.server.metrics import NO_TENANT, Metrics

from ..certs import make_certs

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str, context: ssl.SSLContext | None = None) -> Samples:
    with urllib.request.urlopen(url, timeout=30, context=context) as response:
        assert response.status == 200
        text = response.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


@pytest.fixture
def metrics() -> Iterator[Metrics]:
    with Metrics() as m:
        yield m


def test_scrape_reports_work_per_tenant_and_session(metrics: Metrics) -> None:
    metrics.session_opened("a", "s1")
    metrics.session_opened("a", "s2")
    metrics.session_opened("b", "s3")
    metrics.chunk_done("a", "s1", samples=8, nbytes=1000, seconds=0.2)
    metrics.chunk_done("a", "s1", samples=4, nbytes=500, seconds=3.0)
    metrics.chunk_done("a", "s2", samples=2, nbytes=70, seconds=0.02)
    metrics.chunk_done("b", "s3", samples=16, nbytes=4096, seconds=0.5)
    metrics.chunk_abandoned("b")
    metrics.error("b", ObjectNotFound("x"))
    metrics.error("b", "ObjectNotFound")
    metrics.error(None, "Unauthenticated")
    metrics.set_queue_depth(3)
    for size in (32, 16, 16):
        metrics.observe_batch(size)
    metrics.set_memory(used=123_456, budget=1_000_000)
    metrics.set_heads(2)
    port = metrics.serve_http("127.0.0.1", 0)
    assert port > 0 and metrics.url == f"http://127.0.0.1:{port}/metrics"

    got = scrape(metrics.url)

    assert value(got, "hapi_sent_bytes_total", tenant="a") == 1570
    assert value(got, "hapi_sent_bytes_total", tenant="b") == 4096
    assert value(got, "hapi_samples_total", tenant="a") == 14
    assert value(got, "hapi_chunks_total", tenant="a") == 3
    assert value(got, "hapi_chunks_abandoned_total", tenant="b") == 1
    assert value(got, "hapi_session_sent_bytes_total", tenant="a", session="s1") == 1500
    assert value(got, "hapi_session_samples_total", tenant="a", session="s2") == 2
    assert value(got, "hapi_session_chunks_total", tenant="b", session="s3") == 1
    assert value(got, "hapi_sessions_open", tenant="a") == 2
    assert value(got, "hapi_chunk_seconds_count", tenant="a") == 3
    assert value(got, "hapi_chunk_seconds_sum", tenant="a") == pytest.approx(3.22)
    assert value(got, "hapi_chunk_seconds_bucket", tenant="a", le="0.25") == 2
    assert value(got, "hapi_chunk_seconds_bucket", tenant="a", le="+Inf") == 3
    assert value(got, "hapi_errors_total", tenant="b", error="ObjectNotFound") == 2
    assert value(got, "hapi_errors_total", tenant=NO_TENANT, error="Unauthenticated") == 1
    assert value(got, "hapi_queue_depth") == 3
    assert value(got, "hapi_batch_size_count") == 3
    assert value(got, "hapi_batch_size_bucket", le="16.0") == 2
    assert value(got, "hapi_batch_size_current") == 16
    assert value(got, "hapi_memory_used_bytes") == 123_456
    assert value(got, "hapi_memory_budget_bytes") == 1_000_000
    assert value(got, "hapi_heads_loaded") == 2


def test_closed_session_leaves_only_tenant_totals(metrics: Metrics) -> None:
    metrics.session_opened("a", "s1")
    metrics.session_opened("a", "s2")
    metrics.chunk_done("a", "s1", samples=5, nbytes=50, seconds=0.1)
    metrics.serve_http()
    assert metrics.url is not None
    before = scrape(metrics.url)
    assert value(before, "hapi_session_sent_bytes_total", tenant="a", session="s2") == 0

    metrics.session_closed("a", "s1")
    metrics.session_closed("a", "s1")  # twice: a close racing the idle reaper
    metrics.chunk_done("a", "s1", samples=1, nbytes=10, seconds=0.1)  # ends after the close

    after = scrape(metrics.url)
    sessions = {dict(labels).get("session") for _, labels in after} - {None}
    assert sessions == {"s2"}
    assert value(after, "hapi_sent_bytes_total", tenant="a") == 60
    assert value(after, "hapi_sessions_open", tenant="a") == 1


def test_followed_gauges_are_read_at_each_scrape(metrics: Metrics) -> None:
    state = {"waiting": 3, "used": 100, "budget": 1000, "heads": 1, "cuda": 50}
    metrics.follow(
        queue_depth=lambda: state["waiting"],
        memory=lambda: (state["used"], state["budget"]),
        heads=lambda: state["heads"],
        device_memory=lambda: (state["cuda"], 2 * state["cuda"]),
    )
    metrics.serve_http()
    assert metrics.url is not None
    first = scrape(metrics.url)
    state.update(waiting=0, used=640, heads=2, cuda=70)
    second = scrape(metrics.url)
    for kind, before, after in [("allocated", 50, 70), ("reserved", 100, 140)]:
        got = value(first, "hapi_device_memory_bytes", kind=kind)
        assert (got, value(second, "hapi_device_memory_bytes", kind=kind)) == (before, after)
    for name, before, after in [
        ("hapi_queue_depth", 3, 0),
        ("hapi_memory_used_bytes", 100, 640),
        ("hapi_memory_budget_bytes", 1000, 1000),
        ("hapi_heads_loaded", 1, 2),
    ]:
        assert (value(first, name), value(second, name)) == (before, after), name


@pytest.mark.slow
def test_servers_in_one_process_count_apart() -> None:
    with Metrics() as one, Metrics() as two:
        one.chunk_done("a", "s", samples=1, nbytes=11, seconds=0.1)
        two.chunk_done("a", "s", samples=1, nbytes=22, seconds=0.1)
        assert one.serve_http() != two.serve_http()
        assert one.url and two.url
        assert value(scrape(one.url), "hapi_sent_bytes_total", tenant="a") == 11
        assert value(scrape(two.url), "hapi_sent_bytes_total", tenant="a") == 22


def test_close_stops_serving(metrics: Metrics) -> None:
    port = metrics.serve_http()
    with pytest.raises(InvalidRequest, match="already served"):
        metrics.serve_http()
    metrics.close()
    assert metrics.url is None
    with pytest.raises(urllib.error.URLError):
        scrape(f"http://127.0.0.1:{port}/metrics")
    assert b"hapi_heads_loaded" in metrics.render()


def test_port_in_use_is_a_clear_error(metrics: Metrics) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(InvalidRequest, match="--metrics-port"):
            metrics.serve_http("127.0.0.1", taken.getsockname()[1])


def test_https(metrics: Metrics, tmp_path: Path) -> None:
    certs = make_certs(tmp_path)
    metrics.set_heads(7)
    metrics.serve_http(certfile=str(certs.server_cert), keyfile=str(certs.server_key))
    assert metrics.url is not None and metrics.url.startswith("https://127.0.0.1:")
    trusted = ssl.create_default_context(cafile=str(certs.ca_cert))
    assert value(scrape(metrics.url, trusted), "hapi_heads_loaded") == 7
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        scrape(metrics.url, ssl.create_default_context())
