"""The formats benchmark's job delivery: what a `TransferJob` hands its training loop.

A job at cut INPUT gets decoded, transformed images (`Transforms.eval(64)`, as the peer
makes them), each chunk decoded where the plan says: by the server, on the core beside
the data, or - a fixed `local_share` of the chunks - by the trainer from RAW bytes. The
batches come from the loader the job's own `fit` iterates (`job._loops.loop`: the
library has no public way to iterate a job's inputs without training on them, and a
tail training on them would time the model, not the delivery). The peer's figure is its
second epoch of two (its workers started before it); so is this: the job is built, its
sessions opened and its first epoch run before the epoch that is timed.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

SHARE_NOTE = (
    "the share of chunks decoded in the trainer that balances the two cores: the "
    "trainer's rate decoding RAW (`RAW + trainer decodes`) over the sum of it and the "
    "server's at INPUT, both measured in the run's first repeat"
)


def job_epoch(server: Any, dataset: str, share: float, args: argparse.Namespace) -> float:
    """Samples/s of a job's second epoch over `dataset` at cut INPUT, `share` of its
    chunks decoded in this process (the trainer) and the rest by the server.

    Raises:
        RuntimeError: an epoch handed on other than every sample, or other inputs.
    """
    import torch

    from hapi import TransferJob
    from hapi.data import Transforms
    from hapi.graph import INPUT, ModelSpec

    torch.set_num_threads(1)  # the trainer's one core, as the peer's DataLoader has
    job = TransferJob(
        ModelSpec(name="resnet18", num_classes=4),
        dataset,
        server=server.address,
        image_size=64,
        transforms=Transforms.eval(64),
        cut=INPUT,
        local_share=share,
        replan=False,
        cache=False,
        batch_size=64,
        chunk_size=args.chunk_size,
        prefetch=args.prefetch,
        seed=1,
    )
    config = job.config
    try:
        with job._loops.loop(config.dataset, config.train_transforms, train=True) as loader:
            for epoch in range(2):
                samples = 0
                t0 = time.perf_counter()
                for batch in loader.batches(epoch):
                    if tuple(batch.features.shape[1:]) != (3, 64, 64):
                        raise RuntimeError(f"the job made {tuple(batch.features.shape)} inputs")
                    samples += len(batch)
                seconds = time.perf_counter() - t0
    finally:
        for connection in job.connections:
            connection.close()
    if samples != args.images:
        raise RuntimeError(f"the job's epoch handed on {samples} of {args.images} samples")
    return samples / seconds


def balanced_share(trainer_rate: float, server_rate: float) -> float:
    """The share of chunks for the trainer that keeps both cores busy (`SHARE_NOTE`),
    rounded to a twentieth."""
    return round(20 * trainer_rate / (trainer_rate + server_rate)) / 20
