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
        stats = server.stats()
    torch.testing.assert_close(
        torch.tensor(jobs["pushdown"].history.losses),
        torch.tensor(jobs["local"].history.losses),
        rtol=1e-4,
        atol=1e-4,
    )
    local, push = (jobs[m].history.epochs[0] for m in ("local", "pushdown"))
    assert local.samples == push.samples == 12
    assert stats.bytes_sent == local.bytes_received + push.bytes_received


def test_a_bucket_without_images_is_a_clear_error(s3_bucket: tuple[str, StoreOptions]) -> None:
    uri, options = s3_bucket
    open_store(uri, options).put("train/README.txt", b"no images here")
    with (
        serve(ServerConfig(store=uri, store_options=options)) as server,
        pytest.raises(ObjectNotFound, match="ImageFolder layout"),
    ):
        TransferJob("resnet18", "train", server.address, freeze="layer4").fit(1)


def test_a_job_on_a_repository_in_seaweedfs_pushes_only_what_it_trained(
    s3_bucket: tuple[str, StoreOptions],
) -> None:
    from hapi.graph import ModelSpec, build_model
    from hapi.repo import ModelRepo

    bucket, options = s3_bucket
    data, models = f"{bucket}/data", f"{bucket}/models"
    synth_dataset(open_store(data, options), "train", classes=2, per_class=4, size=72, seed=6)
    repo = ModelRepo.open(models, options)
    spec = ModelSpec(name="resnet18", num_classes=2)
    base = repo.push(build_model(spec), "base", spec=spec)
    with serve(ServerConfig(store=data, store_options=options, repo=models)) as server:
        job = TransferJob(
            "repo://base",
            "train",
            server.address,
            repo=models,
            repo_store_options=options,
            freeze="layer4",
            cut=None,  # the freeze point: planning would profile (and cache) every cut
            image_size=64,
            batch_size=4,
        )
        job.fit(1, lr=0.05)
        assert server.stats().heads_cached == 1
    tuned = job.push("base-tuned")
    assert tuned.parent == base.id
    # Only the trained classifier went up; everything before it is the base's.
    assert tuned.uploaded_bytes < 0.01 * base.nbytes
    assert set(repo.diff("base", "base-tuned").changed) == {"fc.bias", "fc.weight"}
