"""The baseline's input pipeline: decode and transform raw bytes in the trainer."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from hapi.data import Transforms
from hapi.data.samples import Sample, load_samples
from hapi.errors import NotDecoded
from hapi.wire import FeatureBatch, OnError, SkippedKey

__all__ = ["RawDecoder"]


@dataclass(frozen=True)
class RawDecoder:
    """The local baseline's input pipeline: decode and transform raw bytes in the trainer.

    It runs the server's own sample pipeline (`hapi.data.samples.load_samples`), so a
    chunk decoded here gives the inputs a server would have computed.
    """

    transforms: Transforms
    seed: int
    on_error: OnError

    def __call__(self, batch: FeatureBatch, epoch: int) -> tuple[FeatureBatch, list[SkippedKey]]:
        """The batch's samples as model inputs, and the keys left out under `skip`.

        Raises:
            NotDecoded: the batch holds features, not raw bytes.
            HapiError: a corrupt object under `on_error="raise"`, naming the key.
        """
        if batch.data is None:
            raise NotDecoded("the raw decoder got a batch of features: it decodes RAW batches")
        samples: list[Sample] = []
        skipped: list[SkippedKey] = []
        for item in load_samples(
            batch.keys,
            batch.labels.tolist(),
            batch.data,
            self.transforms,
            seed=self.seed,
            epoch=epoch,
            skip=self.on_error == "skip",
            finish=False,  # converted and normalized together, as a server does
        ):
            if isinstance(item, Sample):
                samples.append(item)
            else:
                skipped.append(SkippedKey.of(item.key, item.error))
        prepared = [s.tensor for s in samples]
        features = self.transforms.finish(prepared) if prepared else torch.empty(0)
        decoded = dataclasses.replace(
            batch,
            keys=[s.key for s in samples],
            labels=torch.tensor([s.label for s in samples], dtype=torch.int64),
            features=features,
            data=None,
        )
        return decoded, skipped
