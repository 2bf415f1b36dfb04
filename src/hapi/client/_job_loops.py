"""A job's loops - training epochs, evaluation - and the progress that lets one resume."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hapi.client._codec_choice import loop_codec
from hapi.client._epochs import EpochAccounts
from hapi.client._resume import STATE_VERSION, capture_rng, read_state, restore_rng
from hapi.client.distributed import pad
from hapi.client.history import History
from hapi.client.loader import FeatureLoader
from hapi.client.rebatch import Batch
from hapi.data import Transforms
from hapi.errors import InvalidRequest
from hapi.graph import INPUT

if TYPE_CHECKING:
    from hapi.client.job import TransferJob

__all__ = ["EvalResult", "Progress", "evaluate", "fit", "load_state", "state_of"]


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


@contextlib.contextmanager
def loop(
    job: TransferJob, prefix: str, transforms: Transforms, *, train: bool
) -> Iterator[FeatureLoader]:
    """A loader for one loop over `prefix`, under the plan in force (whose router a
    training loop lets re-plan), its sessions closed when the loop ends."""
    config = job.config
    try:
        with job._plans.running(train=train, replan=config.replan) as router:
            codec = loop_codec(config.wire_dtype, config.wire_compression, job._plans.current)
            with job._data.loader(
                prefix, transforms, train=train, router=router, codec=codec
            ) as loader:
                yield loader
    finally:
        job._progress.epoch = None


def fit(
    job: TransferJob,
    epochs: int,
    optimizer: torch.optim.Optimizer,
    progress: Callable[[int, int], None] | None,
) -> History:
    """Train `epochs` epochs from where `job._progress` says (see `TransferJob.fit`)."""
    model, state = job._model, job._progress
    state.optimizer = optimizer
    loss_fn = nn.CrossEntropyLoss()
    with loop(job, job.config.dataset, job.config.train_transforms, train=True) as loader:
        start = state.next_epoch
        # Before anything is in flight: a stats call now does not wait behind streams.
        accounts = EpochAccounts(loader, model.dp.totals if model.dp is not None else None)
        for epoch in range(start, start + epochs):
            state.epoch = epoch
            _train_mode(job, True)
            offset, resumed, state.resumed = state.position, state.resumed, None
            if resumed is not None and offset:
                restore_rng(resumed["rng"])  # as it was after the state's last step
            else:
                # Seed per epoch so dropout in the tail draws the same masks in every plan;
                # per rank too, or the ranks' slices would share their masks.
                torch.manual_seed(job.config.seed * 1_000_003 + epoch + (job.rank << 32))
            order = loader.order(epoch)
            keys = loader.manifest.keys
            place = {keys[j]: i for i, j in enumerate(order)}
            total_loss = correct = seen = compute = 0.0
            # The next epoch's first chunks are fetched while this one drains.
            then = epoch + 1 if epoch + 1 < start + epochs else None
            batches: Iterable[Batch] = loader.batches(epoch, start=offset, then=then)
            if model.dp is not None:  # every rank takes every step, its shard or not
                batches = pad(batches, len(loader) - state.step, model.empty_batch)
            for step, batch in enumerate(batches, state.step + 1):
                t1 = time.thread_time()
                x, y = model.to_device(batch.features, batch.labels)
                mean, right, n = model.step(optimizer, loss_fn, x, y, batch.cut)
                if n:
                    job.history.losses.append(mean)
                total_loss += mean * n
                correct += right
                seen += n
                compute += time.thread_time() - t1
                # Batches arrive in epoch order: the last key's place bounds the rest.
                if batch.keys:
                    state.position = place[batch.keys[-1]] + 1
                state.step = step
                if progress is not None:
                    progress(step, len(loader))
            cut, share = loader.router.applied  # a re-plan pending is the next epoch's
            job.history.epochs.append(
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
    return job.history


@torch.inference_mode()
def evaluate(
    job: TransferJob, prefix: str, progress: Callable[[int, int], None] | None
) -> EvalResult:
    """The model's accuracy and loss on `prefix` (see `TransferJob.evaluate`)."""
    model = job._model
    _train_mode(job, False)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    t0 = time.perf_counter()
    total_loss = correct = seen = 0.0
    with loop(job, prefix, job.config.test_transforms, train=False) as loader:
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


def state_of(job: TransferJob) -> dict[str, Any]:
    """What `fit(resume_from=...)` needs (see `TransferJob.state_dict`)."""
    cut, share = job._plans.in_force()
    state = job._progress
    pending = state.resumed["optimizer"] if state.resumed is not None else None
    return {
        "version": STATE_VERSION,
        "dataset": job.config.dataset,
        "seed": job.config.seed,
        "batch_size": job.config.batch_size,
        "freeze": job.freeze,
        "epoch": state.next_epoch,
        "position": state.position,
        "step": state.step,
        "world_size": job.world_size,
        "rank": job.rank,
        "model": job._model.parts.tail(job.freeze).state_dict(),
        "optimizer": state.optimizer.state_dict() if state.optimizer else pending,
        "plan": {"cut": cut, "share": share},
        "losses": list(job.history.losses),
        "rng": capture_rng(),
    }


def load_state(job: TransferJob, state: Mapping[str, Any]) -> None:
    """Take up a `state_of` (see `TransferJob.load_state_dict`)."""
    state = read_state(state)
    for name, mine in (
        ("dataset", job.config.dataset),
        ("seed", job.config.seed),
        ("batch_size", job.config.batch_size),
        ("freeze", job.freeze),
        ("world_size", job.world_size),
        ("rank", job.rank),
    ):
        theirs = state.get(name, 0 if name == "rank" else 1)  # states from before DDP
        if theirs != mine:
            raise InvalidRequest(
                f"the state is of a job with {name}={theirs!r}, this one has "
                f"{mine!r}: build the job with the options the state was saved from"
            )
    job._model.parts.tail(job.freeze).load_state_dict(state["model"])
    plan = state["plan"]
    job.set_plan(plan["cut"], plan["share"], reason="resumed from a saved state")
    job.history.losses[:] = state["losses"]
    progress = job._progress
    progress.next_epoch, progress.position = state["epoch"], state["position"]
    progress.step = state.get("step", progress.position // job.config.batch_size)
    progress.optimizer = None
    progress.resumed = state
    restore_rng(state["rng"])


def _train_mode(job: TransferJob, train: bool) -> None:
    job._model.parts.train(train, max(job.cut, INPUT))
