"""Data-parallel training: W ranks (`torchrun`) train one model as one process would.

Each rank runs its own `TransferJob`, fetches only its `Shard` of every epoch (a slice of
each global batch of `batch_size` x W) and back-propagates the sum of its losses times
W / n, so DDP's mean over the ranks is the combined batch's gradient; DDP wraps the tail
from the freeze point only, every step all-reduces the metrics once, and a rank's resume
state is its own. Why each piece is so: `docs/distributed.md`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from hapi.client.pipeline.history import EpochStats
from hapi.errors import InvalidRequest

__all__ = ["DataParallel", "Shard", "pad"]

T = TypeVar("T")


@dataclass(frozen=True)
class Shard:
    """Rank `rank`'s part of every epoch when `world` ranks train together.

    Raises:
        InvalidRequest: a rank outside 0..world-1.
    """

    rank: int
    world: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise InvalidRequest(
                f"rank must be in 0..{self.world - 1} (world size {self.world}), got {self.rank}"
            )

    def take(self, order: np.ndarray, batch_size: int) -> np.ndarray:
        """This rank's places of an epoch's global `order`, in order: the rank-th slice of
        each global batch of `batch_size` x world (the last one split evenly)."""
        step = batch_size * self.world
        parts = []
        for start in range(0, len(order), step):
            n = min(step, len(order) - start)
            lo, hi = _slice(n, self.rank, self.world)
            parts.append(order[start + lo : start + hi])
        return np.concatenate(parts) if parts else order[:0]

    def steps(self, samples: int, batch_size: int) -> int:
        """Training steps every rank takes in an epoch of `samples`: the global batches."""
        return -(-samples // (batch_size * self.world))


def _slice(n: int, rank: int, world: int) -> tuple[int, int]:
    """Rank's [lo, hi) of a global batch of `n`: `n // world` each, the first
    `n % world` ranks one more. Full global batches give every rank `batch_size`."""
    base, extra = divmod(n, world)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


class DataParallel:
    """A job's data-parallel side: its rank, the DDP-wrapped tail and the collectives.

    Build it with `start`. Every method that communicates must be called by every rank in
    the same order (the job does so: each step, each epoch's end, each evaluation).

    Args:
        rank: this process's rank.
        world: the number of ranks.
        device: where this rank trains.
    """

    def __init__(self, rank: int, world: int, device: torch.device) -> None:
        self.shard = Shard(rank=rank, world=world)
        self.device = device
        self._wrapped: DistributedDataParallel | None = None

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def world(self) -> int:
        return self.shard.world

    @classmethod
    def start(cls, device: str, setting: bool | None) -> DataParallel | None:
        """Join the default process group, initialising it from torchrun's environment
        when nobody has yet: gloo for a CPU trainer, NCCL for CUDA. A bare `cuda` device
        becomes this rank's GPU (`LOCAL_RANK`).

        Args:
            device: the job's device option.
            setting: the job's `distributed` option: None joins when there are several
                ranks, True requires them, False trains alone.

        Returns:
            None when the job trains alone (one rank, or `setting` False).

        Raises:
            InvalidRequest: `setting` True without torchrun's environment or a process group.
        """
        if setting is False:
            return None
        initialised = dist.is_available() and dist.is_initialized()
        env_world = int(os.environ.get("WORLD_SIZE", "1"))
        if not initialised and (env_world <= 1 or not dist.is_available()):
            if setting:
                raise InvalidRequest(
                    "distributed=True needs several ranks: run under torchrun "
                    "(`torchrun --nproc_per_node N script.py`) or call "
                    "torch.distributed.init_process_group first"
                )
            return None
        where = torch.device(device)
        if where.type == "cuda" and where.index is None:
            where = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        if where.type == "cuda":
            torch.cuda.set_device(where)
        if not initialised:
            dist.init_process_group("nccl" if where.type == "cuda" else "gloo")
        if dist.get_world_size() == 1:
            return None
        return cls(dist.get_rank(), dist.get_world_size(), where)

    def wrap(self, tail: nn.Module) -> nn.Module:
        """`tail` (the tail from the freeze point) in DistributedDataParallel, wrapped
        once: building it broadcasts rank 0's weights, so every rank starts equal."""
        if self._wrapped is None or self._wrapped.module is not tail:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self._wrapped = DistributedDataParallel(tail, device_ids=ids)
        return self._wrapped

    def loss(self, out: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, float, int, int]:
        """The loss this rank back-propagates, and the global batch's figures.

        Returns:
            (loss, mean loss, correct, samples): `loss` is this rank's cross-entropy sum
            times world / samples, so that DDP's mean of the ranks' gradients is the
            gradient of the global batch's mean loss; the rest are the global batch's.
        """
        total = F.cross_entropy(out, labels, reduction="sum")
        correct = (out.argmax(1) == labels).sum()
        figures = torch.stack(
            [total.detach(), correct.to(total.dtype), total.new_tensor(float(len(labels)))]
        )
        dist.all_reduce(figures)
        loss_sum, right, n = figures.tolist()
        samples = max(int(n), 1)
        return total * (self.world / samples), loss_sum / samples, int(right), int(n)

    def sum(self, values: Sequence[float]) -> list[float]:
        """`values` summed over the ranks (float64, so byte counts stay exact)."""
        figures = torch.tensor(values, dtype=torch.float64, device=self._comm_device)
        dist.all_reduce(figures)
        return [float(v) for v in figures.tolist()]

    def totals(self, figures: EpochStats) -> EpochStats:
        """An epoch's figures with every rank's bytes, chunks and retries summed (the loss,
        accuracy and samples are global already); times and skipped keys stay this rank's."""
        names = (
            "bytes_received",
            "chunks_local",
            "chunks_pushed",
            "retries",
            "cached",
            "server_cached",
            "server_compiled",
            "cache_write_failures",
            "read_bytes",
            "placed_bytes",
            "local_bytes",
        )
        summed = self.sum([getattr(figures, n) for n in names])
        totals: dict[str, Any] = {n: int(v) for n, v in zip(names, summed, strict=True)}
        return dataclasses.replace(figures, **totals)

    def from_rank0(self, make: Callable[[], T]) -> T:
        """`make()` run on rank 0 only, its result sent to every rank (pickled between the
        job's own processes, never over the wire to a server)."""
        box: list[object] = [make() if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]  # type: ignore[return-value]

    @property
    def _comm_device(self) -> torch.device:
        # NCCL all-reduces only CUDA tensors; gloo takes CPU ones (and would copy CUDA's).
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")


def pad(batches: Iterable[T], steps: int, empty: Callable[[], T]) -> Iterator[T]:
    """`batches`, then `empty()` until `steps` were yielded: a rank whose shard ran out
    still takes its part in every step's all-reduce."""
    n = 0
    for batch in batches:
        n += 1
        yield batch
    for _ in range(steps - n):
        yield empty()
