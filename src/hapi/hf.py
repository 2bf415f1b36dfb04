"""hapi in the Hugging Face `Trainer`: `HapiTrainer` trains a job's tail on its features.

    job = TransferJob({"name": "hf:ViTConfig", ...}, "train", server, image_size=224)
    HapiTrainer(job, TrainingArguments("out", num_train_epochs=2)).train()

Batches are dicts that match `HapiTail.forward` (`features`, `labels`); each rank reads
its own share (`dispatch_batches` must stay off), and the steps per epoch come from the
dataset's length, so no `max_steps` is needed. See `docs/frameworks.md`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from hapi._extras import framework
from hapi.client import FeatureDataLoader, FeatureDataset, TransferJob
from hapi.errors import InvalidRequest

__all__ = ["MINIMUM", "HapiTail", "HapiTrainer"]

MINIMUM = (4, 46)
"""The Trainer's `accelerator_config` and `set_epoch` on its loader, as used here."""


def _transformers() -> Any:
    """`transformers`, or an error that names the fix."""
    return framework("transformers", minimum=MINIMUM, user="hapi.hf", extra="hf")


class HapiTail(nn.Module):
    """A job's tail as the Trainer calls a model: `forward(features, labels)` returns the
    logits, and the mean cross-entropy as `loss` where labels are given."""

    def __init__(self, tail: nn.Module) -> None:
        super().__init__()
        self.tail = tail

    def forward(
        self, features: torch.Tensor, labels: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        out = self.tail(features)
        logits = out if isinstance(out, torch.Tensor) else out["logits"]  # a ModelOutput
        if labels is None:
            return {"logits": logits}
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


class _Dicts:
    """A `FeatureDataLoader` whose batches are the Trainer's dicts."""

    def __init__(self, loader: FeatureDataLoader) -> None:
        self.loader = loader
        self.dataset = loader.dataset
        self.skip = 0
        """Batches of the next epoch trained before a checkpoint: left out, not read."""

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for batch in self.loader:
            yield {"features": batch.features, "labels": batch.labels}

    def set_epoch(self, epoch: int) -> None:
        if self.skip:
            self.loader.resume(epoch, self.skip)
            self.skip = 0
        else:
            self.loader.set_epoch(epoch)


class HapiTrainer(_transformers().Trainer):  # type: ignore[misc]
    """A `transformers.Trainer` over `job`'s features, training its tail.

    Args:
        job: the job whose features train (its `eval_dataset`, if any, evaluates).
        args: the Trainer's arguments; `per_device_train_batch_size` is the job's
            `batch_size` (hapi makes the batches).
        model: the module to train on features at the freeze point; default
            `HapiTail(job's tail)`, with the job's weights.
        kwargs: the Trainer's other arguments (`optimizers`, `callbacks`...).

    Raises:
        InvalidRequest: `dispatch_batches` on, a `train_dataset` given, or a model that
            does not take the job's features as `forward(features, labels)`.
    """

    def __init__(
        self, job: TransferJob, args: Any, *, model: nn.Module | None = None, **kwargs: Any
    ) -> None:
        if args.accelerator_config.dispatch_batches:
            raise InvalidRequest(
                "dispatch_batches would have rank 0 read every batch and send them on: hapi "
                "gives each rank its own share; leave accelerator_config's dispatch_batches off"
            )
        if "train_dataset" in kwargs:
            raise InvalidRequest("HapiTrainer reads the job's dataset: pass no train_dataset")
        self.job = job
        features = FeatureDataset(job)
        evaluation = FeatureDataset(job, "eval") if job.config.data.eval_dataset else None
        model = model if model is not None else HapiTail(features.tail())
        _check_model(model, job.graph.cut_point(job.freeze).shape)
        super().__init__(
            model=model,
            args=args,
            train_dataset=features,
            eval_dataset=evaluation,
            **kwargs,
        )

    def get_train_dataloader(self) -> Any:
        return _Dicts(
            FeatureDataLoader(self.train_dataset, num_workers=self.args.dataloader_num_workers)
        )

    def get_resumed_dataloader(self, dataloader: Any, num_batches: int) -> Any:
        """Resume mid-epoch from the loader's position: the batches trained before the
        checkpoint are left out of the epoch's order, not fetched and thrown away."""
        if not isinstance(dataloader, _Dicts):
            return super().get_resumed_dataloader(dataloader, num_batches)
        dataloader.skip = num_batches
        return dataloader

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if not isinstance(dataset, FeatureDataset):
            return super().get_eval_dataloader(eval_dataset)
        return _Dicts(FeatureDataLoader(dataset, num_workers=self.args.dataloader_num_workers))

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        if not isinstance(test_dataset, FeatureDataset):
            return super().get_test_dataloader(test_dataset)
        return self.get_eval_dataloader(test_dataset)


def _check_model(model: nn.Module, shape: tuple[int, ...]) -> None:
    """Refuse a model that cannot train on the job's batches, before the Trainer starts."""
    try:
        with torch.no_grad():
            out = model(features=torch.zeros((1, *shape)), labels=torch.zeros(1, dtype=torch.long))
        out["loss"]
    except Exception as exc:  # any failure here is the model's mismatch, said once
        raise InvalidRequest(
            f"the model does not train on the job's features ({exc!r}): its forward takes "
            f"features of shape (batch, {', '.join(map(str, shape))}) at the freeze point and "
            "labels, and returns a 'loss'; wrap a tail of your own as HapiTail(tail)"
        ) from None
