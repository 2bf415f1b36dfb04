"""Two tenants share one TLS server: their own tokens, prefixes and sessions, and metrics
that say what each did. Every cross-tenant attempt is refused."""

from __future__ import annotations

import os
import ssl
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hapi import TransferJob
from hapi.client import Connection, connect
from hapi.data import Transforms, open_store, synth_dataset
from hapi.errors import Forbidden, InvalidRequest, SessionNotFound, Unauthenticated
from hapi.graph import INPUT, RAW, ModelSpec
from hapi.server import HapiServer, ServerConfig, serve
from hapi.wire import ChunkTicket, SessionRequest

from ..certs import Certs, make_certs

TOKEN_A = "team-a-token-0123456789"
TOKEN_B = "team-b-token-9876543210"
SIZE = 64
SPEC = ModelSpec(name="resnet18", num_classes=2)
LEAK = "datasets/a/train/class_0/leak.jpg"
LINKED = "datasets/a/linked/secret.jpg"
ACROSS = "datasets/a/train/class_1/across.jpg"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@dataclass(frozen=True)
class Site:
    root: Path
    certs: Certs
    tenants: Path


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Site:
    base = tmp_path_factory.mktemp("site")
    root = base / "store"
    store = open_store(root)
    synth_dataset(store, "datasets/a/train", classes=2, per_class=2, size=SIZE, seed=1)
    synth_dataset(store, "datasets/b/train", classes=2, per_class=2, size=SIZE, seed=2)
    outside = base / "outside"
    outside.mkdir()
    (outside / "secret.jpg").write_bytes(store.get("datasets/b/train/class_0/00000.jpg"))
    # A link to a file and a link to a directory, both out of the store's root.
    os.symlink(outside / "secret.jpg", root / LEAK)
    os.symlink(outside, root / "datasets" / "a" / "linked")
    # A link inside the root, from team-a's prefix to one of team-b's objects.
    os.symlink(root / "datasets/b/train/class_0/00000.jpg", root / ACROSS)
    tenants = base / "tenants.toml"
    tenants.write_text(
        f"""
[team-a]
token_env = "HAPI_TEST_TEAM_A_TOKEN"
prefixes = ["datasets/a"]
weight = 2

[team-b]
token = "{TOKEN_B}"
prefixes = ["datasets/b"]
"""
    )
    return Site(root=root, certs=make_certs(base / "certs"), tenants=tenants)


@pytest.fixture(scope="module")
def server(site: Site) -> Iterator[HapiServer]:
    config = ServerConfig(
        store=str(site.root),
        tenants=str(site.tenants),
        tls_cert=str(site.certs.server_cert),
        tls_key=str(site.certs.server_key),
        metrics_port=0,
        batch_size=4,
    )
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HAPI_TEST_TEAM_A_TOKEN", TOKEN_A)
        with serve(config) as running:
            yield running


def tenant(server: HapiServer, site: Site, token: str | None) -> Connection:
    return connect(server.address, token=token, tls_ca=site.certs.ca_cert, timeout=30)


@pytest.fixture
def a(server: HapiServer, site: Site) -> Iterator[Connection]:
    with tenant(server, site, TOKEN_A) as conn:
        yield conn


@pytest.fixture
def b(server: HapiServer, site: Site) -> Iterator[Connection]:
    with tenant(server, site, TOKEN_B) as conn:
        yield conn


def request(cut: int = RAW) -> SessionRequest:
    return SessionRequest(
        model=SPEC.to_dict(),
        cut=cut,
        transforms=Transforms.eval(SIZE).to_dict(),
        image_size=SIZE,
    )


def ticket(session: str, keys: list[str], chunk: int = 0) -> ChunkTicket:
    return ChunkTicket(session=session, chunk=chunk, epoch=0, keys=keys, labels=[0] * len(keys))


def test_each_tenant_works_in_its_prefixes_over_tls(
    server: HapiServer, site: Site, a: Connection, b: Connection
) -> None:
    assert server.address.startswith("grpc+tls://127.0.0.1:")
    keys_a = list(a.manifest("datasets/a/train").keys)
    assert len(keys_a) == 4 and all(k.startswith("datasets/a/train/") for k in keys_a)
    assert LEAK not in keys_a  # the symlink out of the store is left out of listings
    raw = a.open_session(request(RAW))
    got = a.fetch(ticket(raw.session, keys_a))
    store = open_store(site.root)
    assert [d for batch in got.batches for d in batch.data or []] == [store.get(k) for k in keys_a]
    keys_b = list(b.manifest("/datasets/b/train/").keys)
    inputs = b.open_session(request(INPUT))
    got = b.fetch(ticket(inputs.session, keys_b[:3]))
    assert [k for batch in got.batches for k in batch.keys] == keys_b[:3]
    a.close_session(raw.session)
    b.close_session(inputs.session)


@pytest.mark.parametrize(
    "prefix", ["datasets/a/train", "datasets/a", "datasets", "", "datasets/bb"]
)
def test_manifests_outside_the_prefixes_are_refused(b: Connection, prefix: str) -> None:
    with pytest.raises(Forbidden, match="outside the prefixes tenant 'team-b' may read"):
        b.manifest(prefix)


def test_chunks_outside_the_prefixes_are_refused(a: Connection, b: Connection) -> None:
    key_a = a.manifest("datasets/a/train").keys[0]
    key_b = b.manifest("datasets/b/train").keys[0]
    info = b.open_session(request(RAW))
    with pytest.raises(Forbidden, match="'team-b'"):
        b.fetch(ticket(info.session, [key_a]))
    # One key outside refuses the whole chunk, before anything is read.
    with pytest.raises(Forbidden):
        b.fetch(ticket(info.session, [key_b, key_a]))
    with pytest.raises(InvalidRequest, match="invalid key"):
        b.fetch(ticket(info.session, ["datasets/b/../a/train/class_0/00000.jpg"]))
    # The session goes on serving what the tenant may read.
    assert b.fetch(ticket(info.session, [key_b])).batches[0].keys == [key_b]
    b.close_session(info.session)


def test_another_tenants_session_is_unknown(a: Connection, b: Connection) -> None:
    key_b = b.manifest("datasets/b/train").keys[0]
    theirs = a.open_session(request(RAW)).session
    nobody = "0" * 32
    attempts = {
        "chunk": lambda sid: b.fetch(ticket(sid, [key_b])),
        "close": lambda sid: b.close_session(sid),
    }
    for what, attempt in attempts.items():
        with pytest.raises(SessionNotFound) as refused:
            attempt(theirs)
        with pytest.raises(SessionNotFound) as unknown:
            attempt(nobody)
        # Word for word the answer for a session that does not exist: nothing leaks.
        assert str(refused.value).replace(theirs, "ID") == str(unknown.value).replace(
            nobody, "ID"
        ), what
    mine = b.open_session(request(RAW)).session
    seen_by_b = b.stats()
    assert mine in seen_by_b.sessions and theirs not in seen_by_b.sessions
    assert theirs not in seen_by_b.closed_sessions
    seen_by_a = a.stats()
    assert theirs in seen_by_a.sessions and mine not in seen_by_a.sessions
    # The owner's session survived every attempt.
    key_a = a.manifest("datasets/a/train").keys[0]
    assert a.fetch(ticket(theirs, [key_a])).batches[0].keys == [key_a]
    a.close_session(theirs)
    b.close_session(mine)
    assert theirs in a.stats().closed_sessions and theirs not in b.stats().closed_sessions


@pytest.mark.parametrize("key", [LEAK, LINKED])
def test_symlinks_out_of_the_store_are_refused(a: Connection, key: str) -> None:
    info = a.open_session(request(RAW))
    with pytest.raises(Forbidden, match="symlink leaves the store's root"):
        a.fetch(ticket(info.session, [key]))
    a.close_session(info.session)


def test_a_symlink_into_another_tenants_prefix_is_refused(a: Connection) -> None:
    info = a.open_session(request(RAW))
    with pytest.raises(Forbidden, match="symlink on its path leads outside") as refused:
        a.fetch(ticket(info.session, [ACROSS]))
    assert "datasets/b" not in str(refused.value)  # the target is not named
    a.close_session(info.session)


@pytest.mark.parametrize("token", [None, "not-a-token", TOKEN_A + "x"])
def test_calls_without_a_tenants_token_are_refused(
    server: HapiServer, site: Site, token: str | None
) -> None:
    with tenant(server, site, token) as stranger, pytest.raises(Unauthenticated):
        stranger.stats()


def test_metrics_report_what_each_tenant_did(
    server: HapiServer, site: Site, a: Connection, b: Connection
) -> None:
    url = server.metrics.url
    assert url is not None and url.startswith("https://127.0.0.1:")
    https = ssl.create_default_context(cafile=str(site.certs.ca_cert))
    keys_a = list(a.manifest("datasets/a/train").keys)
    keys_b = list(b.manifest("datasets/b/train").keys)
    before = scrape(url, https)

    sa = a.open_session(request(RAW)).session
    a.fetch(ticket(sa, keys_a[:3], chunk=0))
    a.fetch(ticket(sa, keys_a[3:], chunk=1))
    sb = b.open_session(request(INPUT)).session
    b.fetch(ticket(sb, keys_b[:2]))
    with pytest.raises(Forbidden):
        b.fetch(ticket(sb, keys_a[:1]))
    with pytest.raises(SessionNotFound):
        b.close_session(sa)
    with tenant(server, site, "wrong-token") as stranger, pytest.raises(Unauthenticated):
        stranger.stats()
    during = scrape(url, https)
    sent_a, sent_b = a.stats().sessions[sa].bytes_sent, b.stats().sessions[sb].bytes_sent

    def grew(name: str, **labels: str) -> float:
        return (value(during, name, **labels) or 0.0) - (value(before, name, **labels) or 0.0)

    for name, tenant_a, tenant_b in [
        ("hapi_sent_bytes_total", sent_a, sent_b),
        ("hapi_samples_total", 4, 2),
        ("hapi_chunks_total", 2, 1),
        ("hapi_chunk_seconds_count", 2, 1),
        ("hapi_sessions_open", 1, 1),
    ]:
        assert grew(name, tenant="team-a") == tenant_a, name
        assert grew(name, tenant="team-b") == tenant_b, name
    # RAW batches carry the objects' bytes, and keys and labels besides.
    assert sent_a > sum(len(open_store(site.root).get(k)) for k in keys_a)
    assert value(during, "hapi_session_samples_total", tenant="team-a", session=sa) == 4
    assert value(during, "hapi_session_sent_bytes_total", tenant="team-b", session=sb) == sent_b
    assert grew("hapi_errors_total", tenant="team-b", error="Forbidden") == 1
    assert grew("hapi_errors_total", tenant="team-b", error="SessionNotFound") == 1
    assert grew("hapi_errors_total", tenant="-", error="Unauthenticated") == 1
    assert grew("hapi_errors_total", tenant="team-a", error="Forbidden") == 0
    # b's INPUT chunk ran its 2 samples through feature-extraction batches; a's RAW none.
    assert grew("hapi_batch_size_sum") == 2 and grew("hapi_batch_size_count") >= 1
    assert value(during, "hapi_heads_loaded") is not None
    assert value(during, "hapi_memory_budget_bytes") == a.stats().memory_budget
    # A CPU server has no CUDA allocator to show.
    assert value(during, "hapi_device_memory_bytes", kind="allocated") is None
    assert a.stats().device_allocated is None and a.stats().device_reserved is None
    assert value(during, "hapi_queue_depth") == 0  # nothing waits once the chunks are done

    a.close_session(sa)
    b.close_session(sb)
    after = scrape(url, https)
    assert value(after, "hapi_session_samples_total", tenant="team-a", session=sa) is None
    assert value(after, "hapi_samples_total", tenant="team-a") == value(
        during, "hapi_samples_total", tenant="team-a"
    )
    opened_before = value(before, "hapi_sessions_open", tenant="team-a") or 0.0
    assert value(after, "hapi_sessions_open", tenant="team-a") == opened_before


def test_sessions_carry_their_tenants_weight(server: HapiServer, a: Connection) -> None:
    session = a.open_session(request(RAW)).session
    # What the scheduler's fair share reads; there is no public view of it.
    assert server._sessions[session].weight == 2.0
    assert server._sessions[session].tenant == "team-a"
    a.close_session(session)


def scrape(url: str, context: ssl.SSLContext) -> Samples:
    with urllib.request.urlopen(url, timeout=30, context=context) as response:
        text = response.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def test_reload_swaps_tokens_and_narrows_open_sessions(site: Site, tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    write_tenants(path, a_prefixes='["datasets"]', b_token=TOKEN_B)
    with serve(ServerConfig(store=str(site.root), tenants=str(path))) as server:
        a = connect(server.address, token=TOKEN_A, timeout=30)
        key_b = "datasets/b/train/class_0/00000.jpg"
        session = a.open_session(request(RAW)).session
        assert a.fetch(ticket(session, [key_b])).batches[0].keys == [key_b]

        write_tenants(
            path, a_prefixes='["datasets/a"]', b_token="team-b-rotated-0123456789", a_weight=3
        )
        assert server.tenants.reload()
        # The open session answers to the tenant as the file says now.
        with pytest.raises(Forbidden):
            a.fetch(ticket(session, [key_b]))
        assert server._sessions[session].weight == 3.0  # the new weight, from its next chunk
        with pytest.raises(Unauthenticated):
            connect(server.address, token=TOKEN_B, timeout=30).stats()
        rotated = connect(server.address, token="team-b-rotated-0123456789", timeout=30)
        assert rotated.stats().sessions == {}

        path.write_text("[team-a]\nprefixes = 'not a list'\n")
        assert not server.tenants.reload()  # a bad file keeps the tenants loaded before
        assert rotated.stats().sessions == {}
        a.close_session(session)


def write_tenants(path: Path, *, a_prefixes: str, b_token: str, a_weight: float = 1) -> None:
    path.write_text(
        f'[team-a]\ntoken = "{TOKEN_A}"\nprefixes = {a_prefixes}\nweight = {a_weight}\n\n'
        f'[team-b]\ntoken = "{b_token}"\nprefixes = ["datasets/b"]\n'
    )


def test_a_transfer_job_trains_over_tls_with_its_tenants_token(
    server: HapiServer, site: Site
) -> None:
    job = TransferJob(
        SPEC,
        "datasets/a/train",
        server.address,
        token=TOKEN_A,
        tls_ca=str(site.certs.ca_cert),
        freeze="layer3",
        cut=None,
        image_size=SIZE,
        batch_size=2,
        chunk_size=2,
    )
    job.fit(epochs=1)
    assert job.history.epochs[0].samples == 4
    elsewhere = TransferJob(
        SPEC,
        "datasets/b/train",
        server.address,
        token=TOKEN_A,
        tls_ca=str(site.certs.ca_cert),
        freeze="layer3",
        cut=None,
        image_size=SIZE,
    )
    with pytest.raises(Forbidden):
        elsewhere.fit(epochs=1)
