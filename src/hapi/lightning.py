"""hapi in PyTorch Lightning: `HapiDataModule` gives a `Trainer` a job's features.

    dm = HapiDataModule("resnet18", "train", "grpc://127.0.0.1:8815", image_size=112)
    Trainer(max_epochs=2).fit(MyModule(dm.tail()), datamodule=dm)

The train loader's position goes into Lightning's checkpoints, counted as batches are
trained (Lightning fetches one ahead); each rank of `strategy="ddp"` reads its own share;
each epoch's figures go to the Trainer's logger as `hapi/...`. See `docs/frameworks.md`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from torch import nn

from hapi._extras import framework
from hapi.client import (
    FeatureBatch,
    FeatureDataLoader,
    FeatureDataset,
    JobConfig,
    TransferJob,
)
from hapi.client.config.job import JobOptions
from hapi.client.job.features import merge_figures
from hapi.client.pipeline.history import EpochStats
from hapi.graph import ModelSpec

__all__ = ["HapiDataModule", "epoch_metrics"]

MINIMUM = (2, 2)
"""Lightning saves stateful dataloaders in its checkpoints from 2.2 on."""


def _lightning() -> Any:
    """`lightning.pytorch`, or an error that names the fix."""
    framework(
        "lightning", minimum=MINIMUM, user="hapi.lightning", extra="lightning",
        why=" (it saves stateful dataloaders)",
    )  # fmt: skip
    import lightning.pytorch as pl

    return pl


def epoch_metrics(figures: EpochStats) -> dict[str, float]:
    """An epoch's figures as `hapi/...` metrics for a logger."""
    return {
        "hapi/bytes_received": float(figures.bytes_received),
        "hapi/samples_computed": float(figures.computed),
        "hapi/samples_cached": float(figures.cached + figures.server_cached),
        "hapi/cut": float(figures.cut if figures.cut is not None else -1),
        "hapi/local_share": figures.share,
        "hapi/server_s": figures.server_s,
        "hapi/link_s": figures.transfer_s,
        "hapi/trainer_s": figures.trainer_s,
        "hapi/epoch_s": figures.seconds,
    }


class HapiDataModule(_lightning().LightningDataModule):  # type: ignore[misc]
    """Train and validation dataloaders of a job's features, for a Lightning `Trainer`.

    Args:
        model, dataset, server: as `TransferJob`'s.
        num_workers: `DataLoader` workers per rank (each reads its share).
        options: the job's options (`image_size`, `freeze`, `batch_size`, `cache`,
            `cut`...). `eval_dataset` gives a validation loader. Lightning runs the
            data parallelism, so the job's own `distributed` is off.
    """

    def __init__(
        self,
        model: ModelSpec | str | dict[str, Any] | nn.Module,
        dataset: str,
        server: str | Sequence[str],
        *,
        num_workers: int = 0,
        **options: Any,
    ) -> None:
        super().__init__()
        options.pop("distributed", None)
        self.config = JobConfig.from_options(model, dataset, server, **_options(options))
        self.num_workers = num_workers
        self._job: TransferJob | None = None
        self._train: FeatureDataLoader | None = None
        self._shares: list[EpochStats] = []

    @property
    def job(self) -> TransferJob:
        """The job, built on first use in this process (a rank builds its own)."""
        if self._job is None:
            training = dataclasses.replace(self.config.training, distributed=False)
            self._job = TransferJob.from_config(dataclasses.replace(self.config, training=training))
        return self._job

    def tail(self) -> nn.Module:
        """The module to train: the model after the freeze point, with its weights."""
        return FeatureDataset(self.job).tail()

    def setup(self, stage: str) -> None:
        self.job  # noqa: B018 - connect, build and plan before the loops start

    def train_dataloader(self) -> FeatureDataLoader:
        self._train = FeatureDataLoader(
            FeatureDataset(self.job), num_workers=self.num_workers, count="marked"
        )
        return self._train

    def val_dataloader(self) -> FeatureDataLoader | list[FeatureDataLoader]:
        if self.config.data.eval_dataset is None:
            return []
        return FeatureDataLoader(FeatureDataset(self.job, "eval"), num_workers=self.num_workers)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Lightning calls it as it takes a batch to train: the position counts it here,
        not when fetched one ahead; a worker's last batch brings its share's figures."""
        if isinstance(batch, FeatureBatch) and batch.split == "train" and self._train is not None:
            self._train.mark(batch)
            if batch.figures is not None:
                self._shares.append(batch.figures)
                batch.figures = None  # kept here: Lightning moves no frozen dataclass
                if len(self._shares) == max(self.num_workers, 1):
                    self._log(merge_figures(self._shares))
                    self._shares = []
        return batch

    def _log(self, figures: EpochStats) -> None:
        trainer = self.trainer
        if trainer is not None and trainer.logger is not None:
            trainer.logger.log_metrics(epoch_metrics(figures), step=trainer.global_step)


def _options(options: dict[str, Any]) -> JobOptions:
    return options  # type: ignore[return-value]  # JobConfig.from_options checks each
