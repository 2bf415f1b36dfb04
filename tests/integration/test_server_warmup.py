"""A job's server loads the model while the trainer builds its own (`_server_warmup`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from hapi.client import TransferJob, connect
from hapi.data import open_store, synth_dataset
from hapi.server import HapiServer, serve


@pytest.fixture
def server(tmp_path: Path) -> Iterator[HapiServer]:
    synth_dataset(open_store(tmp_path), "train", classes=3, per_class=4, size=72, seed=8)
    with serve(store=str(tmp_path), batch_size=4) as running:
        yield running


def test_a_job_built_from_a_spec_has_its_server_load_the_model(server: HapiServer) -> None:
    conn = connect(server.address)
    assert conn.stats().memory_used == 0
    job = TransferJob(
        {"name": "resnet18", "num_classes": 3}, "train", server.address,
        freeze="layer3", image_size=64, batch_size=4, chunk_size=4, cut=None,
    )  # fmt: skip
    stats = conn.stats()
    # The model's weights (ResNet-18's 45 MB), loaded before the job asked for anything.
    assert stats.memory_used > 40e6
    assert not stats.sessions and len(stats.closed_sessions) == 1  # the warm-up's, closed
    (epoch,) = job.fit(1, lr=0.05).epochs
    assert epoch.samples == 12


def test_a_module_of_the_users_own_warms_nothing(server: HapiServer) -> None:
    # Its head must be exported and uploaded first: the server cannot load it before.
    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(3))
    module(torch.zeros(1, 3, 16, 16))
    module[0].requires_grad_(False)
    TransferJob(module, "train", server.address, image_size=16, batch_size=4, cut=None)
    assert not connect(server.address).stats().closed_sessions
