"""A job's features as a PyTorch dataset: every key once per epoch, in this process or in
DataLoader workers, and again once when a pass stopped mid-epoch resumes."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator

import pytest
import torch

from hapi.client import FeatureBatch, FeatureDataLoader, FeatureDataset, TransferJob
from hapi.data import open_store, synth_dataset
from hapi.errors import InvalidRequest
from hapi.server import HapiServer, serve

SAMPLES = 20
BATCH = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HapiServer]:
    root = tmp_path_factory.mktemp("store")
    store = open_store(root)
    synth_dataset(store, "train", classes=2, per_class=SAMPLES // 2, size=40, seed=3)
    synth_dataset(store, "val", classes=2, per_class=3, size=40, seed=4)
    with serve(store=str(root)) as running:
        yield running


def _job(server: HapiServer, **options: object) -> TransferJob:
    settings: dict[str, object] = {
        "freeze": "layer4",
        "cut": "layer3",  # before the freeze point: the trainer carries them on
        "image_size": 32,
        "batch_size": BATCH,
        "chunk_size": 3,
        "augment": False,
        "eval_dataset": "val",
        "cache": False,
    }
    settings.update(options)
    return TransferJob({"name": "resnet18", "num_classes": 2}, "train", server.address, **settings)


def _keys(batches: list[FeatureBatch]) -> Counter[str]:
    return Counter(k for b in batches for k in b.keys)


def test_the_dataset_yields_freeze_point_features_the_tail_trains_on(
    server: HapiServer,
) -> None:
    job = _job(server)
    dataset = FeatureDataset(job)
    loader = FeatureDataLoader(dataset)
    tail = dataset.tail()
    assert tail is job._model.parts.tail(job.freeze)
    names = set(job.manifest("train").keys)
    for epoch in range(2):
        batches = list(loader)
        assert _keys(batches) == Counter(names), epoch  # every key, once
        assert len(batches) == len(loader) == SAMPLES // BATCH
        x, y = batches[0]
        assert x.shape == (BATCH, *job.graph.cut_point(job.freeze).shape)
        out = tail(x)
        assert out.shape == (BATCH, 2) and out.requires_grad  # grad mode is the caller's
        assert y.dtype == torch.long
    # Epoch 2 is another order; the job's history has both epochs' figures.
    assert [e.epoch for e in job.history.epochs] == [0, 1]
    assert all(e.samples == SAMPLES and e.cut == job.cut for e in job.history.epochs)
    evaluation = list(FeatureDataLoader(FeatureDataset(job, "eval")))
    assert sum(len(b) for b in evaluation) == 6 and {b.split for b in evaluation} == {"eval"}


def test_two_workers_deliver_every_key_once_and_resume_mid_epoch(server: HapiServer) -> None:
    job = _job(server)
    names = Counter(job.manifest("train").keys)
    loader = FeatureDataLoader(FeatureDataset(job), num_workers=2)
    whole = list(loader)
    assert _keys(whole) == names and len(whole) == len(loader)
    assert {b.worker for b in whole} == {0, 1}
    # Each worker's last batch brought its share's figures; the loader merged them.
    assert sum(b.figures is not None for b in whole) == 2
    (figures,) = loader.epochs
    assert figures.samples == SAMPLES and figures.bytes_received > 0
    assert figures.cut == job.cut and figures.chunks_pushed + figures.chunks_local >= 2
    # Epoch 1, stopped after three batches; a new job and loader go on from its state.
    first = list(itertools.islice(iter(loader), 3))
    state = loader.state_dict()
    assert state["epoch"] == 1 and sum(state["batches"]) == 3
    again = FeatureDataLoader(FeatureDataset(_job(server)), num_workers=2)
    again.load_state_dict(state)
    rest = list(again)
    assert _keys(first + rest) == names  # every key of the epoch once
    assert again.state_dict() == {"epoch": 2, "batches": [0, 0]}


def test_a_state_of_another_loader_is_refused(server: HapiServer) -> None:
    loader = FeatureDataLoader(FeatureDataset(_job(server)))
    with pytest.raises(InvalidRequest, match="num_workers=2"):
        loader.load_state_dict({"epoch": 0, "batches": [1, 1]})
    with pytest.raises(InvalidRequest, match="state_dict"):
        loader.load_state_dict({"position": 3})
    with pytest.raises(InvalidRequest, match="split"):
        FeatureDataset(_job(server), "test")  # type: ignore[arg-type]


def test_ranks_that_would_take_different_steps_are_refused_before_ddp_waits(
    server: HapiServer,
) -> None:
    dataset = FeatureDataset(_job(server, batch_size=3))
    # 20 samples, 2 ranks x 3 workers, 3 a batch: a last global batch of 2 for 6 shares.
    dataset.workers, dataset.ranks = 3, (1, 2)
    assert [sum(dataset.worker_batches(r)) for r in (0, 1)] == [5, 3]
    with pytest.raises(InvalidRequest, match="global batch of 2, fewer than its 6 shares"):
        dataset.check_even()
    dataset.workers = 1  # 2 shares: the last global batch of 2 gives each one sample
    dataset.check_even()
    assert len(dataset) == 4
