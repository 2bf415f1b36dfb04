"""`TransferJob`: fine-tune the last layers of a model on data in an object store."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hapi._sizes import parse_bytes
from hapi._tracing import TRACING
from hapi.cache import Cacheability, FeatureCache, cacheability
from hapi.client._codec_choice import Codec, job_codecs, loop_codec
from hapi.client._decode import RawDecoder
from hapi.client._epochs import EpochAccounts
from hapi.client._from_repo import build_from_repo
from hapi.client._parts import ModelParts
from hapi.client._profile_cache import ProfileCache
from hapi.client._resume import STATE_VERSION, capture_rng, read_state, restore_rng
from hapi.client._trainer_cache import TrainerCache, loop_space
from hapi.client.config import JobConfig
from hapi.client.connection import Connection, connect
from hapi.client.distributed import DataParallel, pad
from hapi.client.export import UploadedHeads
from hapi.client.history import EpochStats, Event, History
from hapi.client.loader import FeatureLoader
from hapi.client.local import LocalCompute
from hapi.client.plan_in_force import PlanInForce
from hapi.client.planning import plan_job
from hapi.client.rebatch import Batch
from hapi.client.retry import RETRYABLE, RetryPolicy
from hapi.client.routing import Router
from hapi.client.sessions import Sessions
from hapi.data import DatasetManifest, Transforms, open_store
from hapi.errors import InvalidRequest, NothingToTrain, ServerUnavailable
from hapi.graph import INPUT, RAW, ModelGraph, ModelSpec, build_model, trace
from hapi.plan import Plan, Workload, choose_freeze
from hapi.repo.refs import is_repo_ref
from hapi.wire import SessionRequest, WireDtype
from hapi.wire.messages import UploadedHead

if TYPE_CHECKING:
    from hapi.repo import ModelRepo, ModelVersion, PushedVersion

__all__ = ["EpochStats", "EvalResult", "History", "TransferJob"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class EvalResult:
    """Accuracy and mean loss over an evaluation set."""

    accuracy: float
    loss: float
    samples: int
    bytes_received: int
    seconds: float


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
        **options: Any,
    ) -> None:
        if isinstance(model, str) and not is_repo_ref(model):
            model = ModelSpec(name=model)
        elif isinstance(model, dict):
            model = ModelSpec.from_dict(model)
        if isinstance(server, Connection):
            address: str | tuple[str, ...] = server.address
        else:
            address = server if isinstance(server, str) else tuple(server)
        self.config = JobConfig(model=model, dataset=dataset, server=address, **options)
        self.repo: ModelRepo | None = None
        if self.config.repo is not None:
            from hapi.repo import ModelRepo

            self.repo = ModelRepo.open(self.config.repo, self.config.repo_store_options)
        self.base: ModelVersion | None = None
        """The repository version the job started from, when it did."""
        self.spec, self.model = self._build(model)
        self.connections: list[Connection] = [
            server
            if isinstance(server, Connection)
            else connect(
                one,
                token=self.config.token,
                tls_ca=self.config.tls_ca,
                tls_cert=self.config.tls_cert,
                tls_key=self.config.tls_key,
            )
            for one in self.config.servers
        ]
        """One connection per server, in the order given (connected on first use)."""
        self.connection = self.connections[0]
        """The first server's: it lists datasets and is measured for the plan."""
        self._dp = DataParallel.start(self.config.device, self.config.distributed)
        """The data-parallel side under torchrun; None when the job trains alone."""
        self.device = self._dp.device if self._dp is not None else torch.device(self.config.device)
        size = self.config.image_size
        # Exclusive: tracing patches nn.Module for every thread (a server in this process).
        with TRACING.exclusive():
            self.graph: ModelGraph = trace(self.model, input_shape=(3, size, size))
        choice = choose_freeze(self.graph, self.config.freeze)
        self.freeze = choice.freeze
        """The last frozen cut point."""
        self.freeze_reason = choice.reason
        """Why this freeze point (the job's summary says it)."""
        self._parts = ModelParts(self.graph, self.freeze, self.device, exact=self.config.exact)
        self.history = History()
        self._plans = PlanInForce(
            fixed=self._fixed_plan(),
            default=(self.freeze, 0.0),
            connections=self.connections,
            measure=self._make_plan,
            measure_aside=functools.partial(self._make_plan, aside=True),
            retries=RetryPolicy(budget_s=self.config.retry_budget_s),
            record=self._record,
            shared=self._dp.from_rank0 if self._dp is not None else None,
            cached=self._all_cached,
        )
        """The plan in force, fixed or measured, and who may change it."""
        self._uploads: UploadedHeads | None = None
        if isinstance(model, nn.Module):
            self._uploads = UploadedHeads(self.graph)
            self._check_exportable()
        self._epoch: int | None = None
        self.model.to(self.device)
        self._next_epoch = 0
        """The epoch `fit` runs next; it may have begun (see `_position`)."""
        self._position = 0
        """Places of `_next_epoch`'s order trained (or skipped) so far: where it resumes."""
        self._step = 0
        """Steps of `_next_epoch` taken so far (ranks take them together)."""
        self._optimizer: torch.optim.Optimizer | None = None
        self._resumed: Mapping[str, Any] | None = None
        """A loaded state whose optimizer and random states the next `fit` takes up."""
        self._manifests: dict[str, DatasetManifest] = {}
        self._fallback = (
            open_store(self.config.store, self.config.store_options, create=False)
            if self.config.store is not None
            else None
        )
        """The store, read directly while no server answers (`JobConfig.store`)."""
        self._features: FeatureCache | None = None
        """The trainer's feature cache, opened by the first loop that uses it."""

    # What the job will do ------------------------------------------------------------------

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
        return self._in_force()[0]

    @property
    def local_share(self) -> float:
        """The share of chunks the trainer computes from raw bytes (1 for RAW)."""
        cut, share = self._in_force()
        return 1.0 if cut == RAW else share

    @property
    def raw(self) -> bool:
        """Whether every chunk travels as raw bytes (the baseline)."""
        return self.cut == RAW

    @property
    def tail(self) -> nn.Module:
        """The module the trainer runs on features at the plan's cut."""
        return self._parts.tail(max(self.cut, INPUT))

    @property
    def rank(self) -> int:
        """This process's rank among data-parallel trainers (0 when training alone)."""
        return self._dp.rank if self._dp is not None else 0

    @property
    def world_size(self) -> int:
        """The number of data-parallel trainers (1 when training alone)."""
        return self._dp.world if self._dp is not None else 1

    @property
    def trainable_parameters(self) -> list[nn.Parameter]:
        """The parameters `fit` trains: those after the freeze point that are not frozen."""
        return self._parts.trainable()

    def summary(self) -> str:
        """What the job trains and how its data travels, in a few lines."""
        trained = sum(p.numel() for p in self.trainable_parameters)
        name = self.spec.name if self.spec is not None else type(self.model).__name__
        lines = [
            f"{name if self.base is None else self.base.ref}: {trained:,} parameters train",
            self.freeze_reason,
        ]
        if self.config.mode == "local":
            lines.append("mode=local: the baseline, raw bytes to the trainer")
        elif (fixed := self._plans.fixed) is not None:
            cut, share = fixed
            lines.append(f"cut {cut}, {share:.0%} of chunks local, as given")
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

    def set_plan(
        self, cut: int | str, share: float = 0.0, *, reason: str = "set by the user"
    ) -> None:
        """Use (`cut`, `share`) for the chunks not yet issued: mid-epoch (from a progress
        callback) or for the next `fit`. Every key is still delivered once per epoch.

        Raises:
            InvalidCut: a cut past the freeze point.
            InvalidRequest: a share outside [0, 1], or a share with RAW.
        """
        index = self.graph.resolve_cut(cut)
        if index != RAW:
            self.graph.check_cut(index, self.freeze)
        self._plans.set(index, share, reason=reason)

    # Training ------------------------------------------------------------------------------

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
        if resume_from is not None:
            self.load_state_dict(read_state(resume_from))
        elif self._resumed is None:
            self._position = self._step = 0  # an epoch a failure cut short starts again
        if self._resumed is not None and self._resumed["optimizer"] is not None:
            optimizer.load_state_dict(self._resumed["optimizer"])
        self._optimizer = optimizer
        loss_fn = nn.CrossEntropyLoss()
        with self._loop(self.config.dataset, self.config.train_transforms, True) as loader:
            start = self._next_epoch
            # Before anything is in flight: a stats call now does not wait behind streams.
            accounts = EpochAccounts(loader, self._dp.totals if self._dp is not None else None)
            for epoch in range(start, start + epochs):
                self._epoch = epoch
                self._train_mode(True)
                offset, resumed, self._resumed = self._position, self._resumed, None
                if resumed is not None and offset:
                    restore_rng(resumed["rng"])  # as it was after the state's last step
                else:
                    # Seed per epoch so dropout in the tail draws the same masks in every plan;
                    # per rank too, or the ranks' slices would share their masks.
                    torch.manual_seed(self.config.seed * 1_000_003 + epoch + (self.rank << 32))
                order = loader.order(epoch)
                keys = loader.manifest.keys
                place = {keys[j]: i for i, j in enumerate(order)}
                total_loss = correct = seen = compute = 0.0
                # The next epoch's first chunks are fetched while this one drains.
                then = epoch + 1 if epoch + 1 < start + epochs else None
                batches: Iterable[Batch] = loader.batches(epoch, start=offset, then=then)
                if self._dp is not None:  # every rank takes every step, its shard or not
                    batches = pad(batches, len(loader) - self._step, self._empty_batch)
                for step, batch in enumerate(batches, self._step + 1):
                    t1 = time.thread_time()
                    x, y = self._to_device(batch.features, batch.labels)
                    mean, right, n = self._train_step(optimizer, loss_fn, x, y, batch.cut)
                    total_loss += mean * n
                    correct += right
                    seen += n
                    compute += time.thread_time() - t1
                    # Batches arrive in epoch order: the last key's place bounds the rest.
                    if batch.keys:
                        self._position = place[batch.keys[-1]] + 1
                    self._step = step
                    if progress is not None:
                        progress(step, len(loader))
                cut, share = self._in_force()
                self.history.epochs.append(
                    accounts.close(
                        epoch,
                        cut=cut,
                        share=share,
                        loss=total_loss,
                        correct=correct,
                        seen=seen,
                        compute=compute,
                    )
                )
                self._next_epoch, self._position, self._step = epoch + 1, 0, 0
        return self.history

    def state_dict(self) -> dict[str, Any]:
        """What `fit(resume_from=...)` needs to go on as if never stopped.

        The tail's parameters and buffers (batch norm statistics), the optimizer's state,
        the epoch and how far into its order training got, the plan in force, the
        per-step losses and the random states (torch, numpy, Python). Taken after a
        step (from a `progress` callback, or after `fit` raised), a resumed job trains
        the same batches as one never stopped. The frozen head is not in it: it is the
        model the job was built from.
        """
        cut, share = self._in_force()
        pending = self._resumed["optimizer"] if self._resumed is not None else None
        return {
            "version": STATE_VERSION,
            "dataset": self.config.dataset,
            "seed": self.config.seed,
            "batch_size": self.config.batch_size,
            "freeze": self.freeze,
            "epoch": self._next_epoch,
            "position": self._position,
            "step": self._step,
            "world_size": self.world_size,
            "rank": self.rank,
            "model": self._parts.tail(self.freeze).state_dict(),
            "optimizer": self._optimizer.state_dict() if self._optimizer else pending,
            "plan": {"cut": cut, "share": share},
            "losses": list(self.history.losses),
            "rng": capture_rng(),
        }

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
        state = read_state(state)
        for name, mine in (
            ("dataset", self.config.dataset),
            ("seed", self.config.seed),
            ("batch_size", self.config.batch_size),
            ("freeze", self.freeze),
            ("world_size", self.world_size),
            ("rank", self.rank),
        ):
            theirs = state.get(name, 0 if name == "rank" else 1)  # states from before DDP
            if theirs != mine:
                raise InvalidRequest(
                    f"the state is of a job with {name}={theirs!r}, this one has "
                    f"{mine!r}: build the job with the options the state was saved from"
                )
        self._parts.tail(self.freeze).load_state_dict(state["model"])
        plan = state["plan"]
        self.set_plan(plan["cut"], plan["share"], reason="resumed from a saved state")
        self.history.losses[:] = state["losses"]
        self._next_epoch, self._position = state["epoch"], state["position"]
        self._step = state.get("step", self._position // self.config.batch_size)
        self._optimizer = None
        self._resumed = state
        restore_rng(state["rng"])

    def evaluate(
        self, dataset: str | None = None, *, progress: Callable[[int, int], None] | None = None
    ) -> EvalResult:
        """Accuracy of the model on `dataset` (default: the job's eval or training set).

        Data-parallel, every rank calls it: each evaluates its shard, and the result is
        the whole set's on every rank.
        """
        self._in_force()  # plans first, outside inference mode: planning times a backward
        return self._evaluate(dataset or self.config.eval_dataset or self.config.dataset, progress)

    @torch.inference_mode()
    def _evaluate(self, prefix: str, progress: Callable[[int, int], None] | None) -> EvalResult:
        self._train_mode(False)
        loss_fn = nn.CrossEntropyLoss(reduction="sum")
        t0 = time.perf_counter()
        total_loss = correct = seen = 0.0
        with self._loop(prefix, self.config.test_transforms, False) as loader:
            for step, batch in enumerate(loader.batches(0), 1):
                x, y = self._to_device(batch.features, batch.labels)
                out = self._output(x, batch.cut)
                total_loss += loss_fn(out, y).item()
                correct += (out.argmax(1) == y).sum().item()
                seen += len(y)
                if progress is not None:
                    progress(step, len(loader))
            nbytes = float(loader.stats.bytes_received)
        if self._dp is not None:  # each rank evaluated its shard: report the whole set
            total_loss, correct, seen, nbytes = self._dp.sum([total_loss, correct, seen, nbytes])
        return EvalResult(
            accuracy=correct / max(seen, 1),
            loss=total_loss / max(seen, 1),
            samples=int(seen),
            bytes_received=int(nbytes),
            seconds=time.perf_counter() - t0,
        )

    def batches_per_epoch(self) -> int:
        """Training batches (steps) in one epoch of the training set, on each rank."""
        samples = len(self.manifest(self.config.dataset))
        if self._dp is not None:
            return self._dp.shard.steps(samples, self.config.batch_size)
        return -(-samples // self.config.batch_size)

    def manifest(self, prefix: str) -> DatasetManifest:
        """The dataset under `prefix`, listed once by a server (or from the store itself,
        `JobConfig.store`, while none answers), retried within `retry_budget_s`.

        Raises:
            ServerUnavailable, StoreUnavailable: no listing within the retry budget.
        """
        if prefix not in self._manifests:
            for attempt in RetryPolicy(budget_s=self.config.retry_budget_s).retrying():
                with attempt:
                    self._manifests[prefix] = self._list(prefix)
        return self._manifests[prefix]

    def _list(self, prefix: str) -> DatasetManifest:
        try:
            return self._from_any(lambda c: c.manifest(prefix))
        except RETRYABLE:
            if self._fallback is None:
                raise
            return DatasetManifest.from_store(self._fallback, prefix)

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

    # Internals -----------------------------------------------------------------------------

    def _build(self, model: ModelSpec | str | nn.Module) -> tuple[ModelSpec | None, nn.Module]:
        """The job's spec and model, with the base's weights when it comes from the repo;
        a module of the user's own has no spec."""
        classes = self.config.num_classes
        if isinstance(model, nn.Module):
            return None, model
        if isinstance(model, ModelSpec):
            spec = model if classes is None else dataclasses.replace(model, num_classes=classes)
            return spec, build_model(spec)
        assert self.repo is not None  # JobConfig checks it
        self.base = self.repo.resolve(model)
        return build_from_repo(self.repo, self.base, num_classes=classes)

    def _fixed_plan(self) -> tuple[int, float] | None:
        """The (cut, share) the options fix, or None for the planner to choose."""
        config = self.config
        if config.mode == "local":
            return (RAW, 0.0)
        if config.cut == "auto":
            return None
        cut = self.freeze if config.cut is None else self.graph.resolve_cut(config.cut)
        if cut != RAW:
            self.graph.check_cut(cut, self.freeze)
        return (cut, config.local_share)

    def _in_force(self) -> tuple[int, float]:
        return self._plans.in_force()

    def _make_plan(self, connection: Connection | None = None, *, aside: bool = False) -> Plan:
        """Measure the job on `connection`'s server (default: the first) and choose its
        plan (`plan_job`). `aside`: while the job trains - the trainer is timed on a copy of
        the model, as timing runs backward passes that would race the training step's."""
        connection = connection or self.connection
        config = self.config
        manifest = self.manifest(config.dataset)
        transforms = config.train_transforms
        planned = plan_job(
            connection,
            functools.partial(self._request, transforms=transforms, connection=connection),
            manifest,
            self._graph_aside() if aside else self.graph,
            self.freeze,
            transforms,
            Workload(
                samples=-(-len(manifest) // self.world_size),  # a rank's epoch is its shard
                chunk_size=config.chunk_size,
                prefetch=config.prefetch,
                servers=len(self.connections),
                back_to_back=True,  # `fit` fetches each epoch while the one before drains
            ),
            dataset=config.dataset,
            samples=config.probe_samples,
            batch_size=config.batch_size,
            seed=config.seed,
            wire_dtype=config.wire_dtype,
            cache=ProfileCache() if config.reuse_profiles else None,
            codecs=job_codecs(config),
        )
        plan = planned.plan
        message = plan.reason
        if planned.kept:
            message += " (from the profiles an earlier run of this job measured)"
        data = {**plan.to_dict(), "kept_profiles": planned.kept}
        self.history.events.append(Event("plan", None, None, message, data))
        return plan

    def _graph_aside(self) -> ModelGraph:
        """The model traced again from a copy, for timing while the job trains: timing runs
        forward and backward passes, which on the training model itself would race the
        training step's (an in-place update under a backward in flight)."""
        model = copy.deepcopy(self.model)
        size = self.config.image_size
        with TRACING.exclusive():
            return trace(model, input_shape=(3, size, size))

    @contextlib.contextmanager
    def _loop(self, prefix: str, transforms: Transforms, train: bool) -> Iterator[FeatureLoader]:
        """A loader for one loop over `prefix`, its sessions closed when the loop ends."""
        try:
            with (
                self._plans.running(train=train, replan=self.config.replan) as router,
                self._loader(prefix, transforms, train, router) as loader,
            ):
                yield loader
        finally:
            self._epoch = None

    @contextlib.contextmanager
    def _loader(
        self, prefix: str, transforms: Transforms, train: bool, router: Router
    ) -> Iterator[FeatureLoader]:
        config = self.config
        decoder = RawDecoder(transforms, config.seed, config.on_error)
        # Taken once: the loop's sessions, local chunks and cache agree on the codec.
        codec = loop_codec(config.wire_dtype, config.wire_compression, self._plans.current)
        sessions = [
            Sessions(
                connection,
                functools.partial(
                    self._request, transforms=transforms, connection=connection, codec=codec
                ),
                on_reopen=self._reopened,
            )
            for connection in self.connections
        ]
        loader = FeatureLoader(
            self.connection,
            sessions,
            self.manifest(prefix),
            cache=self._trainer_cache(transforms, codec[0]),
            relist=functools.partial(self._list, prefix),
            batch_size=config.batch_size,
            chunk_size=config.chunk_size,
            prefetch=config.prefetch,
            seed=config.seed,
            shuffle=train,
            retry_budget_s=config.retry_budget_s,
            router=router,
            local=LocalCompute(decoder, self.graph.head, codec[0], self.device, exact=config.exact),
            convert=self._parts.convert,
            record=self._record,
            shard=self._dp.shard if self._dp is not None else None,
            fallback=self._fallback,
        )
        with loader.servers:
            try:
                yield loader
            finally:
                loader.close()

    def _trainer_cache(
        self, transforms: Transforms, wire_dtype: WireDtype | None = None
    ) -> TrainerCache | None:
        """The trainer's feature cache for a loop with `transforms` whose features travel
        as `wire_dtype` (default the job's), if its features repeat."""
        config = self.config
        dtype = wire_dtype or config.wire_dtype
        if not config.cache or not cacheability(transforms).cacheable:
            return None
        if self._features is None:
            self._features = FeatureCache(
                config.cache_dir, max_bytes=parse_bytes(config.cache_size)
            )
        space = loop_space(
            self.graph.head(self.freeze),
            self.freeze,
            transforms,
            wire_dtype=dtype,
            exact=config.exact,
            seed=config.seed,
        )
        return TrainerCache(self._features, space, transforms, dtype)

    def _all_cached(self) -> bool:
        """Whether the trainer's cache holds every feature of the next training epoch."""
        cache = self._trainer_cache(self.config.train_transforms)
        if cache is None:
            return False
        manifest = self.manifest(self.config.dataset)
        if not manifest.versions:
            return False
        cache.set_versions(
            self._next_epoch, dict(zip(manifest.keys, manifest.versions, strict=True))
        )
        return cache.holds(self._next_epoch, manifest.keys)

    def _request(
        self,
        cut: int,
        transforms: Transforms,
        connection: Connection | None = None,
        codec: Codec | None = None,
    ) -> SessionRequest:
        """A session request at `cut`, for `connection`'s server (default: the first), its
        features sent with `codec` (default: the job's own, as the planner's probes are)."""
        config = self.config
        dtype, compression = codec or loop_codec(config.wire_dtype, config.wire_compression, None)
        return SessionRequest(
            model=self._wire_model(cut, connection or self.connection),
            cut=cut,
            freeze=self.freeze,
            transforms=transforms.to_dict(),
            image_size=config.image_size,
            wire_dtype=dtype,
            seed=config.seed,
            on_error=config.on_error,
            exact=config.exact,
            compression=compression if cut != RAW else "none",
        )

    def _wire_model(self, cut: int, connection: Connection) -> dict[str, Any] | str | UploadedHead:
        """How a session at `cut` names the model: the base version pinned by id, the
        spec, or the uploaded head of the user's own module (uploaded to `connection`'s
        server now if need be)."""
        if self._uploads is not None:
            return self._uploads.model(cut, connection)
        if self.base is not None:
            return f"repo://{self.base.name}@{self.base.id}"
        assert self.spec is not None  # a job without a module has one
        return self.spec.to_dict()

    def _check_exportable(self) -> None:
        """Export the user's module's head now, so a module whose head cannot run on the
        server fails at build time, naming its line. With `cut="auto"` the head to the
        freeze point is checked: the heads to earlier cuts are parts of it."""
        if self._uploads is None or self.config.mode == "local":
            return
        fixed = self._plans.fixed
        cut = fixed[0] if fixed is not None else self.freeze
        if cut > INPUT:
            self._uploads.artifact(cut)

    def _output(self, x: torch.Tensor, cut: int, *, sync: bool = False) -> torch.Tensor:
        """The model's output from features at `cut` (the tail, and for an exact job the
        frozen part before it per sample, as the server runs it). `sync`: through the
        data-parallel tail, which starts at the freeze point whatever the cut."""
        cut = max(cut, INPUT)
        if (self.config.exact or sync) and cut < self.freeze:
            x = self._parts.convert(x, cut, self.freeze).to(self.device)
            cut = self.freeze
        tail = self._parts.tail(cut)
        if sync and self._dp is not None:
            tail = self._dp.wrap(tail)
        # Shared with the server's heads in this process and with exports of heads.
        with TRACING.shared():
            return tail(x)

    def _train_step(
        self,
        optimizer: torch.optim.Optimizer,
        loss_fn: nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        cut: int,
    ) -> tuple[float, float, int]:
        """One optimizer step on a batch: (mean loss, correct, samples), of the global
        batch when data-parallel (then also in the history: equal on every rank)."""
        optimizer.zero_grad(set_to_none=True)
        if self._dp is None:
            out = self._output(x, cut)
            loss = loss_fn(out, y)
            loss.backward()
            optimizer.step()
            mean, right, n = loss.item(), (out.argmax(1) == y).sum().item(), len(y)
        else:
            out = self._output(x, cut, sync=True)
            loss, mean, right, n = self._dp.loss(out, y)
            loss.backward()
            if n == 0:  # no rank had a sample (all skipped): backward only kept DDP in step
                return 0.0, 0.0, 0
            optimizer.step()
        self.history.losses.append(mean)
        return mean, right, n

    def _empty_batch(self) -> Batch:
        """A batch of no samples at the freeze point, for a rank whose shard ran out."""
        shape = self.graph.input_shape
        if self.freeze > INPUT:
            shape = self.graph.cut_point(self.freeze).shape
        empty = torch.zeros((0, *shape))
        return Batch(empty, torch.zeros(0, dtype=torch.long), [], self.freeze, ())

    def _record(self, event: Event) -> None:
        self.history.events.append(event)

    def _reopened(self, cut: int, lost: str, new: str) -> None:
        self._record(
            Event(
                "reopen",
                self._epoch,
                None,
                f"the server had lost the session for cut {cut} (restarted?): re-opened",
                {"cut": cut, "lost": lost, "session": new},
            )
        )

    def _train_mode(self, train: bool) -> None:
        self._parts.train(train, max(self.cut, INPUT))

    def _to_device(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.to(self.device, torch.float32), y.to(self.device)

    def _from_any(self, call: Callable[[Connection], Any]) -> Any:
        """`call` on the first server that answers (any of them has the whole store).

        Raises:
            ServerUnavailable: none answered (the last one's error).
        """
        for connection in self.connections[:-1]:
            with contextlib.suppress(ServerUnavailable):
                return call(connection)
        return call(self.connections[-1])
