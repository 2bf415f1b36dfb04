"""A job's features as a standard PyTorch dataset, for loops of other frameworks.

`FeatureDataset` yields a job's batches with their features at the freeze point: the
frozen head stays with hapi (on the server, or in the trainer for a hybrid's local
chunks), and the loop trains the tail (`dataset.tail()`). It shards each epoch by DDP
rank and by `DataLoader` worker itself, every key once. `FeatureDataLoader` runs it and
keeps the position for a checkpoint taken mid-epoch. Why the pieces are so:
`docs/frameworks.md`.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from hapi.client.config.job import JobConfig
from hapi.client.job.transfer import TransferJob
from hapi.client.pipeline.distributed import Shard
from hapi.client.pipeline.history import EpochStats
from hapi.errors import InvalidRequest
from hapi.graph import RAW

__all__ = ["FeatureBatch", "FeatureDataLoader", "FeatureDataset", "merge_figures"]

Split = Literal["train", "eval"]


@dataclass
class FeatureBatch:
    """A batch of features at the freeze point; `x, y = batch` unpacks the two tensors.

    (Not frozen: Lightning moves a batch to its device by setting its fields.)"""

    features: torch.Tensor
    labels: torch.Tensor
    keys: list[str]
    worker: int
    """The `DataLoader` worker that made it (0 without workers)."""
    split: Split
    figures: EpochStats | None = None
    """On a worker's last batch of a training epoch: its share's figures (bytes, cache
    hits, cut, stage seconds; the loss is the loop's, NaN)."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter((self.features, self.labels))

    def __len__(self) -> int:
        return len(self.keys)


class FeatureDataset(IterableDataset[FeatureBatch]):
    """A job's training (or evaluation) set as batches of features at the freeze point.

    Iterated in the process that built `job`, it runs the job's loader there. Each
    `DataLoader` worker (a process of its own) builds its own copy of the job with the
    plan in force pinned, and fetches its share of every epoch: the share of this DDP rank
    (from `torch.distributed` when it is initialized, else the job's own rank) split by
    worker.
    Run it with `FeatureDataLoader`, which tells it the epoch and where to resume.

    Args:
        job: the job whose features to yield.
        split: `train` (shuffled per epoch) or `eval` (the job's evaluation set, in order).

    Raises:
        InvalidRequest: an unknown split.
    """

    def __init__(self, job: TransferJob, split: Split = "train") -> None:
        if split not in ("train", "eval"):
            raise InvalidRequest(f"split is 'train' or 'eval', got {split!r}")
        super().__init__()
        self.split: Split = split
        self.batch_size = job.config.training.batch_size
        self.workers = 1
        """Processes that fetch (the `DataLoader`'s workers, or this one): set by
        `FeatureDataLoader`."""
        self.epoch = 0
        self.starts: list[int] = [0]
        """Batches of `epoch` each worker has handed on already (a resumed epoch)."""
        self.ranks: tuple[int, int] | None = None
        """(rank, world) of data parallelism, set in the process that knows them (a
        worker's `torch.distributed` is not initialized); None: found when needed."""
        self._job: TransferJob | None = job
        self._config = _pinned(job)
        self._samples = len(job.manifest(_prefix(job.config, split)))

    @property
    def job(self) -> TransferJob:
        """The job this process iterates (built here from the pinned config in a worker)."""
        if self._job is None:
            self._job = TransferJob.from_config(self._config)
        return self._job

    def tail(self) -> nn.Module:
        """The module to train on these features: the job's model after the freeze point,
        with the job's initial weights (the job's own module: training it trains the job's
        model, which `job.push` stores)."""
        job = self.job
        parts = job._model.parts
        parts.train(True, job.freeze)  # as fit leaves it: the frozen layers stay in eval
        return parts.tail(job.freeze)

    def worker_batches(self, rank: int | None = None) -> list[int]:
        """Batches each worker yields per epoch on `rank` (default: this one)."""
        bs, part = self.batch_size, self._parts()
        rank = part.rank if rank is None else rank
        places = np.arange(self._samples)
        return [
            -(-len(Shard(rank * self.workers + w, part.world).take(places, bs)) // bs)
            for w in range(self.workers)
        ]

    def check_even(self) -> None:
        """Refuse a training epoch whose ranks would take different numbers of steps: a
        framework's DDP waits, at the last step, for a rank that has no batch (where
        `TransferJob.fit` pads it with an empty step).

        Raises:
            InvalidRequest: naming the remainder and the fix.
        """
        parts = self._parts().world
        ranks = parts // self.workers
        if self.split != "train" or ranks == 1:
            return
        steps = [sum(self.worker_batches(r)) for r in range(ranks)]
        if len(set(steps)) > 1:
            rest = self._samples % (self.batch_size * parts)
            raise InvalidRequest(
                f"{self._samples} samples at batch_size={self.batch_size} over {ranks} ranks "
                f"x {self.workers} workers end in a global batch of {rest}, fewer than its "
                f"{parts} shares: the ranks would take {min(steps)} and {max(steps)} steps, "
                "and DDP would wait at the last; choose a batch_size or num_workers that "
                f"leaves no remainder below {parts}"
            )

    def __len__(self) -> int:
        """Batches per epoch on this rank, over every worker."""
        return sum(self.worker_batches())

    def __iter__(self) -> Iterator[FeatureBatch]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        count = info.num_workers if info is not None else 1
        if count != self.workers:
            raise InvalidRequest(
                f"the DataLoader runs {count} workers, the dataset was told {self.workers}: "
                "run it with FeatureDataLoader(dataset, num_workers=N)"
            )
        ranks = self._parts()
        part = Shard(ranks.rank * self.workers + worker, ranks.world)
        shard = part if part.world > 1 else None  # alone: the job's own loop, unsliced
        start = self.starts[worker] * self.batch_size if worker < len(self.starts) else 0
        job = self.job
        for batch, figures in job._loops.features(
            self.epoch, train=self.split == "train", shard=shard, start=start
        ):
            yield FeatureBatch(
                batch.features, batch.labels, batch.keys, worker, self.split, figures
            )

    def _parts(self) -> Shard:
        """This rank's place among every worker of every rank: (rank, ranks x workers)."""
        rank, world = self.ranks if self.ranks is not None else self.find_ranks()
        return Shard(rank, world * self.workers)

    def find_ranks(self) -> tuple[int, int]:
        """(rank, world): `torch.distributed`'s where it is initialized (Lightning's DDP),
        else the job's own (under torchrun), else (0, 1)."""
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        job = self.job
        return job.rank, job.world_size

    def __getstate__(self) -> dict[str, Any]:
        # A worker gets the pinned config, not the job: its connections, threads and
        # sessions are this process's.
        state = self.__dict__.copy()
        state["_job"] = None
        return state


def _prefix(config: JobConfig, split: Split) -> str:
    if split == "train":
        return config.dataset
    return config.data.eval_dataset or config.dataset


def _pinned(job: TransferJob) -> JobConfig:
    """The job's config for a worker's copy: the plan in force fixed (the workers measure
    nothing and agree with the job), no data parallelism of its own (the dataset slices
    by rank itself)."""
    config = job.config
    planning = config.planning
    if planning.mode != "local":
        share = 0.0 if job.cut == RAW else job.local_share  # RAW is local whole, no share
        planning = dataclasses.replace(planning, cut=job.cut, local_share=share, replan=False)
    training = dataclasses.replace(config.training, distributed=False)
    return dataclasses.replace(config, planning=planning, training=training)


def _workers_context() -> BaseContext:
    """Where workers come from: forked from a fork server that has imported hapi (and so
    torch) once, where a spawned worker imported them again - 4 s a worker here, every
    epoch. Never forked from this process, whose Flight client, store runtime and threads
    a fork would copy mid-flight; the fork server is a clean process that has run nothing.
    (Python 3.14's default on Linux; spawn where there is no fork server.)"""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    # Taken when the fork server starts (once a process): '__main__' as spawn imports it.
    context.set_forkserver_preload(["__main__", __name__])
    return context


class FeatureDataLoader(DataLoader[FeatureBatch]):
    """Runs a `FeatureDataset`: its batches as they are (no collation), each epoch's
    shares in `num_workers` worker processes, and the position for resuming.

    The position counts the batches trained: by default each batch handed on (a loop
    that takes `state_dict` after training the batch it was given), or, with
    `count="marked"`, those passed to `mark` - for loops that fetch ahead of training,
    as Lightning does. `state_dict()` names the epoch and each worker's batches;
    `load_state_dict` makes the next pass go on from there, every key once.

    Args:
        dataset: the features.
        num_workers: worker processes (0: fetch in this one).
        count: `handed` or `marked` (see above).
    """

    def __init__(
        self,
        dataset: FeatureDataset,
        *,
        num_workers: int = 0,
        count: Literal["handed", "marked"] = "handed",
    ) -> None:
        dataset.workers = max(num_workers, 1)
        super().__init__(
            dataset,
            batch_size=None,
            num_workers=num_workers,
            collate_fn=_as_is,
            multiprocessing_context=_workers_context() if num_workers else None,
        )
        self.count = count
        self._epoch = 0
        self._done = [0] * dataset.workers
        self._running = False
        self._loaded = False
        self._figures: list[EpochStats] = []
        self.epochs: list[EpochStats] = []
        """Each finished epoch's figures, its workers' shares merged (`merge_figures`)."""

    @property
    def features(self) -> FeatureDataset:
        dataset = self.dataset
        assert isinstance(dataset, FeatureDataset)
        return dataset

    def __iter__(self) -> Iterator[FeatureBatch]:  # type: ignore[override]
        dataset = self.features
        if self._running and not self._loaded:  # the last pass was left: the next epoch
            self._epoch, self._done = self._epoch + 1, [0] * dataset.workers
        self._loaded, self._running = False, True
        # Set before the workers start: each takes a copy of the dataset as it is now.
        dataset.epoch, dataset.starts = self._epoch, list(self._done)
        dataset.ranks = dataset.find_ranks()
        dataset.check_even()
        self._figures = []
        for batch in super().__iter__():
            if self.count == "handed":
                self._done[batch.worker] += 1
            if batch.figures is not None:
                self._figures.append(batch.figures)
            yield batch
        if self._figures:
            self.epochs.append(merge_figures(self._figures))
        self._epoch, self._done, self._running = self._epoch + 1, [0] * dataset.workers, False

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass epoch `epoch` (from its start, unless a loaded state is of
        it): for trainers that number the epochs themselves, as Hugging Face's does."""
        if not (self._loaded and self._epoch == epoch):
            self._epoch, self._done = epoch, [0] * self.features.workers
        self._loaded = True

    def resume(self, epoch: int, batches: int) -> None:
        """Make the next pass epoch `epoch` after its first `batches` batches, as this
        loader hands them on (its workers' in turn): for trainers that count the batches
        they trained rather than keep the loader's state, as Hugging Face's does."""
        left = self.features.worker_batches()
        done = [0] * len(left)
        while batches > 0 and any(d < n for d, n in zip(done, left, strict=True)):
            for w in range(len(left)):
                if batches and done[w] < left[w]:
                    done[w] += 1
                    batches -= 1
        self.load_state_dict({"epoch": epoch, "batches": done})

    def mark(self, batch: FeatureBatch) -> None:
        """Count `batch` as trained (with `count="marked"`)."""
        self._done[batch.worker] += 1

    def state_dict(self) -> dict[str, Any]:
        """The epoch, and the batches of it each worker had trained."""
        return {"epoch": self._epoch, "batches": list(self._done)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on from a `state_dict()`: the next pass resumes its epoch.

        Raises:
            InvalidRequest: not this loader's state, or one of another number of workers.
        """
        try:
            epoch, done = int(state["epoch"]), [int(b) for b in state["batches"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequest(
                f"not a FeatureDataLoader state ({exc!r}): pass what state_dict() returned"
            ) from None
        if len(done) != self.features.workers:
            raise InvalidRequest(
                f"the state is of a loader with {len(done)} workers, this one has "
                f"{self.features.workers}: resume with num_workers={len(done)}"
            )
        self._epoch, self._done, self._loaded = epoch, done, True


def merge_figures(shares: list[EpochStats]) -> EpochStats:
    """One epoch's figures from its workers' (or ranks') shares: counts, bytes and busy
    seconds add up; the epoch's seconds are its slowest share's; the cut and share are
    the first's (every share runs the plan in force)."""
    first = shares[0]
    merged: dict[str, Any] = {}
    for field in dataclasses.fields(first):
        values = [getattr(s, field.name) for s in shares]
        if field.name in ("epoch", "seconds"):
            merged[field.name] = max(values)
        elif field.name == "skipped":
            merged[field.name] = tuple(k for v in values for k in v)
        elif field.name in ("loss", "accuracy", "cut", "share"):
            merged[field.name] = values[0]
        elif field.name == "server_head":  # a line, not a count: any share's that said
            merged[field.name] = next((v for v in values if v), "")
        else:
            merged[field.name] = sum(values)
    return EpochStats(**merged)


def _as_is(batch: Any) -> Any:
    """The collation of batches that come made."""
    return batch
