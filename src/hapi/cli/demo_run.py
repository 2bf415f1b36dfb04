"""What `hapi demo` runs: the baseline and pushdown, side by side, through one emulated link.

It makes a synthetic labelled image set in a temporary local store, starts a server on
loopback whose egress is shaped to a storage link, and fine-tunes EfficientNet-Lite0
(real ImageNet weights, shipped in a package) twice: once as the baseline, which fetches
the images' bytes and runs everything in the trainer, and once with pushdown, which gets
the frozen layers' features. Same samples, same order, same seed: the same model trains.
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from hapi.client import EpochStats, EvalResult, TransferJob
from hapi.data import Transforms, open_store, synth_dataset
from hapi.errors import InvalidRequest
from hapi.graph import ModelSpec, build_model, trace
from hapi.server import ServerConfig, serve
from hapi.server.shaping import parse_rate
from hapi.wire import check_wire_dtype

__all__ = ["DemoConfig", "DemoRun", "run_demo"]


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """What the demo runs."""

    model: str = "efficientnet_lite0"
    """A model `build_model` knows; the demo loads its ImageNet weights."""
    weights: str | None = "imagenet"
    """Pre-trained weights of `model`."""
    classes: int = 4
    """Classes in the synthetic dataset."""
    train_per_class: int = 48
    """Training images per class."""
    val_per_class: int = 16
    """Evaluation images per class."""
    stored_size: int = 320
    """Side of the stored JPEGs (photos are stored larger than the model's input)."""
    image_size: int = 112
    """The model's input side."""
    epochs: int = 2
    """Training epochs per run."""
    link: str = "50mbit"
    """The emulated storage link between server and trainer."""
    batch_size: int = 32
    """Training batch size."""
    wire_dtype: str = "fp16"
    """Dtype of pushed-down features on the wire."""
    seed: int = 0
    """Seeds the data, the epoch order and the training."""
    lr: float = 0.02
    """Learning rate of the classifier (SGD with momentum)."""

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.classes < 2:
            raise InvalidRequest(
                f"the demo needs at least 1 epoch and 2 classes, got epochs={self.epochs}, "
                f"classes={self.classes}"
            )
        parse_rate(self.link)  # refuse a bad link before minutes of writing images


@dataclass(frozen=True)
class DemoRun:
    """One mode's result."""

    mode: str
    cut: int
    cut_name: str
    epochs: list[EpochStats]
    evaluation: EvalResult

    @property
    def bytes_per_epoch(self) -> float:
        return sum(e.bytes_received for e in self.epochs) / len(self.epochs)

    @property
    def seconds_per_epoch(self) -> float:
        return sum(e.seconds for e in self.epochs) / len(self.epochs)


Progress = Callable[[str, int, int], None]


def run_demo(config: DemoConfig | None = None, progress: Progress | None = None) -> list[DemoRun]:
    """Run the baseline and pushdown; return their results, baseline first.

    Args:
        config: what to run; the defaults finish in a few minutes on two CPU cores.
        progress: called with (phase, done, total) as work advances.
    """
    config = config or DemoConfig()
    report = progress or (lambda phase, done, total: None)
    with tempfile.TemporaryDirectory(prefix="hapi-demo-") as root:
        store = open_store(root)
        for prefix, per_class, seed in (
            ("train", config.train_per_class, config.seed),
            ("val", config.val_per_class, config.seed + 1),
        ):
            total = per_class * config.classes
            synth_dataset(
                store,
                prefix,
                classes=config.classes,
                per_class=per_class,
                size=config.stored_size,
                seed=seed,
                progress=functools.partial(_count, report, f"writing {prefix} images", total),
            )
        with serve(ServerConfig(store=root, egress_limit=config.link)) as server:
            return [_run(config, server.address, mode, report) for mode in ("local", "pushdown")]


def _count(report: Progress, phase: str, total: int, done: int) -> None:
    report(phase, done, total)


def _run(
    config: DemoConfig, address: str, mode: Literal["local", "pushdown"], report: Progress
) -> DemoRun:
    spec = ModelSpec(
        name=config.model, weights=config.weights, num_classes=config.classes, seed=config.seed
    )
    # Freeze everything before the classifier (the last cut point): a linear probe.
    freeze = trace(build_model(spec), (3, config.image_size, config.image_size)).num_cuts - 1
    job = TransferJob(
        spec,
        "train",
        address,
        eval_dataset="val",
        mode=mode,
        freeze=freeze,
        # The demo shows the two ends side by side: the objects' bytes, and the frozen
        # front's features. The planner (`cut="auto"`, `hapi plan`) would pick the
        # faster of every option for this link, which at a fast link can be the input.
        cut=None if mode == "pushdown" else "auto",
        image_size=config.image_size,
        transforms=Transforms.train(config.image_size),
        batch_size=config.batch_size,
        wire_dtype=check_wire_dtype(config.wire_dtype),
        seed=config.seed,
    )
    label = "baseline" if mode == "local" else "pushdown"
    optimizer = torch.optim.SGD(job.trainable_parameters, lr=config.lr, momentum=0.9)
    for epoch in range(config.epochs):
        job.fit(1, optimizer, progress=functools.partial(report, f"{label} epoch {epoch + 1}"))
    evaluation = job.evaluate(progress=functools.partial(report, f"{label} evaluate"))
    cut_name = job.graph.cut_points[job.cut - 1].name if job.cut > 0 else "input"
    return DemoRun(label, job.cut, cut_name, list(job.history.epochs), evaluation)
