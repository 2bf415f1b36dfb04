"""`hapi serve --feature-cache` on a loopback port: a second job's chunk comes from the
cache bit for bit, and nothing else ever does - another head, other transforms, a rewritten
object, a corrupt entry, fresh augmentation, or a tenant outside the keys' prefix."""

from __future__ import annotations

import dataclasses
import io
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from PIL import Image

from hapi.cache import FeatureCache
from hapi.client import Connection, TransferJob, connect
from hapi.data import DatasetManifest, StoreOptions, Transforms, open_store, synth_dataset
from hapi.errors import Forbidden
from hapi.graph import ModelSpec
from hapi.server import HapiServer, ServerConfig, serve
from hapi.server.chunks.feature_cache import ServerFeatureCache
from hapi.wire import ChunkReport, ChunkTicket, SessionRequest

SIZE = 64
SPEC = ModelSpec(name="resnet18", num_classes=3)
EVAL = Transforms.eval(SIZE)


@dataclasses.dataclass(frozen=True)
class Fetched:
    keys: list[str]
    features: torch.Tensor
    report: ChunkReport


def fetch(conn: Connection, ticket: ChunkTicket) -> Fetched:
    keys: list[str] = []
    parts: list[torch.Tensor] = []
    report = None
    for part in conn.stream(ticket):
        if part.batch is not None and part.batch.features is not None:
            keys += part.batch.keys
            parts.append(part.batch.features)
        report = part.report or report
    assert report is not None
    return Fetched(keys, torch.cat(parts), report)


def request(**overrides: object) -> SessionRequest:
    fields: dict[str, object] = {
        "model": SPEC.to_dict(),
        "cut": 5,
        "transforms": EVAL.to_dict(),
        "image_size": SIZE,
        "exact": True,
    }
    fields.update(overrides)
    return SessionRequest(**fields)  # type: ignore[arg-type]


def ticket(
    session: str, manifest: DatasetManifest, keys: list[str] | None = None, epoch: int = 0
) -> ChunkTicket:
    keys = list(manifest.keys) if keys is None else keys
    version = dict(zip(manifest.keys, manifest.versions, strict=True))
    return ChunkTicket(
        session=session,
        chunk=0,
        epoch=epoch,
        keys=keys,
        labels=[0] * len(keys),
        versions=[version[k] for k in keys],
    )


def run(conn: Connection, req: SessionRequest, tick: ChunkTicket) -> Fetched:
    """One chunk of a session of its own (a job's), closed after."""
    session = conn.open_session(req).session
    try:
        return fetch(conn, tick.model_copy(update={"session": session}))
    finally:
        conn.close_session(session)


def tier(server: HapiServer) -> ServerFeatureCache:
    assert isinstance(server.features, ServerFeatureCache)
    return server.features


def entries(root: Path) -> int:
    """The entries the cache directory's index files hold."""
    return sum(u.entries for u in FeatureCache(root).usage())


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    synth_dataset(open_store(root), "train", classes=2, per_class=3, size=72, seed=3)
    return root


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    return tmp_path / "features"


@pytest.fixture
def server(store_dir: Path, cache_dir: Path) -> Iterator[HapiServer]:
    config = ServerConfig(store=str(store_dir), batch_size=4, feature_cache=str(cache_dir))
    with serve(config) as running:
        yield running


@pytest.fixture
def conn(server: HapiServer) -> Iterator[Connection]:
    with connect(server.address) as c:
        yield c


@pytest.fixture
def manifest(store_dir: Path) -> DatasetManifest:
    return DatasetManifest.from_store(open_store(store_dir), "train")


def test_a_second_job_gets_its_chunk_from_the_cache_bit_for_bit(
    server: HapiServer, conn: Connection, manifest: DatasetManifest
) -> None:
    first = run(conn, request(), ticket("-", manifest))
    assert first.report.cached == 0
    tier(server).flush()
    session = conn.open_session(request()).session
    second = fetch(conn, ticket(session, manifest))
    stats = conn.close_session(session)
    assert second.report.cached == len(manifest.keys) == 6
    assert second.keys == first.keys == list(manifest.keys)
    assert torch.equal(second.features, first.features)
    # Neither the objects nor the head were touched; reading the entries is the work.
    assert stats.bytes_read == 0 and stats.head_s == 0 and stats.cache_hits == 6
    assert second.report.server_s > 0 and second.report.queue_s == 0
    cache = conn.stats().feature_cache
    assert cache is not None
    assert (cache.hits, cache.misses, cache.writes) == (6, 6, 6)
    assert cache.bytes_held > 0 and cache.max_bytes == 50 << 30
    metrics = server.metrics.render().decode()
    assert "hapi_feature_cache_hits_total 6.0" in metrics
    assert "hapi_feature_cache_misses_total 6.0" in metrics


def test_hits_and_misses_keep_the_tickets_order(
    server: HapiServer, conn: Connection, manifest: DatasetManifest
) -> None:
    keys = list(manifest.keys)
    run(conn, request(), ticket("-", manifest, keys[1:5:2]))  # caches keys 1 and 3
    tier(server).flush()
    order = [keys[5], keys[1], keys[0], keys[3], keys[4], keys[2]]
    mixed = run(conn, request(), ticket("-", manifest, order))
    assert mixed.keys == order and mixed.report.cached == 2
    uncached = run(
        conn, request(), ticket("-", manifest, order).model_copy(update={"versions": None})
    )
    assert uncached.report.cached == 0
    assert torch.equal(mixed.features, uncached.features)


def test_another_head_or_other_transforms_miss_and_the_same_head_content_hits(
    server: HapiServer, conn: Connection, manifest: DatasetManifest
) -> None:
    base = run(conn, request(), ticket("-", manifest))
    tier(server).flush()
    other_weights = ModelSpec(name="resnet18", num_classes=3, seed=1).to_dict()
    assert run(conn, request(model=other_weights), ticket("-", manifest)).report.cached == 0
    assert run(conn, request(cut=4), ticket("-", manifest)).report.cached == 0
    other = Transforms.eval(SIZE + 8).to_dict()
    assert (
        run(
            conn, request(transforms=other, image_size=SIZE + 8), ticket("-", manifest)
        ).report.cached
        == 0
    )
    assert run(conn, request(exact=False), ticket("-", manifest)).report.cached == 0
    assert run(conn, request(wire_dtype="fp16"), ticket("-", manifest)).report.cached == 0
    # Another classifier on the same seeded backbone: the head up to cut 5 is the same.
    derived = ModelSpec(name="resnet18", num_classes=7).to_dict()
    same = run(conn, request(model=derived), ticket("-", manifest))
    assert same.report.cached == len(manifest.keys)
    assert torch.equal(same.features, base.features)


def test_a_corrupt_entry_is_a_miss_and_is_replaced(
    server: HapiServer, conn: Connection, manifest: DatasetManifest, cache_dir: Path
) -> None:
    first = run(conn, request(), ticket("-", manifest))
    tier(server).flush()
    (segment,) = cache_dir.glob("v2/*/*.seg")
    data = bytearray(segment.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside one entry
    segment.write_bytes(bytes(data))
    again = run(conn, request(), ticket("-", manifest))
    assert again.report.cached == len(manifest.keys) - 1
    assert torch.equal(again.features, first.features)
    tier(server).flush()
    stats = conn.stats().feature_cache
    assert stats is not None and stats.corrupt == 1
    assert run(conn, request(), ticket("-", manifest)).report.cached == len(manifest.keys)


def test_fresh_random_transforms_are_never_cached_and_views_are(
    server: HapiServer, conn: Connection, manifest: DatasetManifest, cache_dir: Path
) -> None:
    train = Transforms.train(SIZE)
    fresh = request(transforms=train.to_dict(), exact=False)
    for _ in range(2):
        assert run(conn, fresh, ticket("-", manifest)).report.cached == 0
    tier(server).flush()
    assert entries(cache_dir) == 0
    views = request(transforms=dataclasses.replace(train, views=2).to_dict(), exact=True)
    epoch0 = run(conn, views, ticket("-", manifest, epoch=0))
    tier(server).flush()
    assert run(conn, views, ticket("-", manifest, epoch=1)).report.cached == 0
    epoch2 = run(conn, views, ticket("-", manifest, epoch=2))
    assert epoch2.report.cached == len(manifest.keys)
    assert torch.equal(epoch2.features, epoch0.features)


def test_a_tenant_outside_the_prefix_gets_the_prefix_error_not_a_hit(
    tmp_path: Path, cache_dir: Path
) -> None:
    root = tmp_path / "shared"
    store = open_store(root)
    synth_dataset(store, "datasets/a/train", classes=2, per_class=2, size=72, seed=1)
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(
        '[team-a]\ntoken = "team-a-token-0123456789"\nprefixes = ["datasets/a"]\n\n'
        '[team-b]\ntoken = "team-b-token-9876543210"\nprefixes = ["datasets/b"]\n'
    )
    manifest = DatasetManifest.from_store(store, "datasets/a/train")
    config = ServerConfig(store=str(root), tenants=str(tenants), feature_cache=str(cache_dir))
    with serve(config) as server:
        with connect(server.address, token="team-a-token-0123456789") as a:
            run(a, request(), ticket("-", manifest))
        tier(server).flush()
        assert entries(cache_dir) == len(manifest.keys)
        with connect(server.address, token="team-b-token-9876543210") as b:
            session = b.open_session(request()).session
            with pytest.raises(Forbidden, match="outside the prefixes tenant 'team-b' may read"):
                fetch(b, ticket(session, manifest))
        stats = tier(server).stats()
        assert stats.hits == 0


def _jpeg(color: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (72, 72), color).save(out, format="JPEG")
    return out.getvalue()


@pytest.mark.s3
def test_an_object_rewritten_in_the_store_is_a_miss_never_a_stale_hit(
    s3_bucket: tuple[str, StoreOptions], cache_dir: Path
) -> None:
    uri, options = s3_bucket
    store = open_store(uri, options)
    synth_dataset(store, "train", classes=2, per_class=2, size=72, seed=4)
    before = DatasetManifest.from_store(store, "train")
    changed = before.keys[1]
    config = ServerConfig(store=uri, store_options=options, feature_cache=str(cache_dir))
    with serve(config) as server, connect(server.address) as conn:
        first = run(conn, request(), ticket("-", before))
        tier(server).flush()
        store.put(changed, _jpeg((250, 10, 10)))
        after = DatasetManifest.from_store(store, "train")
        assert dict(zip(after.keys, after.versions, strict=True))[changed] != before.versions[1]

        fresh = run(conn, request(), ticket("-", after))
        assert fresh.report.cached == len(after.keys) - 1
        uncached = run(conn, request(), ticket("-", after).model_copy(update={"versions": None}))
        assert torch.equal(fresh.features, uncached.features)
        assert not torch.equal(fresh.features[1], first.features[1])

        # A client whose listing predates a rewrite: its miss reads the new bytes, and they
        # are not stored under the old version it names.
        other = request(cut=4)
        store.put(before.keys[2], _jpeg((10, 250, 10)))
        run(conn, other, ticket("-", before, [before.keys[2]]))
        tier(server).flush()
        assert run(conn, other, ticket("-", before, [before.keys[2]])).report.cached == 0


def test_a_sweeps_later_jobs_train_from_the_servers_cache_with_the_same_losses(
    server: HapiServer, store_dir: Path
) -> None:
    def job(address: str, epochs: int) -> list[float]:
        trained = TransferJob(
            {"name": "resnet18", "num_classes": 2},
            "train",
            address,
            freeze="layer3",
            cut=None,
            image_size=SIZE,
            batch_size=4,
            chunk_size=4,
            seed=3,
            augment=False,
            exact=True,
            cache=False,  # the trainer's tier off: only the server's can hit
        )
        return [e.loss for e in trained.fit(epochs=epochs, lr=0.05).epochs]

    job(server.address, 1)
    tier(server).flush()
    assert tier(server).stats().writes == 6
    # Every chunk of both epochs from the cache; losses as a server without one gives.
    swept = job(server.address, 2)
    assert tier(server).stats().hits == 12
    with serve(ServerConfig(store=str(store_dir), batch_size=4)) as plain:
        assert job(plain.address, 2) == swept


def test_two_jobs_filling_the_same_entries_at_once_leave_one_good_copy(
    server: HapiServer, conn: Connection, manifest: DatasetManifest, cache_dir: Path
) -> None:
    results: list[Fetched] = []

    def one_job() -> None:
        with connect(server.address) as own:
            results.append(run(own, request(), ticket("-", manifest)))

    jobs = [threading.Thread(target=one_job) for _ in range(2)]
    for t in jobs:
        t.start()
    for t in jobs:
        t.join()
    tier(server).flush()
    assert len(results) == 2 and torch.equal(results[0].features, results[1].features)
    assert entries(cache_dir) == len(manifest.keys)
    third = run(conn, request(), ticket("-", manifest))
    assert third.report.cached == len(manifest.keys)
    assert torch.equal(third.features, results[0].features)
