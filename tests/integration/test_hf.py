"""The Hugging Face Trainer trains a HF image model's tail on hapi's features, step for
step as `TransferJob.fit` does at the same seed."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import TrainerCallback, TrainingArguments

from hapi.client import TransferJob
from hapi.data import open_store, synth_dataset
from hapi.errors import InvalidRequest
from hapi.hf import HapiTrainer
from hapi.server import HapiServer, serve

BATCH = 4
LR = 0.05
SMALL_VIT = {
    "image_size": 32,
    "patch_size": 8,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
}
MODEL = {"name": "hf:ViTConfig", "config": SMALL_VIT, "num_classes": 2, "seed": 5}
OPTIONS: dict[str, Any] = {
    "image_size": 32,
    "batch_size": BATCH,
    "chunk_size": 3,
    "augment": False,
    "eval_dataset": "val",
    "wire_dtype": "fp32",
    "exact": True,  # features bit for bit: only the loops differ
    "seed": 2,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HapiServer]:
    root = tmp_path_factory.mktemp("store")
    store = open_store(root)
    synth_dataset(store, "train", classes=2, per_class=8, size=40, seed=3)
    synth_dataset(store, "val", classes=2, per_class=3, size=40, seed=4)
    with serve(store=str(root)) as running:
        yield running


class _Losses(TrainerCallback):  # type: ignore[misc]
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


def _args(out: Path, **more: Any) -> TrainingArguments:
    settings: dict[str, Any] = {
        "num_train_epochs": 2,
        "per_device_train_batch_size": BATCH,
        "learning_rate": LR,
        "lr_scheduler_type": "constant",
        "max_grad_norm": 0.0,  # TransferJob clips nothing
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "disable_tqdm": True,
    }
    return TrainingArguments(output_dir=str(out), **{**settings, **more})


def test_the_trainer_trains_the_tail_as_transfer_job_does(
    server: HapiServer, tmp_path: Path
) -> None:
    reference = TransferJob(MODEL, "train", server.address, **OPTIONS)
    reference.fit(2, lr=LR)

    job = TransferJob(MODEL, "train", server.address, **OPTIONS)
    losses = _Losses()
    trainer = HapiTrainer(job, _args(tmp_path), callbacks=[losses])
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    trainer.optimizer = torch.optim.SGD(params, lr=LR, momentum=0.9)  # fit's default
    trainer.train()
    # Every step's loss, as fit's (the Trainer logs them to 4 decimals); no max_steps given.
    assert trainer.state.max_steps == 2 * 16 // BATCH
    assert losses.losses == pytest.approx(reference.history.losses, abs=2e-4)
    assert len(job.history.epochs) == 2 and job.history.epochs[1].samples == 16
    # Evaluation reads the job's eval set the same way: the same predictions.
    predicted = trainer.predict(trainer.eval_dataset)
    right = (predicted.predictions.argmax(1) == predicted.label_ids).sum()
    assert len(predicted.label_ids) == 6
    assert right / 6 == reference.evaluate().accuracy


def test_dispatching_batches_and_an_old_transformers_are_named_with_the_fix(
    server: HapiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers

    from hapi import hf

    job = TransferJob(MODEL, "train", server.address, **OPTIONS)
    dispatching = _args(tmp_path, accelerator_config={"dispatch_batches": True})
    with pytest.raises(InvalidRequest, match="leave accelerator_config's dispatch_batches off"):
        HapiTrainer(job, dispatching)
    with pytest.raises(InvalidRequest, match=r"shape \(batch, 32\).*HapiTail\(tail\)"):
        HapiTrainer(job, _args(tmp_path), model=hf.HapiTail(torch.nn.Linear(16, 2)))
    monkeypatch.setattr(transformers, "__version__", "4.40.0")
    with pytest.raises(InvalidRequest, match=r"transformers >= 4.46, found 4.40.0"):
        hf._transformers()
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(InvalidRequest, match=r"pip install 'hapi\[hf\]'"):
        hf._transformers()


def test_a_checkpoint_taken_mid_epoch_resumes_from_the_loaders_position(
    server: HapiServer, tmp_path: Path
) -> None:
    def trainer(out: Path, **more: Any) -> tuple[HapiTrainer, _Losses]:
        job = TransferJob(MODEL, "train", server.address, **OPTIONS)
        losses = _Losses()
        made = HapiTrainer(job, _args(out, **more), callbacks=[losses])
        params = [p for p in made.model.parameters() if p.requires_grad]
        made.optimizer = torch.optim.SGD(params, lr=LR, momentum=0.9)
        return made, losses

    whole, whole_losses = trainer(tmp_path / "whole")
    whole.train()
    # Stopped after step 3 of epoch 1's 4, with a checkpoint there; resumed in a new one.
    first, _ = trainer(tmp_path / "cut", max_steps=3, save_strategy="steps", save_steps=3)
    first.train()
    again, again_losses = trainer(tmp_path / "cut")
    again.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-3"))
    # Steps 4-8 as the run never stopped: the rest of epoch 1 (not its first three
    # batches again, which the loader left out rather than read), then epoch 2.
    assert again_losses.losses == pytest.approx(whole_losses.losses[3:], abs=2e-4)
    assert again.job.history.epochs[0].samples == 4  # epoch 1's last batch only
