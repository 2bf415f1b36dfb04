"""A job's loops - training epochs, evaluation - and the progress that lets one resume.

`JobLoops` is given the job's parts (its model, data, plan in force, history) and calls
down into them; nothing here calls back up into `TransferJob`."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from hapi.client.config.job import JobConfig
from hapi.client.job._data import JobData
from hapi.client.job._epochs import EpochAccounts
from hapi.client.job._model import JobModel
from hapi.client.job._resume import STATE_VERSION, capture_rng, read_state, restore_rng
from hapi.client.pipeline.distributed import Shard, pad
from hapi.client.pipeline.history import EpochStats, History
from hapi.client.pipeline.loader import FeatureLoader
from hapi.client.pipeline.rebatch import Batch
from hapi.client.planning.codec_choice import loop_codec
from hapi.client.planning.in_force import PlanInForce
from hapi.data import Transforms
from hapi.errors import InvalidRequest, NothingToTrain
from hapi.graph import INPUT

__all__ = ["EvalResult", "JobLoops", "OptimizerFactory", "Progress"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class EvalResult:
    """Accuracy and mean loss over an evaluation set."""

    accuracy: float
    loss: float
    samples: int
    bytes_received: int
    seconds: float


@dataclass
class Progress:
    """Where a job's training is: what `fit` runs next and what resuming restores."""

    next_epoch: int = 0
    """The epoch `fit` runs next; it may have begun (see `position`)."""
    position: int = 0
    """Places of `next_epoch`'s order trained (or skipped) so far: where it resumes."""
    step: int = 0
    """Steps of `next_epoch` taken so far (ranks take them together)."""
    epoch: int | None = None
    """The epoch a loop runs now (None between loops): events name it."""
    optimizer: torch.optim.Optimizer | None = None
    resumed: Mapping[str, Any] | None = None
    """A loaded state whose optimizer and random states the next `fit` takes up."""
    homes: np.ndarray | None = None
    """The training keys' home servers the first `fit` found (`FeatureLoader.homes`):
    every later epoch is grouped by these, so a resumed one has the order it had."""


class JobLoops:
    """A job's training and evaluation loops, and where its training is.

    Args:
        config: the job's options.
        model: the model side (the step, the tail, data parallelism).
        data: the data side (each loop's loader).
        plans: the plan in force (each loop's router).
        history: receives the losses and epochs.
        progress: where training is (shared with the plan's `cached` check).
    """

    def __init__(
        self,
        config: JobConfig,
        model: JobModel,
        data: JobData,
        plans: PlanInForce,
        history: History,
        progress: Progress,
    ) -> None:
        self.config, self.model, self.data, self.plans = config, model, data, plans
        self.history, self.progress = history, progress

    @property
    def rank(self) -> int:
        return self.model.dp.rank if self.model.dp is not None else 0

    @property
    def world_size(self) -> int:
        return self.model.dp.world if self.model.dp is not None else 1

    @contextlib.contextmanager
    def loop(
        self, prefix: str, transforms: Transforms, *, train: bool, shard: Shard | None = None
    ) -> Iterator[FeatureLoader]:
        """A loader for one loop over `prefix` (of `shard` of it, where given), under the
        plan in force (whose router a training loop lets re-plan), its sessions closed
        when the loop ends."""
        config, plans = self.config, self.plans
        try:
            replan = config.planning.replan
            with plans.running(train=train, replan=replan, recall=self.data.recall) as router:
                wire = config.wire
                codec = loop_codec(wire.dtype, wire.compression, plans.current)
                homes = self.progress.homes if train and prefix == config.dataset else None
                with self.data.loader(
                    prefix, transforms, train=train, router=router, codec=codec, shard=shard,
                    homes=homes,
                ) as loader:  # fmt: skip
                    yield loader
        finally:
            self.progress.epoch = None

    def fit(
        self,
        epochs: int,
        optimizer: torch.optim.Optimizer | OptimizerFactory | None,
        *,
        lr: float,
        progress: Callable[[int, int], None] | None,
        resume_from: Mapping[str, Any] | str | os.PathLike[str] | None,
    ) -> History:
        """Train `epochs` epochs (see `TransferJob.fit`)."""
        params = self.model.parts.trainable()
        if not params:
            raise NothingToTrain(
                "nothing to train: every parameter is frozen; lower `freeze` so the last "
                "layers train"
            )
        if optimizer is None:
            optimizer = torch.optim.SGD(params, lr=lr, momentum=0.9)
        elif not isinstance(optimizer, torch.optim.Optimizer):
            optimizer = optimizer(params)
        state = self.progress
        if resume_from is not None:
            self.load_state(read_state(resume_from))
        elif state.resumed is None:
            state.position = state.step = 0  # an epoch a failure cut short starts again
        if state.resumed is not None and state.resumed["optimizer"] is not None:
            # A copy: torch keeps the given momentum tensors as its own and updates them in
            # place, so a state resumed twice in one process began from another the 2nd time.
            optimizer.load_state_dict(copy.deepcopy(state.resumed["optimizer"]))
        return self._fit(epochs, optimizer, progress)

    def _fit(
        self,
        epochs: int,
        optimizer: torch.optim.Optimizer,
        progress: Callable[[int, int], None] | None,
    ) -> History:
        model, state, history = self.model, self.progress, self.history
        state.optimizer = optimizer
        loss_fn = nn.CrossEntropyLoss()
        with self.loop(self.config.dataset, self.config.train_transforms, train=True) as loader:
            start = state.next_epoch
            # Before anything is in flight: a stats call now does not wait behind streams.
            accounts = EpochAccounts(loader, model.dp.totals if model.dp is not None else None)
            # The loader owns the position from here; `state` keeps a copy, step by step,
            # for a `state_dict` taken between steps or after `fit` raised.
            loader.load_state_dict({"epoch": start, "position": state.position})
            state.homes = loader.homes()
            for epoch in range(start, start + epochs):
                state.epoch = epoch
                self._train_mode(True)
                offset, resumed, state.resumed = state.position, state.resumed, None
                self._seed_epoch(epoch, resumed if offset else None)
                total_loss = correct = seen = compute = 0.0
                # The next epoch's first chunks are fetched while this one drains.
                then = epoch + 1 if epoch + 1 < start + epochs else None
                batches: Iterable[Batch] = loader.batches(epoch, then=then)
                if model.dp is not None:  # every rank takes every step, its shard or not
                    batches = pad(batches, len(loader) - state.step, model.empty_batch)
                for step, batch in enumerate(batches, state.step + 1):
                    t1 = time.thread_time()
                    x, y = model.to_device(batch.features, batch.labels)
                    mean, right, n = model.step(optimizer, loss_fn, x, y, batch.cut)
                    if n:
                        history.losses.append(mean)
                    total_loss += mean * n
                    correct += right
                    seen += n
                    compute += time.thread_time() - t1
                    if batch.keys:  # not a rank's padding, after its loader's epoch ended
                        state.position = loader.state_dict()["position"]
                    state.step = step
                    if progress is not None:
                        progress(step, len(loader))
                cut, share = loader.router.applied  # a re-plan pending is the next epoch's
                history.epochs.append(
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
                state.next_epoch, state.position, state.step = epoch + 1, 0, 0
        return history

    def features(
        self, epoch: int, *, train: bool, shard: Shard | None, start: int
    ) -> Iterator[tuple[Batch, EpochStats | None]]:
        """One epoch's batches (of `shard`, from place `start` of its order) with their
        features carried to the freeze point, for a loop of another framework. The last
        batch of a training epoch comes with the epoch's figures (its loss is that loop's:
        NaN here), which also go into the history."""
        model, config = self.model, self.config
        if train:
            prefix, transforms = config.dataset, config.train_transforms
        else:
            prefix = config.data.eval_dataset or config.dataset
            transforms = config.test_transforms
        freeze = model.freeze
        with self.loop(prefix, transforms, train=train, shard=shard) as loader:
            accounts = EpochAccounts(loader) if train else None
            self.progress.epoch = epoch
            seen, held = 0, None
            # No grad mode is set around the yields: it would hold in the caller's step.
            for batch in loader.batches(epoch, start=start):
                if held is not None:
                    yield held, None
                features = batch.features
                if batch.cut < freeze:
                    features = model.parts.convert(features, max(batch.cut, INPUT), freeze)
                seen += len(batch)
                held = dataclasses.replace(batch, features=features, cut=freeze)
            figures = None
            if accounts is not None:
                cut, share = loader.router.applied
                figures = accounts.close(
                    epoch, cut=cut, share=share, loss=math.nan, correct=math.nan, seen=seen,
                    compute=0,
                )  # fmt: skip
                self.history.epochs.append(figures)
            if held is not None:
                yield held, figures

    def _seed_epoch(self, epoch: int, resumed: Mapping[str, Any] | None) -> None:
        """Set the random state `epoch` trains with: the state's, resumed mid-epoch (as it
        was after its last step), else one seeded by the epoch and rank."""
        if resumed is not None:
            restore_rng(resumed["rng"])
        else:
            # Seed per epoch so dropout in the tail draws the same masks in every
            # plan; per rank too, or the ranks' slices would share their masks.
            seed = self.config.training.seed
            torch.manual_seed(seed * 1_000_003 + epoch + (self.rank << 32))

    def steps_per_epoch(self) -> int:
        """Training batches (steps) in one epoch of the training set, on each rank."""
        samples = len(self.data.manifest(self.config.dataset))
        dp, batch_size = self.model.dp, self.config.training.batch_size
        if dp is not None:
            return dp.shard.steps(samples, batch_size)
        return -(-samples // batch_size)

    def evaluate(
        self, dataset: str | None, progress: Callable[[int, int], None] | None
    ) -> EvalResult:
        """The model's accuracy and loss on `dataset`, by default the job's evaluation set
        or else its training set (see `TransferJob.evaluate`)."""
        self.plans.in_force()  # plans first, outside inference mode: planning times a backward
        prefix = dataset or self.config.data.eval_dataset or self.config.dataset
        return self._evaluate(prefix, progress)

    @torch.inference_mode()
    def _evaluate(self, prefix: str, progress: Callable[[int, int], None] | None) -> EvalResult:
        model = self.model
        self._train_mode(False)
        loss_fn = nn.CrossEntropyLoss(reduction="sum")
        t0 = time.perf_counter()
        total_loss = correct = seen = 0.0
        with self.loop(prefix, self.config.test_transforms, train=False) as loader:
            for step, batch in enumerate(loader.batches(0), 1):
                x, y = model.to_device(batch.features, batch.labels)
                out = model.output(x, batch.cut)
                total_loss += loss_fn(out, y).item()
                correct += (out.argmax(1) == y).sum().item()
                seen += len(y)
                if progress is not None:
                    progress(step, len(loader))
            nbytes = float(loader.stats.bytes_received)
        if model.dp is not None:  # each rank evaluated its shard: report the whole set
            total_loss, correct, seen, nbytes = model.dp.sum([total_loss, correct, seen, nbytes])
        return EvalResult(
            accuracy=correct / max(seen, 1),
            loss=total_loss / max(seen, 1),
            samples=int(seen),
            bytes_received=int(nbytes),
            seconds=time.perf_counter() - t0,
        )

    def state_dict(self) -> dict[str, Any]:
        """What `fit(resume_from=...)` needs (see `TransferJob.state_dict`)."""
        cut, share = self.plans.in_force()
        state, model = self.progress, self.model
        pending = state.resumed["optimizer"] if state.resumed is not None else None
        return {
            "version": STATE_VERSION,
            **self._identity(),
            "epoch": state.next_epoch,
            "position": state.position,
            "step": state.step,
            # Copies, not torch's views of the live tensors: a state kept in memory stays
            # what it was when taken while this job trains on.
            "model": copy.deepcopy(model.parts.tail(model.freeze).state_dict()),
            "optimizer": copy.deepcopy(
                state.optimizer.state_dict() if state.optimizer else pending
            ),
            "plan": {"cut": cut, "share": share},
            "losses": list(self.history.losses),
            "rng": capture_rng(),
            "homes": torch.from_numpy(state.homes.astype(np.int16))
            if state.homes is not None
            else None,
        }

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Take up a `state_dict` (see `TransferJob.load_state_dict`)."""
        state = read_state(state)
        for name, mine in self._identity().items():
            theirs = state.get(name, 0 if name == "rank" else 1)  # states from before DDP
            if theirs != mine:
                raise InvalidRequest(
                    f"the state is of a job with {name}={theirs!r}, this one has "
                    f"{mine!r}: build the job with the options the state was saved from"
                )
        model = self.model
        model.parts.tail(model.freeze).load_state_dict(state["model"])
        plan = state["plan"]
        cut = model.resolve_cut(plan["cut"])
        self.plans.set(cut, plan["share"], reason="resumed from a saved state")
        self.history.losses[:] = state["losses"]
        progress = self.progress
        progress.next_epoch, progress.position = state["epoch"], state["position"]
        homes = state.get("homes")  # None in a state from before locality
        progress.homes = homes.numpy().astype(np.int64) if homes is not None else None
        batch_size = self.config.training.batch_size
        progress.step = state.get("step", progress.position // batch_size)
        progress.optimizer = None
        progress.resumed = state
        restore_rng(state["rng"])

    def _identity(self) -> dict[str, Any]:
        """What a state must share with this job to be taken up by it."""
        return {
            "dataset": self.config.dataset,
            "seed": self.config.training.seed,
            "batch_size": self.config.training.batch_size,
            "freeze": self.model.freeze,
            "world_size": self.world_size,
            "rank": self.rank,
        }

    def _train_mode(self, train: bool) -> None:
        self.model.parts.train(train, max(self.plans.in_force()[0], INPUT))
