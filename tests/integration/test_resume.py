"""A job stopped mid-epoch and resumed trains what a job never stopped trains, keys once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hapi.client import FeatureLoader, TransferJob, connect
from hapi.client.servers.sessions import Sessions
from hapi.data import Transforms, open_store, synth_dataset
from hapi.errors import InvalidRequest
from hapi.server import HapiServer, serve
from hapi.wire import SessionRequest

SAMPLES = 16
BATCH = 4


class _Stop(Exception):
    """The test's stand-in for a trainer killed mid-epoch."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HapiServer]:
    root = tmp_path_factory.mktemp("store")
    synth_dataset(open_store(root), "train", classes=2, per_class=8, size=40, seed=5)
    with serve(store=str(root), batch_size=3) as running:
        yield running


def _job(server: HapiServer, **options: object) -> TransferJob:
    defaults: dict[str, object] = {
        "freeze": "layer3",
        "cut": "layer3",  # the freeze cut: only the tail trains, on the server's features
        "image_size": 32,
        "batch_size": BATCH,
        "chunk_size": 3,  # chunks that do not align with the training batches
        "prefetch": 2,
        "seed": 11,
        "exact": True,  # the server's head per sample: features bit for bit
    }
    defaults.update(options)
    return TransferJob({"name": "resnet18", "num_classes": 2}, "train", server.address, **defaults)


def _stop_at(epoch_step: tuple[int, int], job: TransferJob) -> object:
    def progress(step: int, total: int) -> None:
        if (len(job.history.epochs), step) == epoch_step:
            raise _Stop

    return progress


def test_a_job_stopped_mid_epoch_resumes_to_the_same_losses(
    server: HapiServer, tmp_path: Path
) -> None:
    reference = _job(server)
    reference.fit(2, lr=0.05)
    assert len(reference.history.losses) == 2 * SAMPLES // BATCH

    stopped = _job(server)
    with pytest.raises(_Stop):
        stopped.fit(2, lr=0.05, progress=_stop_at((1, 3), stopped))  # type: ignore[arg-type]
    path = tmp_path / "job.pt"
    stopped.save_state(path)
    state = torch.load(path, weights_only=True)
    assert (state["epoch"], state["position"]) == (1, 3 * BATCH)

    # A new process: a job built afresh, its tail's weights not yet trained.
    resumed = _job(server)
    resumed.fit(1, lr=0.05, resume_from=path)  # the rest of epoch 1
    # The same batches in the same order as the job never stopped: bit-equal losses.
    assert resumed.history.losses == reference.history.losses
    (epoch,) = resumed.history.epochs
    assert epoch.epoch == 1
    assert epoch.samples == SAMPLES - 3 * BATCH  # the trained keys were not fetched again
    for mine, theirs in zip(
        resumed.tail.state_dict().values(), reference.tail.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


def test_a_state_taken_between_epochs_resumes_at_the_next_one(server: HapiServer) -> None:
    reference = _job(server)
    reference.fit(2, lr=0.05)
    first = _job(server)
    first.fit(1, lr=0.05)
    state = first.state_dict()
    assert (state["epoch"], state["position"]) == (1, 0)
    resumed = _job(server)
    resumed.fit(1, lr=0.05, resume_from=state)
    assert resumed.history.losses == reference.history.losses
    # The state in memory is a snapshot: the job it came from trains on, and one resumed
    # from it updates the optimizer's momentum, and neither changes it.
    first.fit(1, lr=0.05)
    again = _job(server)
    again.fit(1, lr=0.05, resume_from=state)
    assert again.history.losses == reference.history.losses


def test_a_state_of_another_job_is_refused(server: HapiServer) -> None:
    state = _job(server).state_dict()
    with pytest.raises(InvalidRequest, match="seed"):
        _job(server, seed=12).load_state_dict(state)


def test_a_resumed_epoch_delivers_each_key_of_its_rest_once(server: HapiServer) -> None:
    conn = connect(server.address)

    def request(cut: int) -> SessionRequest:
        model = {"name": "resnet18", "num_classes": 2}
        transforms = Transforms.eval(32).to_dict()
        return SessionRequest(model=model, cut=cut, transforms=transforms, image_size=32)

    with conn, Sessions(conn, request) as sessions:
        loader = FeatureLoader(
            conn, sessions, conn.manifest("train"), batch_size=BATCH, chunk_size=3, seed=11
        )
        whole = [b.keys for b in loader.batches(1)]
        rest = [b.keys for b in loader.batches(1, start=2 * BATCH)]
    assert rest == whole[2:]  # the same batches from there on, not one key before
    with pytest.raises(InvalidRequest, match="start"):
        loader.batches(1, start=SAMPLES + 1)
