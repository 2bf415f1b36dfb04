"""`hapi serve --store az://...` and `gs://...` beside emulators, and a training job on each."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hapi.client import TransferJob
from hapi.data import open_store, synth_dataset

from ..azurite import Azurite
from ..fake_gcs import FakeGCS
from ..seaweed import free_port
from ..serve_process import ServeProcess


@pytest.fixture(scope="module")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Azurite]:
    with Azurite(Path(tmp_path_factory.mktemp("azurite"))) as server:
        yield server


@pytest.fixture(scope="module")
def gcs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeGCS]:
    with FakeGCS(Path(tmp_path_factory.mktemp("fake-gcs"))) as server:
        yield server


def _train(address: str) -> dict[str, TransferJob]:
    jobs = {
        mode: TransferJob(
            {"name": "resnet18", "num_classes": 2},
            "train",
            address,
            freeze="layer4",
            cut=None,  # the freeze point: no planning probes in the bytes compared
            image_size=64,
            batch_size=4,
            mode=mode,
            chunk_size=5,
        )
        for mode in ("local", "pushdown")
    }
    for job in jobs.values():
        job.fit(1, lr=0.05)
    return jobs


def _check(jobs: dict[str, TransferJob]) -> None:
    torch.testing.assert_close(
        torch.tensor(jobs["pushdown"].history.losses),
        torch.tensor(jobs["local"].history.losses),
        rtol=1e-4,
        atol=1e-4,
    )
    local, push = (jobs[m].history.epochs[0] for m in ("local", "pushdown"))
    assert local.samples == push.samples == 12
    # Every chunk of the pushdown job was read from the cloud store by the server.
    assert push.chunks_pushed > 0 and push.chunks_local == 0 and push.fallbacks == 0


def _serve(uri: str, env: dict[str, str], *options: str) -> Iterator[ServeProcess]:
    server = ServeProcess(uri, free_port(), env=env)
    server.start(*options)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def test_hapi_serve_on_azure_trains_as_the_baseline(azurite: Azurite) -> None:
    uri = azurite.new_container()
    synth_dataset(open_store(uri, azurite.options), "train", classes=2, per_class=6, size=72)
    # Credentials from the environment, the endpoint from --endpoint: as a user runs it.
    env = {k: v for k, v in azurite.client_env.items() if k != "AZURE_STORAGE_ENDPOINT"}
    for server in _serve(uri, env, "--endpoint", azurite.endpoint):
        _check(_train(server.address))


def test_hapi_serve_on_gcs_trains_as_the_baseline(gcs: FakeGCS, tmp_path: Path) -> None:
    local = open_store(tmp_path)
    synth_dataset(local, "train", classes=2, per_class=6, size=72)
    uri = f"{gcs.new_bucket()}/datasets"
    for key in local.list():
        gcs.upload(uri, key, local.get(key))
    for server in _serve(uri, gcs.client_env):
        _check(_train(server.address))
