"""Beside a storage cluster: a real SeaweedFS cluster (a master, three volume servers, a
filer and its S3 gateway) with a `hapi serve` beside each volume server; a job sends each
chunk to the server beside its bytes (docs/locality.md)."""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hapi.client import TransferJob, connect
from hapi.data import open_store, synth_dataset
from hapi.data.store.seaweed import AUTO, SeaweedLocator, find_beside, volume_ids
from hapi.errors import InvalidRequest
from hapi.server import HapiServer, ServerConfig, serve

from ..seaweed_cluster import SeaweedCluster

pytestmark = pytest.mark.s3

PER_CLASS = 24
SAMPLES = 3 * PER_CLASS


@contextlib.contextmanager
def _cluster(tmp: Path, replication: str) -> Iterator[tuple[SeaweedCluster, str, list[HapiServer]]]:
    """The cluster, a bucket with a dataset under `train/`, and a server beside each
    volume server."""
    with SeaweedCluster(tmp / "weed", replication=replication) as cluster:
        uri = cluster.new_bucket()
        store = open_store(uri, cluster.options)
        synth_dataset(store, "train", classes=3, per_class=PER_CLASS, size=40, seed=4)
        with contextlib.ExitStack() as stack:
            servers = [
                stack.enter_context(
                    serve(
                        ServerConfig(
                            store=uri,
                            store_options=cluster.options,
                            beside=volume,
                            filer=cluster.filer_url,
                            batch_size=4,
                        )
                    )
                )
                for volume in cluster.volume_urls
            ]
            yield cluster, uri, servers


@pytest.fixture(scope="module")
def placed(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[SeaweedCluster, str, list[HapiServer]]]:
    with _cluster(tmp_path_factory.mktemp("locality"), "000") as found:
        yield found


def _job(servers: list[HapiServer], **options: object) -> TransferJob:
    return TransferJob(
        {"name": "resnet18", "num_classes": 3},
        "train",
        [s.address for s in servers],
        freeze="layer3",
        cut="layer3",
        image_size=32,
        batch_size=4,
        chunk_size=4,
        prefetch=2,
        seed=3,
        **options,
    )


def _read_bytes(server: HapiServer, where: str) -> float:
    found = re.search(
        rf"^hapi_{where}_read_bytes_total (\S+)$", server.metrics.render().decode(), re.M
    )
    assert found is not None
    return float(found.group(1))


def test_each_object_is_local_to_the_one_server_beside_its_volume(
    placed: tuple[SeaweedCluster, str, list[HapiServer]],
) -> None:
    _, _, servers = placed
    keys = connect(servers[0].address).manifest("train").keys
    replies = [connect(s.address).locate(list(keys)) for s in servers]
    for i, key in enumerate(keys):
        totals = {r.total[i] for r in replies}
        assert len(totals) == 1 and totals.pop() > 0, key
        holders = [j for j, r in enumerate(replies) if r.local[i]]
        # Unreplicated: all of an object's bytes on exactly one node.
        assert len(holders) == 1 and replies[holders[0]].local[i] == replies[0].total[i], key
    # The objects are spread over the nodes (the master assigns volumes round the cluster).
    assert sum(any(r.local) for r in replies) >= 2


def test_a_job_reads_its_chunks_beside_their_bytes_and_each_key_once(
    placed: tuple[SeaweedCluster, str, list[HapiServer]],
) -> None:
    _, _, servers = placed
    before = [(_read_bytes(s, "local"), _read_bytes(s, "remote")) for s in servers]
    job = _job(servers)
    (epoch,) = job.fit(1, lr=0.05).epochs
    assert epoch.samples == SAMPLES and not epoch.skipped
    assert epoch.read_bytes > 0 and epoch.placed_bytes == epoch.read_bytes
    # Chunks of random keys over 3 nodes read about 35% locally. On loopback another
    # node's bytes come as fast as a server's own, so the servers take some of the node
    # holding most keys' chunks once they measure that (the routing's unit tests).
    assert job.history.local_fraction is not None and job.history.local_fraction >= 0.6
    local = sum(_read_bytes(s, "local") - b[0] for s, b in zip(servers, before, strict=True))
    remote = sum(_read_bytes(s, "remote") - b[1] for s, b in zip(servers, before, strict=True))
    assert (local + remote, local) == (epoch.read_bytes, epoch.local_bytes), (local, remote)
    served = [connect(s.address).stats() for s in servers]
    samples = [
        sum(x.samples for x in [*st.sessions.values(), *st.closed_sessions.values()])
        for st in served
    ]
    assert sum(1 for n in samples if n) >= 2  # the work spread over the nodes


def test_a_server_not_beside_a_volume_server_refuses_to_locate(
    placed: tuple[SeaweedCluster, str, list[HapiServer]],
) -> None:
    cluster, uri, _ = placed
    with (
        serve(ServerConfig(store=uri, store_options=cluster.options)) as plain,
        pytest.raises(InvalidRequest, match="--beside"),
    ):
        connect(plain.address).locate(["train/class_0/00000.jpg"])


def test_beside_auto_finds_the_one_volume_server_running_here(
    placed: tuple[SeaweedCluster, str, list[HapiServer]],
) -> None:
    cluster, uri, _ = placed
    pid = {name: weed.proc.pid for name, weed in cluster.procs.items() if weed.proc}
    volumes = [pid[f"volume{i}"] for i in range(cluster.volumes)]
    # On a storage node one volume server runs: its real command line names its port.
    assert find_beside(AUTO, pids=[pid["master"], volumes[1]]) == cluster.volume_urls[1]
    assert find_beside(cluster.volume_urls[2]) == cluster.volume_urls[2]  # named: as is
    with pytest.raises(InvalidRequest, match="found no SeaweedFS volume server"):
        find_beside(AUTO, pids=[pid["master"], pid["filer"]])
    with pytest.raises(InvalidRequest, match="found 3 SeaweedFS volume servers") as refused:
        find_beside(AUTO, pids=volumes)
    assert all(url in str(refused.value) for url in cluster.volume_urls)
    # This machine runs the cluster's three (and perhaps the tests' single SeaweedFS):
    # a server told `auto` refuses to guess, before it serves.
    with pytest.raises(InvalidRequest, match="--beside URL"):
        ServerConfig(store=uri, store_options=cluster.options, beside=AUTO, filer=cluster.filer_url)


def test_beside_needs_a_filer_and_an_s3_store(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="--filer"):
        ServerConfig(store="s3://b", beside="http://127.0.0.1:8080")
    with pytest.raises(InvalidRequest, match="S3 gateway"):
        ServerConfig(
            store=str(tmp_path), beside="http://127.0.0.1:8080", filer="http://127.0.0.1:8888"
        )
    with pytest.raises(InvalidRequest, match="http"):
        ServerConfig(store="s3://b", beside="127.0.0.1:8080", filer="http://127.0.0.1:8888")


def test_a_volume_server_killed_mid_epoch_loses_no_key_with_replicas(tmp_path: Path) -> None:
    with _cluster(tmp_path, "001") as (cluster, _, servers):
        job = _job(servers, retry_budget_s=60)
        killed = threading.Event()

        def kill_after_first_chunks() -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not job.history.events and not killed.is_set():
                stats = [connect(s.address).stats() for s in servers]
                if sum(x.samples for st in stats for x in st.sessions.values()) >= 8:
                    break
                time.sleep(0.05)
            cluster.stop_volume(0)
            killed.set()

        killer = threading.Thread(target=kill_after_first_chunks, daemon=True)
        killer.start()
        (epoch,) = job.fit(1, lr=0.05).epochs
        killer.join(timeout=60)
        assert killed.is_set()
        assert epoch.samples == SAMPLES and not epoch.skipped


def test_the_filer_places_keys_alike_listed_or_one_by_one(
    placed: tuple[SeaweedCluster, str, list[HapiServer]],
) -> None:
    cluster, uri, servers = placed
    bucket = uri.removeprefix("s3://")
    keys = [*connect(servers[0].address).manifest("train").keys, "train/missing.jpg"]
    listed = SeaweedLocator(cluster.filer_url, bucket, listed_at=1)
    one_by_one = SeaweedLocator(cluster.filer_url, bucket, listed_at=10**9)
    assert listed.cached(keys) is None  # nothing asked yet: the filer is not asked here
    placements = listed.locate(keys)
    assert placements == one_by_one.locate(keys) and listed.cached(keys) == placements
    assert placements[-1] == {} and all(placements[:-1])
    held = [volume_ids(url) for url in cluster.volume_urls]
    for key, placement in zip(keys[:-1], placements, strict=False):
        size = open_store(uri, cluster.options).size(key)
        assert sum(placement.values()) == size, key
        assert all(sum(v in h for h in held) == 1 for v in placement), key
    # A shard member lies where its shard does; a prefixed store looks under its prefix.
    open_store(uri, cluster.options).put("shards/s-000.tar", bytes(5000))
    shard = listed.locate(["shards/s-000.tar"])
    assert sum(shard[0].values()) == 5000
    assert one_by_one.locate(["shards/s-000.tar#k1.jpg", "shards/s-000.tar#k2.cls"]) == shard * 2
    under = SeaweedLocator(f"{cluster.filer_url}/buckets", bucket, "train")
    assert under.locate([keys[0].removeprefix("train/")]) == placements[:1]


def test_a_resumed_job_orders_its_epochs_by_the_homes_it_saved(
    placed: tuple[SeaweedCluster, str, list[HapiServer]],
) -> None:
    _, _, servers = placed
    # Exact features and a small step: the same batches train alike wherever computed.
    first = _job(servers, exact=True)
    first.fit(1, lr=0.001)
    state = first.state_dict()
    assert state["homes"] is not None and len(state["homes"]) == SAMPLES
    # The servers listed the other way round number the homes otherwise: without the
    # saved homes the next epoch's chunks would be other keys, and train otherwise.
    same = _job(servers, exact=True)
    same.fit(1, lr=0.001, resume_from=state)
    reversed_ = _job(servers[::-1], exact=True)
    reversed_.fit(1, lr=0.001, resume_from=state)
    unsaved = _job(servers[::-1], exact=True)
    unsaved.fit(1, lr=0.001, resume_from={**state, "homes": None})
    steps = SAMPLES // 4
    losses = [torch.tensor(j.history.losses[-steps:]) for j in (same, reversed_, unsaved)]
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(losses[2], losses[0], rtol=1e-3, atol=1e-3)
