"""The baseline's input pipeline: decode and transform raw bytes in the trainer."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from hapi.data import Transforms, load_sample, sample_seed
from hapi.errors import HapiError
from hapi.wire import FeatureBatch

__all__ = ["RawDecoder"]


@dataclass(frozen=True)
class RawDecoder:
    """The local baseline's input pipeline: decode and transform raw bytes in the trainer."""

    transforms: Transforms
    seed: int
    on_error: str

    def __call__(
        self, batch: FeatureBatch, epoch: int
    ) -> tuple[FeatureBatch, list[dict[str, str]]]:
        keys: list[str] = []
        labels: list[int] = []
        inputs: list[torch.Tensor] = []
        skipped: list[dict[str, str]] = []
        for key, label, data in zip(batch.keys, batch.labels.tolist(), _raw(batch), strict=True):
            try:
                inputs.append(
                    load_sample(data, key, self.transforms, sample_seed(self.seed, epoch, key))
                )
            except HapiError as exc:
                if self.on_error == "raise":
                    raise
                skipped.append({"key": key, "error": f"{type(exc).__name__}: {exc}"})
                continue
            keys.append(key)
            labels.append(label)
        features = torch.stack(inputs) if inputs else torch.empty(0)
        return dataclasses.replace(
            batch,
            keys=keys,
            labels=torch.tensor(labels, dtype=torch.int64),
            features=features,
            data=None,
        ), skipped


def _raw(batch: FeatureBatch) -> Iterator[bytes]:
    if batch.data is None:
        raise HapiError("expected a RAW batch of object bytes")
    return iter(batch.data)
