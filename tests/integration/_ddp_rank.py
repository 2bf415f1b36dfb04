"""One rank of `test_ddp`, run by torchrun: `_ddp_rank.py ADDRESS OUT_DIR`.

It trains a job for two epochs as this rank, evaluates it, trains a second job that is
stopped mid-epoch and resumed from this rank's saved state, lists the keys its shard
delivers, and writes what it saw to `OUT_DIR/rank<r>.pt` for the test to compare.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch

from hapi.client import FeatureLoader, TransferJob, connect
from hapi.client.pipeline.distributed import Shard
from hapi.client.servers.sessions import Sessions
from hapi.data import Transforms
from hapi.wire import SessionRequest

# The test's single process trains with BATCH x 2 and these same options.
BATCH = 4
OPTIONS: dict[str, object] = {
    "freeze": "layer4",  # no batch norm in the tail: it would normalise per rank's slice
    "cut": None,
    "image_size": 64,
    "batch_size": BATCH,
    "chunk_size": 5,
    "prefetch": 2,
    "seed": 3,
    "wire_dtype": "fp32",
    "exact": True,  # features bit for bit: what differs is only how the tail sums
}
MODEL = {"name": "resnet18", "num_classes": 3}
LR = 0.002


class _Stop(Exception):
    """Stands in for a trainer killed mid-epoch (every rank at the same step)."""


def main(address: str, out: Path) -> None:
    job = TransferJob(MODEL, "train", address, **OPTIONS)
    assert job.world_size == 2, job.world_size
    job.fit(2, lr=LR)
    evaluation = job.evaluate()
    rank = job.rank
    # Both ranks are done with the job: what the server sent it, as the server counts.
    torch.distributed.barrier()
    served = served_samples(address)

    stopped = TransferJob(MODEL, "train", address, **OPTIONS)

    def stop(step: int, total: int) -> None:
        if (len(stopped.history.epochs), step) == (1, 2):
            raise _Stop

    with contextlib.suppress(_Stop):
        stopped.fit(2, lr=LR, progress=stop)
    assert len(stopped.history.epochs) == 1, "the stop did not happen"
    state = out / f"state{rank}.pt"
    stopped.save_state(state)
    resumed = TransferJob(MODEL, "train", address, **OPTIONS)
    resumed.fit(1, lr=LR, resume_from=state)

    # The first plan, measured by rank 0 and taken by every rank.
    auto = TransferJob(MODEL, "train", address, **{**OPTIONS, "cut": "auto"})
    plan = auto.plan
    assert plan is not None

    keys = _shard_keys(address, rank, job.world_size, len(job.history.epochs))
    torch.save(
        {
            "losses": job.history.losses,
            "epochs": [(e.loss, e.accuracy, e.samples) for e in job.history.epochs],
            "tail": {k: v.detach().clone() for k, v in job.tail.state_dict().items()},
            "eval": (evaluation.accuracy, evaluation.loss, evaluation.samples),
            "resumed_losses": resumed.history.losses,
            "resumed_tail": {k: v.detach().clone() for k, v in resumed.tail.state_dict().items()},
            "plan": (plan.cut, plan.share, plan.reason),
            "keys": keys,
            "served": served,
        },
        out / f"rank{rank}.pt",
    )


def served_samples(address: str) -> int:
    """Samples the server sent over all its sessions so far, open and closed."""
    with connect(address) as conn:
        stats = conn.stats()
    return sum(s.samples for s in [*stats.sessions.values(), *stats.closed_sessions.values()])


def _shard_keys(address: str, rank: int, world: int, epochs: int) -> list[list[str]]:
    """The keys a loader with this rank's shard (the job's own) delivers in each epoch."""
    conn = connect(address)

    def request(cut: int) -> SessionRequest:
        transforms = Transforms.eval(64).to_dict()
        return SessionRequest(model=MODEL, cut=cut, transforms=transforms, image_size=64)

    with conn, Sessions(conn, request) as sessions:
        loader = FeatureLoader(
            conn,
            sessions,
            conn.manifest("train"),
            batch_size=BATCH,
            chunk_size=5,
            seed=3,
            shard=Shard(rank=rank, world=world),
        )
        return [[k for b in loader.batches(e) for k in b.keys] for e in range(epochs)]


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
