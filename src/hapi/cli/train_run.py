"""What `hapi train` runs: a `TransferJob` from a few options or a TOML file, its weights kept.

`TrainConfig` holds a job's options as a user writes them (on the command line or in a
`job.toml`); `run_train` builds the job, trains it epoch by epoch, evaluates it when given an
evaluation set, and writes the fine-tuned model to a safetensors file or pushes it to a
model repository. What it reports on the way goes to a `TrainHooks` object.
"""

from __future__ import annotations

import functools
import json
import os
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hapi.errors import InvalidRequest, shorten

if TYPE_CHECKING:
    from hapi.client import EpochStats, EvalResult, TransferJob

__all__ = ["NO_HOOKS", "TrainConfig", "TrainHooks", "TrainResult", "run_train"]

SPEC_KEY = "hapi.model_spec"
"""The safetensors metadata key holding the model's spec (JSON), to rebuild it for loading."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """A fine-tune from the command line. Field names are the TOML keys (`-` or `_`)."""

    model: str
    """A zoo name (`resnet18`, `efficientnet_lite0`, `timm:NAME`) or a repository
    reference (`repo://name`, `name@3`; needs `repo`)."""
    dataset: str
    """The training set's prefix in the server's store."""
    server: str
    """The `hapi serve` beside the data (`grpc://host:port`; several comma-separated)."""
    epochs: int = 3
    """Epochs to train."""
    freeze: str | int | None = None
    """Last frozen cut point (index or module name); default: all but the classifier."""
    cut: str | int | None = "auto"
    """`auto` (the planner chooses), a cut point, or `freeze` for the freeze point."""
    num_classes: int | None = None
    """Replace the classifier with one of this many classes."""
    weights: str | None = None
    """`imagenet` for a zoo model's pre-trained weights (efficientnet_lite0 ships them)."""
    image_size: int = 224
    """The model's input side."""
    batch_size: int = 32
    """Training batch size."""
    lr: float = 0.01
    """Learning rate (SGD with momentum 0.9)."""
    eval_dataset: str | None = None
    """An evaluation set's prefix: its accuracy ends the summary."""
    wire_dtype: str = "fp32"
    """Feature dtype on the wire: fp32, fp16, bf16, int8, fp8."""
    seed: int = 0
    """Seeds the classifier, the epoch order and the augmentations."""
    augment: bool = True
    """Random crop and flip every epoch; false trains on the eval transforms, whose
    features the trainer caches after epoch 1."""
    views: int | None = None
    """Draw each sample's augmentation from this many seeded views: cached from epoch K on."""
    cache: bool = True
    """Keep repeating features in the trainer's feature cache."""
    cache_dir: str | None = None
    """The trainer's feature cache; default `$HAPI_CACHE_DIR/features`."""
    token: str | None = None
    """The server's bearer token (best from HAPI_TOKEN)."""
    out: str | None = None
    """Write the fine-tuned model here (`.safetensors`)."""
    push: str | None = None
    """Push the fine-tuned model to `repo` under this name."""
    repo: str | None = None
    """The model repository's URI (for `push` and `repo://` models)."""
    endpoint: str | None = None
    """The repository store's endpoint (S3, GCS or Azure); default: the cloud's variable."""

    def __post_init__(self) -> None:
        for name in ("model", "dataset", "server"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise InvalidRequest(f"{name} must be a non-empty string, got {value!r}")
        for name, least in (("epochs", 1), ("image_size", 8), ("batch_size", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise InvalidRequest(f"{name} must be an integer >= {least}, got {value!r}")
        if isinstance(self.lr, bool) or not isinstance(self.lr, int | float) or self.lr <= 0:
            raise InvalidRequest(f"lr must be a positive number, got {self.lr!r}")
        if self.out is not None and not self.out.endswith(".safetensors"):
            raise InvalidRequest(
                f"out {shorten(repr(self.out))} must end in .safetensors: the model is "
                "written as safetensors"
            )
        if self.push is not None and self.repo is None:
            raise InvalidRequest(f"push {self.push!r} needs a repository: add --repo URI")
        if _is_repo_ref(self.model) and self.repo is None:
            raise InvalidRequest(
                f"model {self.model!r} is a repository reference: add --repo URI "
                "(or give a zoo name such as resnet18)"
            )

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str], **overrides: Any) -> TrainConfig:
        """Read a job file; `overrides` (the command line's options) win over it.

        Raises:
            InvalidRequest: the file is missing or not TOML, or has a key that is no option.
        """
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise InvalidRequest(f"cannot read job file {path}: {exc.strerror}") from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise InvalidRequest(f"job file {path} is not valid TOML: {exc}") from None
        settings = {str(k).replace("-", "_"): v for k, v in data.items()}
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(settings) - set(known))
        if unknown:
            raise InvalidRequest(
                f"job file {path} has unknown key(s) {', '.join(unknown)}: the keys are "
                f"{', '.join(known)}"
            )
        return cls.from_options(**{**settings, **overrides}, source=str(path))

    @classmethod
    def from_options(cls, *, source: str = "the command line", **options: Any) -> TrainConfig:
        """Build from options, naming the first required one missing (and where).

        Raises:
            InvalidRequest: `model`, `dataset` or `server` is missing, or a value is bad.
        """
        for name in ("model", "dataset", "server"):
            if options.get(name) is None:
                flag = "MODEL" if name == "model" else f"--{name}"
                raise InvalidRequest(
                    f"no {name} given in {source}: pass {flag}, or set `{name} = ...` in "
                    "a --config file"
                )
        return cls(**options)


@dataclass(frozen=True)
class TrainResult:
    """What one `run_train` did."""

    epochs: list[EpochStats]
    evaluation: EvalResult | None
    seconds: float
    out: str | None
    pushed: str | None
    """The pushed version's reference (`name@N`), when pushed."""


class TrainHooks:
    """What `run_train` reports as it goes; each method does nothing unless overridden."""

    def planned(self, job: TransferJob) -> None:
        """The job is built and its plan chosen (`job.summary()`, `job.plan`)."""

    def progress(self, phase: str, done: int, total: int) -> None:
        """A phase (`epoch 1`, `evaluate`) advanced to `done` of `total` batches."""

    def epoch(self, stats: EpochStats) -> None:
        """An epoch ended."""


NO_HOOKS = TrainHooks()


def run_train(config: TrainConfig, hooks: TrainHooks = NO_HOOKS) -> TrainResult:
    """Fine-tune `config.model` on `config.dataset` through `config.server`; keep the result.

    Raises:
        HapiError: a bad option, or a failure of the server, store or repository.
    """
    import time

    import torch

    from hapi.cli._stores import store_options
    from hapi.client import TransferJob

    model: Any = config.model
    if not _is_repo_ref(model):
        model = {"name": model, "weights": config.weights, "seed": config.seed}
    servers = [s.strip() for s in config.server.split(",") if s.strip()]
    job = TransferJob(
        model,
        config.dataset,
        servers,
        **_job_options(config),
        repo_store_options=store_options(config.endpoint),
    )
    start = time.perf_counter()
    hooks.planned(job)
    optimizer = torch.optim.SGD(job.trainable_parameters, lr=config.lr, momentum=0.9)
    for epoch in range(config.epochs):
        phase = f"epoch {epoch + 1}/{config.epochs}"
        job.fit(1, optimizer, progress=functools.partial(hooks.progress, phase))
        hooks.epoch(job.history.epochs[-1])
    evaluation = None
    if config.eval_dataset is not None:
        evaluation = job.evaluate(progress=functools.partial(hooks.progress, "evaluate"))
    if config.out is not None:
        _save(job, Path(config.out))
    pushed = job.push(config.push).ref if config.push is not None else None
    return TrainResult(
        epochs=list(job.history.epochs),
        evaluation=evaluation,
        seconds=time.perf_counter() - start,
        out=config.out,
        pushed=pushed,
    )


def _job_options(config: TrainConfig) -> dict[str, Any]:
    from hapi.graph import Cut

    return {
        "freeze": _int_or_name(config.freeze),
        "cut": Cut.of(config.cut),
        "num_classes": config.num_classes,
        "image_size": config.image_size,
        "batch_size": config.batch_size,
        "eval_dataset": config.eval_dataset,
        "wire_dtype": config.wire_dtype,
        "seed": config.seed,
        "augment": config.augment,
        "views": config.views,
        "cache": config.cache,
        "cache_dir": config.cache_dir,
        "token": config.token,
        "repo": config.repo,
    }


def _save(job: TransferJob, path: Path) -> None:
    """Write the model's weights (and its spec, to rebuild it) as safetensors, atomically."""
    from safetensors.torch import save_model

    metadata = {SPEC_KEY: json.dumps(job.spec.to_dict())} if job.spec is not None else {}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    # save_model drops tensors the model shares (tied weights), which save_file refuses.
    save_model(job.model.to("cpu"), str(partial), metadata=metadata)
    os.replace(partial, path)


def _int_or_name(value: str | int | None) -> str | int | None:
    # A cut point is an index or a module name; the command line gives both as text.
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    return value


def _is_repo_ref(model: str) -> bool:
    from hapi.repo.storage.refs import is_repo_ref

    return is_repo_ref(model)
