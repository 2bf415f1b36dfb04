"""The whole pipeline on a real S3 store: SeaweedFS, a server beside it, a training job."""

from __future__ import annotations

import pytest
import torch

from hapi.client import TransferJob
from hapi.data import StoreOptions, open_store, synth_dataset
from hapi.errors import ObjectNotFound
from hapi.server import ServerConfig, serve

pytestmark = pytest.mark.s3


def test_training_from_seaweedfs_matches_the_baseline(
    s3_bucket: tuple[str, StoreOptions],
) -> None:
    uri, options = s3_bucket
    synth_dataset(open_store(uri, options), "train", classes=2, per_class=6, size=72, seed=5)
    with serve(ServerConfig(store=uri, store_options=options)) as server:
        jobs = {
            mode: TransferJob(
                {"name": "resnet18", "num_classes": 2},
                "train",
                server.address,
                freeze="layer4",
                image_size=64,
                batch_size=4,
                mode=mode,
                chunk_size=5,
            )
            for mode in ("local", "pushdown")
        }
        for job in jobs.values():
            job.fit(1, lr=0.05)
        stats = server.stats()
    torch.testing.assert_close(
        torch.tensor(jobs["pushdown"].history.losses),
        torch.tensor(jobs["local"].history.losses),
        rtol=1e-4,
        atol=1e-4,
    )
    local, push = (jobs[m].history.epochs[0] for m in ("local", "pushdown"))
    assert local.samples == push.samples == 12
    assert stats["bytes_sent"] == local.bytes_received + push.bytes_received


def test_a_bucket_without_images_is_a_clear_error(s3_bucket: tuple[str, StoreOptions]) -> None:
    uri, options = s3_bucket
    open_store(uri, options).put("train/README.txt", b"no images here")
    with (
        serve(ServerConfig(store=uri, store_options=options)) as server,
        pytest.raises(ObjectNotFound, match="ImageFolder layout"),
    ):
        TransferJob("resnet18", "train", server.address, freeze="layer4").fit(1)
