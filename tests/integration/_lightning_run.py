"""A Lightning run over `HapiDataModule`, as a process of its own or one DDP rank:
`_lightning_run.py ADDRESS OUT_DIR DEVICES` (Lightning's "ddp" launches the other rank by
running this script again).

Phase 1 fits until `STOP_STEP` with a checkpoint every `EVERY` steps; phase 2 resumes from
the last checkpoint taken mid-epoch and fits to the end of epoch 2. Each rank writes the
keys it trained, by phase, epoch and step, to `OUT_DIR/rank<r>.json`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.nn import functional as F

from hapi.client import FeatureBatch
from hapi.lightning import HapiDataModule

BATCH = 4
EPOCHS = 2
OPTIONS: dict[str, Any] = {
    "freeze": "layer4",
    "cut": "layer3",
    "image_size": 32,
    "batch_size": BATCH,
    "chunk_size": 3,
    "augment": False,
    "eval_dataset": "val",
    "seed": 7,
}


class Probe(pl.LightningModule):
    """Trains the tail hapi hands over; records the keys of every batch it trains."""

    def __init__(self, tail: nn.Module) -> None:
        super().__init__()
        self.tail = tail
        self.trained: list[tuple[int, int, list[str]]] = []

    def training_step(self, batch: FeatureBatch, index: int) -> torch.Tensor:
        x, y = batch
        self.trained.append((self.current_epoch, self.global_step, list(batch.keys)))
        loss = F.cross_entropy(self.tail(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: FeatureBatch, index: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.tail(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit(
    address: str, out: Path, *, devices: int, stop_step: int, every: int, workers: int = 0
) -> dict[str, Any]:
    """Phase 1 to `stop_step`, then phase 2 from the last checkpoint: what this rank saw."""
    checkpoints = out / "checkpoints"
    seen: dict[str, Any] = {}
    for phase in (1, 2):
        data = HapiDataModule(
            {"name": "resnet18", "num_classes": 2},
            "train",
            address,
            num_workers=workers,
            **OPTIONS,
        )
        module = Probe(data.tail())
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=devices,
            strategy="ddp" if devices > 1 else "auto",
            max_epochs=EPOCHS,
            max_steps=stop_step if phase == 1 else -1,
            callbacks=[
                ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=every, save_top_k=-1)
            ],
            logger=CSVLogger(out, name=f"phase{phase}"),
            num_sanity_val_steps=0,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        resume = None
        if phase == 2:
            resume = str(checkpoints / f"epoch=1-step={stop_step - 1}.ckpt")
        trainer.fit(module, datamodule=data, ckpt_path=resume)
        seen[f"phase{phase}"] = module.trained
        seen["rank"] = trainer.global_rank
        seen["log_dir"] = trainer.logger.log_dir if trainer.logger else None
    return seen


if __name__ == "__main__":
    address, out, devices = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    stop, every = int(sys.argv[4]), int(sys.argv[5])
    seen = fit(address, out, devices=devices, stop_step=stop, every=every)
    (out / f"rank{seen['rank']}.json").write_text(json.dumps(seen))
