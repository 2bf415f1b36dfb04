"""What `hapi demo` runs: the baseline and hapi, side by side, through one emulated link.

It makes a synthetic labelled image set in a temporary local store, starts a server on
loopback whose egress is shaped to a storage link, and fine-tunes EfficientNet-Lite0
(real ImageNet weights, shipped in a package) twice: once as the baseline, which fetches
the images' bytes every epoch and runs everything in the trainer, and once as hapi runs a
job: the planner chooses the cut and share, and later epochs come from the trainer's
feature cache. Same samples, same order, same seed: the same model trains.
"""

from __future__ import annotations

import functools
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from hapi.client import EpochStats, EvalResult, History, TransferJob
from hapi.data import open_store, synth_dataset
from hapi.errors import InvalidRequest
from hapi.graph import INPUT, RAW, ModelSpec, build_model, trace
from hapi.plan import Plan
from hapi.server import ServerConfig, serve
from hapi.server.shaping import parse_rate
from hapi.wire import check_wire_dtype

__all__ = ["ACCURACY_TOLERANCE", "DemoConfig", "DemoRun", "run_demo"]

ACCURACY_TOLERANCE = 0.02
"""How far hapi's evaluation accuracy may lie from the baseline's. Both train the same
model on the same samples in the same order; only fp16 features round the classifier's
inputs, which can move an image across the decision boundary (fp32 agrees exactly)."""


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
    epochs: int = 3
    """Training epochs per run: epoch 1 computes every feature, the rest read the cache."""
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
    picture: str | None = "hapi-demo.png"
    """Where the picture of hapi's run is written; None writes none."""

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
    route: str
    """What crossed the link at the end: `raw bytes`, `cut 24 _dropout + 33% local`."""
    history: History
    evaluation: EvalResult
    whole_s: float
    """What the user waited for: building the job, planning, every epoch, evaluating."""
    plan: Plan | None = None
    """The planner's choice and the options it weighed (hapi's run only)."""
    picture: Path | None = None
    """The picture of the run, where one was written."""

    @property
    def epochs(self) -> list[EpochStats]:
        return self.history.epochs

    def moved(self, first: int, last: int) -> tuple[int, float]:
        """Bytes received and seconds taken by epochs `first` to `last` (from 1)."""
        epochs = self.epochs[first - 1 : last]
        return sum(e.bytes_received for e in epochs), sum(e.seconds for e in epochs)


Progress = Callable[[str, int, int], None]


def run_demo(config: DemoConfig | None = None, progress: Progress | None = None) -> list[DemoRun]:
    """Run the baseline and hapi; return their results, baseline first.

    Args:
        config: what to run; the defaults finish in about half a minute on two CPU cores.
        progress: called with (phase, done, total) as work advances.
    """
    config = config or DemoConfig()
    report = progress or (lambda phase, done, total: None)
    with tempfile.TemporaryDirectory(prefix="hapi-demo-") as root:
        store = open_store(f"{root}/store")
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
        with serve(ServerConfig(store=f"{root}/store", egress_limit=config.link)) as server:
            # The cache lives in the demo's own directory: a cache of an earlier demo
            # (the same seeded images) would serve its first epoch as well.
            return [
                _run(config, server.address, mode, f"{root}/cache", report)
                for mode in ("local", "pushdown")
            ]


def _count(report: Progress, phase: str, total: int, done: int) -> None:
    report(phase, done, total)


def _run(
    config: DemoConfig,
    address: str,
    mode: Literal["local", "pushdown"],
    cache_dir: str,
    report: Progress,
) -> DemoRun:
    spec = ModelSpec(
        name=config.model, weights=config.weights, num_classes=config.classes, seed=config.seed
    )
    # Freeze everything before the classifier (the last cut point): a linear probe.
    freeze = trace(build_model(spec), (3, config.image_size, config.image_size)).num_cuts - 1
    started = time.perf_counter()
    job = TransferJob(
        spec,
        "train",
        address,
        eval_dataset="val",
        mode=mode,
        freeze=freeze,
        # The baseline is what a loader over the store does: every epoch reads every
        # image's bytes. hapi's run lets the planner choose, and keeps what it received.
        cut="auto",
        augment=False,
        cache=mode == "pushdown",
        cache_dir=cache_dir,
        image_size=config.image_size,
        batch_size=config.batch_size,
        wire_dtype=check_wire_dtype(config.wire_dtype),
        seed=config.seed,
    )
    label = "baseline" if mode == "local" else "hapi"
    plan = job.plan if mode == "pushdown" else None
    optimizer = torch.optim.SGD(job.trainable_parameters, lr=config.lr, momentum=0.9)
    for epoch in range(config.epochs):
        job.fit(1, optimizer, progress=functools.partial(report, f"{label} epoch {epoch + 1}"))
    evaluation = job.evaluate(progress=functools.partial(report, f"{label} evaluate"))
    whole_s = time.perf_counter() - started
    picture = None
    if plan is not None and config.picture:
        picture = job.history.plot(config.picture, title=f"hapi demo, {config.link} link")
    last = job.history.epochs[-1]
    route = "raw bytes" if job.cut == RAW else _route(job, job.cut, last.share)
    return DemoRun(label, job.cut, route, job.history, evaluation, whole_s, plan, picture)


def _route(job: TransferJob, cut: int, share: float) -> str:
    name = "input" if cut == INPUT else f"cut {cut} {job.graph.cut_points[cut - 1].name}"
    return f"{name} + {share:.0%} local" if share else name
