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
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
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
    """A fine-tune from the command line: what to train and where, how long, and the job's
    options (`job`, `JobConfig`'s flat keywords). Field names are the TOML keys (`-` or
    `_`); a job file may also give the job's options as `[part]` tables."""

    model: str
    """A zoo name (`resnet18`, `efficientnet_lite0`, `timm:NAME`) or a repository
    reference (`repo://name`, `name@3`; needs `repo`)."""
    dataset: str
    """The training set's prefix in the server's store."""
    server: str
    """The `hapi serve` beside the data (`grpc://host:port`; several comma-separated)."""
    epochs: int = 3
    """Epochs to train."""
    lr: float = 0.01
    """Learning rate (SGD with momentum 0.9)."""
    weights: str | None = None
    """`imagenet` for a zoo model's pre-trained weights (efficientnet_lite0 ships them)."""
    out: str | None = None
    """Write the fine-tuned model here (`.safetensors`)."""
    push: str | None = None
    """Push the fine-tuned model to `repo` under this name."""
    repo: str | None = None
    """The model repository's URI (for `push` and `repo://` models)."""
    endpoint: str | None = None
    """The repository store's endpoint (S3, GCS or Azure); default: the cloud's variable."""
    plot: str | None = None
    """Write a picture of the run here (PNG, `History.plot`): per epoch, its time, where its
    samples came from, its bytes and the cut in force."""
    job: Mapping[str, Any] = field(default_factory=dict)
    """The job's options by flat keyword (`cut`, `cache_dir`: `hapi.client.config.flags`);
    unset ones keep `JobConfig`'s defaults."""

    def __post_init__(self) -> None:
        for name in ("model", "dataset", "server"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise InvalidRequest(f"{name} must be a non-empty string, got {value!r}")
        if isinstance(self.epochs, bool) or not isinstance(self.epochs, int) or self.epochs < 1:
            raise InvalidRequest(f"epochs must be an integer >= 1, got {self.epochs!r}")
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
        from hapi.client.config.flags import nested_options

        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise InvalidRequest(f"cannot read job file {path}: {exc.strerror}") from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise InvalidRequest(f"job file {path} is not valid TOML: {exc}") from None
        settings = {str(k).replace("-", "_"): v for k, v in data.items()}
        tables = {k: settings.pop(k) for k in list(settings) if isinstance(settings[k], dict)}
        settings.update(nested_options(tables, f"job file {path}"))
        return cls.from_options(**{**settings, **overrides}, source=f"job file {path}")

    @classmethod
    def from_options(cls, *, source: str = "the command line", **options: Any) -> TrainConfig:
        """Build from options - this config's fields and the job's flat keywords - naming
        the first required one missing (and where).

        Raises:
            InvalidRequest: `model`, `dataset` or `server` is missing, an option is none of
                either, or a value is bad.
        """
        from hapi.client.config.flags import job_flags

        own = {f.name for f in fields(cls)} - {"job"}
        flags = {f.name for f in job_flags()}
        unknown = sorted(set(options) - own - flags)
        if unknown:
            raise InvalidRequest(
                f"{source} has unknown key(s) {', '.join(unknown)}: the keys are "
                f"{', '.join(sorted(own | flags))}"
            )
        for name in ("model", "dataset", "server"):
            if options.get(name) is None:
                flag = "MODEL" if name == "model" else f"--{name}"
                raise InvalidRequest(
                    f"no {name} given in {source}: pass {flag}, or set `{name} = ...` in "
                    "a --config file"
                )
        job = {k: v for k, v in options.items() if k in flags and k not in own}
        return cls(**{k: v for k, v in options.items() if k in own}, job=job)


@dataclass(frozen=True)
class TrainResult:
    """What one `run_train` did."""

    epochs: list[EpochStats]
    evaluation: EvalResult | None
    seconds: float
    out: str | None
    pushed: str | None
    """The pushed version's reference (`name@N`), when pushed."""
    plot: str | None = None
    """The run's picture, when written."""


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
    from hapi.client import TrainingConfig, TransferJob

    model: Any = config.model
    if not _is_repo_ref(model):
        seed = config.job.get("seed", TrainingConfig().seed)  # the job's seed seeds the model
        model = {"name": model, "weights": config.weights, "seed": seed}
    servers = [s.strip() for s in config.server.split(",") if s.strip()]
    job = TransferJob(
        model,
        config.dataset,
        servers,
        **config.job,
        repo=config.repo,
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
    if config.job.get("eval_dataset") is not None:
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
        plot=str(job.history.plot(config.plot, title=job.summary().splitlines()[0]))
        if config.plot is not None
        else None,
    )


def _save(job: TransferJob, path: Path) -> None:
    """Write the model's weights (and its spec, to rebuild it) as safetensors, atomically."""
    from safetensors.torch import save_model

    metadata = {SPEC_KEY: json.dumps(job.spec.to_dict())} if job.spec is not None else {}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    # save_model drops tensors the model shares (tied weights), which save_file refuses.
    save_model(job.model.to("cpu"), str(partial), metadata=metadata)
    os.replace(partial, path)


def _is_repo_ref(model: str) -> bool:
    from hapi.repo.storage.refs import is_repo_ref

    return is_repo_ref(model)
