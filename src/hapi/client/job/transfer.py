"""`TransferJob`: fine-tune the last layers of a model on data in an object store. A
facade over its parts - model, data, plan in force, loops (`docs/architecture.md`, "The
job") - each built from its part of the `JobConfig`."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Unpack

import torch
from torch import nn

from hapi._gc import freeze_long_lived
from hapi.cache import Cacheability
from hapi.client.config.job import JobConfig, JobOptions
from hapi.client.job._data import JobData, connect_all
from hapi.client.job._loops import EvalResult, JobLoops, OptimizerFactory, Progress
from hapi.client.job._model import JobModel
from hapi.client.job._plan import describe, job_plans
from hapi.client.job.server_warmup import server_warmed, warmup_request
from hapi.client.pipeline.distributed import DataParallel
from hapi.client.pipeline.history import EpochStats, History
from hapi.client.servers.connection import Connection
from hapi.data import DatasetManifest
from hapi.graph import INPUT, RAW, CutLike, ModelGraph, ModelSpec
from hapi.plan import Plan

if TYPE_CHECKING:
    from hapi.repo import ModelRepo, ModelVersion, PushedVersion

__all__ = ["EpochStats", "EvalResult", "History", "TransferJob"]


class TransferJob:
    """Fine-tunes a model's last layers, with its frozen front computed near the data.

    The plan - where the model is cut, and which share of the chunks the trainer computes
    itself from raw bytes - is chosen from measurements of the server, the link and the
    trainer (`cut="auto"`, the default; `job.plan` says what and why) and re-chosen while
    training when the measured rates drift. An explicit `cut` (and `local_share`) fixes
    it; `mode="local"` is the baseline, where the server only sends the objects' bytes.
    Every plan gives the same samples in the same batches, so they train the same model:
    equal to fp32 tolerance (the server's head runs at other batch sizes than the
    trainer's), or bit for bit with `exact=True`.

    The model is a name (`resnet18`, `timm:NAME`, `hf:ViTConfig`), a `ModelSpec`, a
    repository reference, or a module of your own with your weights. A module's frozen
    head runs on the server as a torch.export program the job exports and uploads (the
    server never runs your Python): the head up to the cut must be exportable at the
    input shape (no Python branch on tensor values, no data-dependent shapes, ATen
    operators only). The job checks this when it is built.

    Example:
        >>> job = TransferJob(model="resnet18", dataset="train", server=server.address,
        ...                   image_size=112)
        >>> print(job.plan.explain())
        >>> job.fit(epochs=2)
        >>> job.evaluate().accuracy

    Raises:
        InvalidRequest: a bad option, or a module whose head cannot be exported (naming
            the line of its code that cannot be).
        InvalidCut: a cut past the freeze point, or a freeze that leaves nothing to train.
    """

    def __init__(
        self,
        model: ModelSpec | str | dict[str, Any] | nn.Module,
        dataset: str,
        server: str | Connection | Sequence[str],
        **options: Unpack[JobOptions],
    ) -> None:
        address = server.address if isinstance(server, Connection) else server
        self._start(JobConfig.from_options(model, dataset, address, **options), server)

    @classmethod
    def from_config(cls, config: JobConfig) -> TransferJob:
        """The job `config` describes (built nested, or by `JobConfig.from_options`)."""
        job = cls.__new__(cls)
        job._start(config, config.server)
        return job

    def _start(self, config: JobConfig, server: str | Connection | Sequence[str]) -> None:
        """Connect, build the model, the data and the plan of the job `config` describes."""
        freeze_long_lived()  # the imports are done: torch's objects are the process's
        self.config = config
        """The job's options, one part per concern (`JobConfig`)."""
        self.connections = connect_all(config, server)
        """One connection per server, in the order given (connected on first use)."""
        self.connection = self.connections[0]
        """The first server's: it lists datasets and is measured for the plan."""
        dp = DataParallel.start(config.training.device, config.training.distributed)
        with server_warmed(self.connection, warmup_request(config)):
            self._model = parts = JobModel(config, dp)
        self.repo: ModelRepo | None = parts.repo
        """The model repository (`repo=`), if the job has one."""
        self.model: nn.Module = parts.model
        """The model being fine-tuned (its tail trains in place)."""
        self.spec: ModelSpec | None = parts.spec
        """The model's spec; None for a module of the user's own."""
        self.base: ModelVersion | None = parts.base
        """The repository version the job started from, when it did."""
        self.graph: ModelGraph = parts.graph
        """The model, traced into its cut points."""
        self.freeze, self.freeze_reason = parts.freeze, parts.freeze_reason
        """The last frozen cut point, and why (the job's summary says it)."""
        self.device: torch.device = parts.device
        """Where the tail trains."""
        self.history = History()
        record = self.history.events.append
        self._data = data = JobData(config, self.connections, parts, record=record)
        progress = Progress()
        self._plans = job_plans(config, parts, data, record, lambda: progress.next_epoch)
        """The plan in force, fixed or measured, and who may change it."""
        self._loops = JobLoops(config, parts, data, self._plans, self.history, progress)
        if config.planning.mode != "local":
            fixed = self._plans.fixed
            parts.check_exportable(fixed[0] if fixed is not None else self.freeze)

    @property
    def trainable_parameters(self) -> list[nn.Parameter]:
        """The parameters `fit` trains: those after the freeze point that are not frozen."""
        return self._model.parts.trainable()

    @property
    def tail(self) -> nn.Module:
        """The module the trainer runs on features at the plan's cut."""
        return self._model.parts.tail(max(self.cut, INPUT))

    @property
    def rank(self) -> int:
        """This process's rank among data-parallel trainers (0 when training alone)."""
        return self._loops.rank

    @property
    def world_size(self) -> int:
        """The number of data-parallel trainers (1 when training alone)."""
        return self._loops.world_size

    @property
    def plan(self) -> Plan | None:
        """The plan in force with every option weighed (`.explain()`), for `cut="auto"`.

        Measured and chosen on first use (here or in `fit`), which takes a few seconds
        and reads a few objects; None when the cut was given (or `mode="local"`), and
        while `fit` trains on the default plan because no server could be measured yet
        (the `plan-deferred` event).

        Raises:
            ServerUnavailable, StoreUnavailable: no server could be measured within
                `retry_budget_s`.
        """
        return self._plans.plan

    @property
    def cut(self) -> int:
        """Where pushed-down chunks are cut now (RAW: the trainer decodes raw bytes)."""
        return self._plans.in_force()[0]

    @property
    def local_share(self) -> float:
        """The share of chunks the trainer computes from raw bytes (1 for RAW)."""
        cut, share = self._plans.in_force()
        return 1.0 if cut == RAW else share

    @property
    def raw(self) -> bool:
        """Whether every chunk travels as raw bytes (the baseline)."""
        return self.cut == RAW

    def set_plan(
        self, cut: CutLike, share: float = 0.0, *, reason: str = "set by the user"
    ) -> None:
        """Use (`cut`, `share`) for the chunks not yet issued: mid-epoch (from a progress
        callback) or for the next `fit`. Every key is still delivered once per epoch.

        Raises:
            InvalidCut: a cut past the freeze point.
            InvalidRequest: a share outside [0, 1], or a share with RAW.
        """
        self._plans.set(self._model.resolve_cut(cut), share, reason=reason)

    def summary(self) -> str:
        """What the job trains and how its data travels, in a few lines."""
        return describe(self.config, self._model, self._plans, self.cacheability())

    def cacheability(self) -> Cacheability:
        """Whether the training features repeat between epochs (and are cached), and why."""
        return self._data.cacheability()

    def fit(
        self,
        epochs: int = 1,
        optimizer: torch.optim.Optimizer | OptimizerFactory | None = None,
        *,
        lr: float = 0.01,
        progress: Callable[[int, int], None] | None = None,
        resume_from: Mapping[str, Any] | str | os.PathLike[str] | None = None,
    ) -> History:
        """Train the tail for `epochs` epochs.

        Under torchrun every rank calls it: each trains its shard of every epoch, DDP
        averages the gradients, and the history holds the global losses (see
        `hapi.client.pipeline.distributed`).

        Args:
            epochs: epochs to run (continuing from earlier `fit` calls); with
                `resume_from`, the epoch the state stopped in counts as one.
            optimizer: an optimizer over `trainable_parameters`, a factory taking them,
                or None for SGD with momentum 0.9 at `lr`.
            lr: learning rate of the default optimizer.
            progress: called with (batches done, batches per epoch) after each step.
            resume_from: a `state_dict()`, or the path `save_state` wrote: go on from
                there, mid-epoch included, training no key twice. Without it, an epoch
                a failure cut short starts again.

        Returns:
            The job's history, with this call's epochs and events appended.

        Raises:
            NothingToTrain: every parameter is frozen.
            HapiError: a chunk failed for good (`CorruptObject` naming the key, or
                `ServerUnavailable` past the retry budget), or the epoch lost keys.
        """
        return self._loops.fit(epochs, optimizer, lr=lr, progress=progress, resume_from=resume_from)

    def state_dict(self) -> dict[str, Any]:
        """What `fit(resume_from=...)` needs to go on as if never stopped.

        The tail's parameters and buffers (batch norm statistics), the optimizer's state,
        the epoch and how far into its order training got, the plan in force, the
        per-step losses and the random states (torch, numpy, Python). Taken after a
        step (from a `progress` callback, or after `fit` raised), a resumed job trains
        the same batches as one never stopped. The frozen head is not in it: it is the
        model the job was built from.
        """
        return self._loops.state_dict()

    def save_state(self, path: str | os.PathLike[str]) -> None:
        """Write `state_dict()` to `path` with `torch.save` (read back weights-only)."""
        torch.save(self.state_dict(), path)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take up a `state_dict()`: the next `fit(resume_from=...)`, or a `fit` right
        after this, goes on from it (the optimizer's state applies to `fit`'s optimizer).

        Raises:
            InvalidRequest: a state of another job (dataset, seed, batch size or freeze
                point differ, so its epoch order or tail would not be this job's), or of
                another rank or number of ranks (each rank saves its own: its shard and
                random states are its own).
        """
        self._loops.load_state(state)

    def evaluate(
        self, dataset: str | None = None, *, progress: Callable[[int, int], None] | None = None
    ) -> EvalResult:
        """Accuracy of the model on `dataset` (default: the job's eval or training set).

        Data-parallel, every rank calls it: each evaluates its shard, and the result is
        the whole set's on every rank.
        """
        return self._loops.evaluate(dataset, progress)

    def batches_per_epoch(self) -> int:
        """Training batches (steps) in one epoch of the training set, on each rank."""
        return self._loops.steps_per_epoch()

    def manifest(self, prefix: str) -> DatasetManifest:
        """The dataset under `prefix`, listed once by a server (or from the store itself,
        `FetchConfig.store`, while none answers), retried within `retry_budget_s`.

        Raises:
            ServerUnavailable, StoreUnavailable: no listing within the retry budget.
        """
        return self._data.manifest(prefix)

    def push(
        self,
        name: str,
        *,
        parent: str | ModelVersion | None = None,
        tags: Sequence[str] = (),
        metrics: Mapping[str, float] | None = None,
    ) -> PushedVersion:
        """Store the fine-tuned model in the job's repository as the next version of `name`.

        Only what fine-tuning changed is uploaded: the frozen layers' tensors are the
        base's, stored once. The version records the job's spec, so a server can load its
        head, and the job's last training and evaluation figures as metrics.

        Args:
            name: the model name.
            parent: the version it derives from; default: the version the job started
                from (a `repo://` model), else none.
            tags: labels to keep with it.
            metrics: numbers to keep with it; default: the last epoch's loss and accuracy.

        Raises:
            InvalidRequest: the job has no repository (pass `repo=` to the job).
        """
        if metrics is None and self.history.epochs:
            last = self.history.epochs[-1]
            metrics = {"train_loss": last.loss, "train_accuracy": last.accuracy}
        return self._model.push(name, parent=parent, tags=tags, metrics=metrics)
