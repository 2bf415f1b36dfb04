"""`shard_order`: an epoch's order for a sharded dataset, as WebDataset users expect it.

WebDataset shuffles shards, then samples within a bounded buffer across a few shards.
hapi's loader owns the order as a permutation of manifest indices, seeded by (seed,
epoch) so that resume and exactly-once hold; for shards it is this one: shards permuted,
taken a few at a time, each one's samples cut into blocks of consecutive members (a
chunk's worth), the blocks of the group shuffled and the samples within each block. A
chunk is then (mostly) one block: a run of one shard, read with one ranged request.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hapi.data.members import split_member

__all__ = ["SHARDS_MIXED", "shard_order"]

SHARDS_MIXED = 4
"""Shards whose samples are shuffled together (WebDataset's buffer across shards)."""


def shard_order(
    keys: Sequence[str], *, seed: int, epoch: int, block: int, group: int = SHARDS_MIXED
) -> np.ndarray | None:
    """The epoch's order of the indices of `keys`, or None when no key names a shard's
    member (then any permutation reads as well as another).

    Args:
        keys: the manifest's keys, each shard's members in their stored order.
        seed: the job seed.
        epoch: the epoch; each gives its own order.
        block: consecutive members kept together (the loader's chunk size).
        group: shards shuffled together.
    """
    shards: dict[str, list[int]] = {}
    members = 0
    for i, key in enumerate(keys):
        parts = split_member(key)
        members += parts is not None
        shards.setdefault(parts[0] if parts else key, []).append(i)
    if not members:
        return None
    rng = np.random.default_rng([seed, epoch])
    runs = list(shards.values())
    picked = [runs[i] for i in rng.permutation(len(runs))]
    out: list[np.ndarray] = []
    for start in range(0, len(picked), group):
        blocks = [
            run[b : b + block]
            for run in picked[start : start + group]
            for b in range(0, len(run), block)
        ]
        for b in rng.permutation(len(blocks)):
            out.append(rng.permutation(np.asarray(blocks[b], dtype=np.int64)))
    return np.concatenate(out) if out else np.arange(0)
