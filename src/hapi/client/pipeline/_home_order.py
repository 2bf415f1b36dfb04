"""`home_order`: an epoch's shuffled order regrouped so that each chunk's keys lie beside
one server (`hapi.client.servers.placement`), as WebDataset shuffles within shards.

The permutation is made first, as without placement; then each window of a few dozen
chunks is sorted by home - stably, so each home's keys keep their shuffled order - and
cut into chunks, whose order is shuffled within the window so every server has work at
once. A window is a whole number of chunks, so chunk boundaries stay where they were;
where a home's run ends inside a chunk, that one chunk is mixed.
"""

from __future__ import annotations

import numpy as np

__all__ = ["WINDOW_CHUNKS", "home_order"]

WINDOW_CHUNKS = 16
"""Chunks per home in a window: the mixed chunks where homes meet are one in this many,
and a sample moves at most this many chunks per home from its shuffled place."""


def home_order(
    order: np.ndarray, homes: np.ndarray, *, block: int, seed: int, epoch: int
) -> np.ndarray:
    """`order` (manifest places) regrouped by `homes` (each place's home server).

    Args:
        order: the epoch's shuffled order.
        homes: each manifest place's home (`NO_HOME` where none).
        block: keys per chunk.
        seed: the job seed.
        epoch: the epoch (with `seed`, seeds the chunks' shuffle within windows).
    """
    count = len(np.unique(homes))
    if count < 2 or len(order) <= block:
        return order
    rng = np.random.default_rng([seed, epoch, 0x10CA1])
    window = block * count * WINDOW_CHUNKS
    out: list[np.ndarray] = []
    for start in range(0, len(order), window):
        part = order[start : start + window]
        part = part[np.argsort(homes[part], kind="stable")]
        blocks = [part[i : i + block] for i in range(0, len(part), block)]
        # The epoch's one short chunk stays last, so no chunk boundary moves.
        last = blocks.pop() if len(blocks[-1]) < block else None
        out += [blocks[i] for i in rng.permutation(len(blocks))]
        if last is not None:
            out.append(last)
    return np.concatenate(out)
