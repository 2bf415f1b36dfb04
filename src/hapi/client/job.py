"""`TransferJob`: fine-tune the last layers of a model on data in an object store.

A facade: the model side (`_job_model.JobModel`: build, trace, freeze, the step), the data
side (`_job_data.JobData`: servers, datasets, the trainer's feature cache, a loop's
loader), the plan in force (`plan_in_force.PlanInForce`) and the loops (`_job_loops`:
training, evaluation, resumable progress) each own their part.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Unpack

import torch
from torch import nn

from hapi.cache import Cacheability, cacheability
from hapi.client import _job_loops as loops
from hapi.client._job_data import JobData, connect_all
from hapi.client._job_loops import EvalResult, Progress
from hapi.client._job_model import JobModel
from hapi.client._job_plan import measure_plan
from hapi.client._resume import read_state
from hapi.client.connection import Connection
from hapi.client.distributed import DataParallel
from hapi.client.history import EpochStats, Event, History
from hapi.client.job_config import JobConfig, JobOptions
from hapi.client.plan_in_force import PlanInForce
from hapi.client.retry import RetryPolicy
from hapi.data import DatasetManifest
from hapi.errors import InvalidRequest, NothingToTrain
from hapi.graph import INPUT, RAW, ModelGraph, ModelSpec
from hapi.plan import Plan
from hapi.repo.refs import is_repo_ref

if TYPE_CHECKING:
    from hapi.repo import ModelRepo, ModelVersion, PushedVersion

__all__ = ["EpochStats", "EvalResult", "History", "TransferJob"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


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

    `server` may name several servers (one beside each node of a storage cluster): each
    chunk goes to one of them, by their measured rates and what each says is local to
    it, and a chunk whose server fails moves to the others (`history.failovers`).

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
        if isinstance(model, str) and not is_repo_ref(model):
            model = ModelSpec(name=model)
        elif isinstance(model, dict):
            model = ModelSpec.from_dict(model)
        address = server.address if isinstance(server, Connection) else server
        if not isinstance(address, str):
            address = tuple(address)
        self.config = config = JobConfig(model=model, dataset=dataset, server=address, **options)
        self.repo: ModelRepo | None = None
        if config.repo is not None:
            from hapi.repo import ModelRepo

            self.repo = ModelRepo.open(config.repo, config.repo_store_options)
        self.connections = connect_all(config, server)
        """One connection per server, in the order given (connected on first use)."""
        self.connection = self.connections[0]
        """The first server's: it lists datasets and is measured for the plan."""
        dp = DataParallel.start(config.device, config.distributed)
        self._model = parts = JobModel(model, config, self.repo, dp)
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
        self._progress = Progress()
        self._data = JobData(
            config, self.connections, self._model, record=self._record, on_reopen=self._reopened
        )
        self._plans = PlanInForce(
            fixed=self._fixed_plan(),
            default=(self.freeze, 0.0),
            connections=self.connections,
            measure=functools.partial(measure_plan, self),
            measure_aside=functools.partial(measure_plan, self, aside=True),
            retries=RetryPolicy(budget_s=config.retry_budget_s),
            record=self._record,
            shared=dp.from_rank0 if dp is not None else None,
            cached=lambda: self._data.all_cached(self._progress.next_epoch),
        )
        """The plan in force, fixed or measured, and who may change it."""
        if config.mode != "local":
            fixed = self._plans.fixed
            self._model.check_exportable(fixed[0] if fixed is not None else self.freeze)

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
        dp = self._model.dp
        return dp.rank if dp is not None else 0

    @property
    def world_size(self) -> int:
        """The number of data-parallel trainers (1 when training alone)."""
        dp = self._model.dp
        return dp.world if dp is not None else 1

    # The plan -------------------------------------------------------------------------------

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
        self, cut: int | str, share: float = 0.0, *, reason: str = "set by the user"
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
        trained = sum(p.numel() for p in self.trainable_parameters)
        lines = [f"{self._model.name}: {trained:,} parameters train", self.freeze_reason]
        if self.config.mode == "local":
            lines.append("mode=local: the baseline, raw bytes to the trainer")
        elif (fixed := self._plans.fixed) is not None:
            lines.append(f"cut {fixed[0]}, {fixed[1]:.0%} of chunks local, as given")
        else:
            plan = self.plan
            assert plan is not None  # an auto job has one
            lines.append(f"plan: {plan.reason}")
        lines.append(f"features {self.cacheability().why}")
        return "\n".join(lines)

    def cacheability(self) -> Cacheability:
        """Whether the training features repeat between epochs (and are cached), and why."""
        found = cacheability(self.config.train_transforms)
        if found.cacheable and not self.config.cache:
            return Cacheability(False, "not cached: cache=False")
        return found

    # Training -------------------------------------------------------------------------------

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
        `hapi.client.distributed`).

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
        params = self.trainable_parameters
        if not params:
            raise NothingToTrain(
                "nothing to train: every parameter is frozen; lower `freeze` so the last "
                "layers train"
            )
        if optimizer is None:
            optimizer = torch.optim.SGD(params, lr=lr, momentum=0.9)
        elif not isinstance(optimizer, torch.optim.Optimizer):
            optimizer = optimizer(params)
        state = self._progress
        if resume_from is not None:
            self.load_state_dict(read_state(resume_from))
        elif state.resumed is None:
            state.position = state.step = 0  # an epoch a failure cut short starts again
        if state.resumed is not None and state.resumed["optimizer"] is not None:
            optimizer.load_state_dict(state.resumed["optimizer"])
        return loops.fit(self, epochs, optimizer, progress)

    def state_dict(self) -> dict[str, Any]:
        """What `fit(resume_from=...)` needs to go on as if never stopped.

        The tail's parameters and buffers (batch norm statistics), the optimizer's state,
        the epoch and how far into its order training got, the plan in force, the
        per-step losses and the random states (torch, numpy, Python). Taken after a
        step (from a `progress` callback, or after `fit` raised), a resumed job trains
        the same batches as one never stopped. The frozen head is not in it: it is the
        model the job was built from.
        """
        return loops.state_of(self)

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
        loops.load_state(self, state)

    def evaluate(
        self, dataset: str | None = None, *, progress: Callable[[int, int], None] | None = None
    ) -> EvalResult:
        """Accuracy of the model on `dataset` (default: the job's eval or training set).

        Data-parallel, every rank calls it: each evaluates its shard, and the result is
        the whole set's on every rank.
        """
        self._plans.in_force()  # plans first, outside inference mode: planning times a backward
        return loops.evaluate(
            self, dataset or self.config.eval_dataset or self.config.dataset, progress
        )

    def batches_per_epoch(self) -> int:
        """Training batches (steps) in one epoch of the training set, on each rank."""
        samples = len(self.manifest(self.config.dataset))
        dp = self._model.dp
        if dp is not None:
            return dp.shard.steps(samples, self.config.batch_size)
        return -(-samples // self.config.batch_size)

    def manifest(self, prefix: str) -> DatasetManifest:
        """The dataset under `prefix`, listed once by a server (or from the store itself,
        `JobConfig.store`, while none answers), retried within `retry_budget_s`.

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
        if self.repo is None:
            raise InvalidRequest(
                "this job has no model repository to push to: create it with repo=<URI>"
            )
        if metrics is None and self.history.epochs:
            last = self.history.epochs[-1]
            metrics = {"train_loss": last.loss, "train_accuracy": last.accuracy}
        return self.repo.push(
            self.model,
            name,
            parent=parent if parent is not None else self.base,
            tags=tags,
            metrics=metrics,
            spec=self.spec,
        )

    # Internals ------------------------------------------------------------------------------

    def _fixed_plan(self) -> tuple[int, float] | None:
        """The (cut, share) the options fix, or None for the planner to choose."""
        config = self.config
        if config.mode == "local":
            return (RAW, 0.0)
        if config.cut == "auto":
            return None
        cut = self.freeze if config.cut is None else self._model.resolve_cut(config.cut)
        return (cut, config.local_share)

    def _record(self, event: Event) -> None:
        self.history.events.append(event)

    def _reopened(self, cut: int, lost: str, new: str) -> None:
        self._record(
            Event(
                "reopen",
                self._progress.epoch,
                None,
                f"the server had lost the session for cut {cut} (restarted?): re-opened",
                {"cut": cut, "lost": lost, "session": new},
            )
        )
