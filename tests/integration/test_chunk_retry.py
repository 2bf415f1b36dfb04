"""A server killed mid-epoch and restarted on its port: the epoch completes, keys once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hapi.client import FeatureLoader, TransferJob, connect
from hapi.client.pipeline.history import Event
from hapi.client.servers.sessions import Sessions
from hapi.data import DatasetManifest, open_store, synth_dataset
from hapi.graph import INPUT
from hapi.wire import SessionRequest

from ..seaweed import free_port
from ..serve_process import ServeProcess


@pytest.fixture
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ServeProcess]:
    synth_dataset(open_store(tmp_path), "train", classes=3, per_class=6, size=72, seed=21)
    running = ServeProcess(tmp_path, free_port())
    running.start(*getattr(request, "param", ("--batch-size", "3")))
    try:
        running.wait_ready()
        yield running
    finally:
        running.stop()


def _job(server: ServeProcess) -> TransferJob:
    return TransferJob(
        {"name": "resnet18", "num_classes": 3},
        "train",
        server.address,
        freeze="layer3",
        cut="layer3",
        local_share=0.5,  # a RAW session beside the features' session: both are re-opened
        image_size=64,
        batch_size=4,
        chunk_size=3,
        prefetch=2,
        seed=3,
        retry_budget_s=90,
    )


@pytest.mark.slow
# A slow link keeps chunks in flight at step 2: the loader reads ahead of training, and on
# loopback it would have read this small epoch whole by then.
@pytest.mark.parametrize(
    "server", [("--batch-size", "3", "--egress-limit", "800kbit")], indirect=True
)
def test_a_server_killed_mid_epoch_and_restarted_loses_and_repeats_no_key(
    server: ServeProcess,
) -> None:
    reference = _job(server)
    reference.fit(1, lr=0.05)

    job = _job(server)

    def kill_and_restart(step: int, total: int) -> None:
        if step == 2:
            server.kill()  # kill -9: streams in flight are cut, sessions are gone
            server.start()  # on the same port; it takes seconds to answer

    (epoch,) = job.fit(1, lr=0.05, progress=kill_and_restart).epochs
    assert epoch.samples == 18 and not epoch.skipped  # the loader checked each key once
    assert job.history.retries and epoch.retries == len(job.history.retries)
    assert {e.data["error"] for e in job.history.retries} <= {
        "ServerUnavailable",
        "SessionNotFound",
    }
    reopened = {e.data["cut"] for e in job.history.reopens}
    assert reopened  # the restarted server had none of the job's sessions
    assert all(e.epoch == 0 for e in [*job.history.retries, *job.history.reopens])
    # The same samples in the same batches as the run without a failure.
    torch.testing.assert_close(
        torch.tensor(job.history.losses),
        torch.tensor(reference.history.losses),
        rtol=1e-4,
        atol=1e-4,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "server", [("--batch-size", "1", "--egress-limit", "800kbit")], indirect=True
)
def test_a_stream_cut_mid_chunk_is_asked_again_only_for_the_keys_it_had_not_delivered(
    server: ServeProcess,
) -> None:
    conn = connect(server.address)
    job = _job(server)  # for its model and transforms; its loader is built by hand below
    full = conn.manifest("train")
    manifest = DatasetManifest(full.prefix, full.keys[:6], full.labels[:6], full.classes)
    cut_at: list[list[str]] = []

    def on_part(chunk: int, keys: list[str]) -> None:
        # Each part is one sample (server batch 1), sent at 800 kbit/s (~0.5 s per input
        # tensor): when chunk 1's first part is in, its second is still in the server.
        if chunk == 1 and not cut_at:
            cut_at.append(keys)
            server.kill()
            server.start()

    events: list[Event] = []
    reopened: list[int] = []
    sessions = Sessions(
        conn,
        lambda cut: SessionRequest(
            model=job.spec.to_dict(),
            cut=cut,
            freeze=job.freeze,
            transforms=job.config.test_transforms.to_dict(),
            image_size=64,
        ),
        on_reopen=lambda cut, lost, new: reopened.append(cut),
    )
    with sessions:
        loader = FeatureLoader(
            conn,
            sessions,
            manifest,
            batch_size=2,
            chunk_size=3,
            prefetch=1,
            shuffle=False,
            retry_budget_s=120,
            cut=INPUT,
            record=events.append,
            on_part=on_part,
        )
        delivered = [k for batch in loader.batches(0) for k in batch.keys]
    assert delivered == list(manifest.keys)  # each once, in the epoch's order
    assert len(cut_at) == 1 and len(cut_at[0]) == 1
    retries = [e for e in events if e.chunk == 1]
    assert retries and retries[0].data["keys_left"] == 2  # not the key it had delivered
    assert reopened == [INPUT]
