"""`shard_order`: an epoch's order for a sharded dataset, as WebDataset users expect it.

Shards are permuted, their members laid end to end and cut into blocks of a chunk's
size, the blocks of each few shards shuffled and the samples within each block, seeded by
(seed, epoch). Each chunk is one block, read with one ranged request per shard. More:
docs/data.md, "An epoch's order over shards".
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow.compute as pc

from hapi.data.columns import column_of
from hapi.data.shards.members import member_containers

__all__ = ["SHARDS_MIXED", "shard_order", "shard_runs"]

SHARDS_MIXED = 4
"""Shards whose samples are shuffled together (WebDataset's buffer across shards)."""


def shard_runs(keys: Sequence[str]) -> np.ndarray | None:
    """Each key's shard, numbered in the order shards first appear (a key naming a whole
    object is a shard of its own); None when no key names a shard's member. Made once
    for a manifest, `shard_order`'s input every epoch."""
    array = column_of(keys).array
    if not pc.any(pc.match_substring(array, "#")).as_py():
        return None  # no member key: `split_member` needs a '#'
    containers = member_containers(array)
    if containers.null_count == len(containers):
        return None
    # Codes in the order values first appear: the shards' order in the manifest.
    shards = pc.coalesce(containers, array).dictionary_encode().indices
    return shards.to_numpy(zero_copy_only=False).astype(np.int64)


def shard_order(
    shards: np.ndarray | None,
    *,
    seed: int,
    epoch: int,
    block: int,
    group: int = SHARDS_MIXED,
    ranks: int = 1,
    batch: int = 0,
) -> np.ndarray | None:
    """The epoch's order of the manifest's indices, or None when no key names a shard's
    member (then any permutation reads as well as another).

    Args:
        shards: each key's shard (`shard_runs`): each shard's members in their stored order.
        seed: the job seed.
        epoch: the epoch; each gives its own order.
        block: consecutive members kept together (the loader's chunk size: its chunks
            then fall on blocks).
        group: shards shuffled together.
        ranks: data-parallel ranks, each taking its `batch` of every global batch of
            `batch` x `ranks` (`Shard.take`): with `batch` dividing `block`, the blocks are
            interleaved so that each rank's part of the order is whole blocks.
        batch: the per-rank batch size (with `ranks`).
    """
    if shards is None:
        return None
    rng = np.random.default_rng([seed, epoch])
    by_shard = np.argsort(shards, kind="stable")
    runs = np.split(by_shard, np.cumsum(np.bincount(shards))[:-1])
    picked = [np.asarray(runs[i], dtype=np.int64) for i in rng.permutation(len(runs))]
    stream = np.concatenate(picked)
    # Blocks are cut from the shards laid end to end, not shard by shard: a shard's short
    # last block would shift every chunk after it off its block, and a chunk astride two
    # shuffled blocks reads a scattered part of each (a request per few members).
    shard_of = np.repeat(np.arange(len(picked)), [len(r) for r in picked])
    starts = np.arange(0, len(stream), block)
    groups: dict[int, list[int]] = {}
    for b, at in enumerate(starts):
        groups.setdefault(int(shard_of[at]) // group, []).append(b)
    out: list[np.ndarray] = []
    short = len(stream) % block != 0
    for g in sorted(groups):
        blocks = groups[g]
        # The one short block (the epoch's last) stays last, so no chunk boundary moves.
        last = blocks.pop() if short and blocks[-1] == len(starts) - 1 else None
        shuffled = [blocks[i] for i in rng.permutation(len(blocks))]
        for b in shuffled + ([last] if last is not None else []):
            out.append(rng.permutation(stream[starts[b] : starts[b] + block]))
    if ranks > 1 and batch > 0 and block % batch == 0:
        out = _interleave(out, block, ranks, batch)
    return np.concatenate(out)


def _interleave(blocks: list[np.ndarray], block: int, ranks: int, batch: int) -> list[np.ndarray]:
    # Rank r takes the r-th `batch` of each global batch: a round of `ranks` blocks laid
    # out batch by batch gives rank r all of the round's r-th block (else a rank's chunk is
    # a scattered part of several blocks, a request per few members). A tail of fewer
    # than `ranks` full blocks stays as it is.
    out: list[np.ndarray] = []
    full = sum(len(b) == block for b in blocks) // ranks * ranks
    for first in range(0, full, ranks):
        round_ = blocks[first : first + ranks]
        out += [b[s : s + batch] for s in range(0, block, batch) for b in round_]
    return out + blocks[full:]
