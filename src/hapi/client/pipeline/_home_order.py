"""`home_order`: an epoch's shuffled order regrouped so that each chunk's keys lie beside
one server (`hapi.client.servers.placement`), as WebDataset shuffles within shards.

Each window of the permutation (a few dozen chunks) is split by home into whole chunks,
each home's keys in their shuffled order; each home's chunks are spread evenly over the
window, every home's last at its end, so every server has work until the window ends.
A home's keys short of a whole chunk wait for the next window; the epoch's last chunks
mix homes. Every chunk but the last is whole: boundaries stay at multiples of the size.
"""

from __future__ import annotations

import numpy as np

__all__ = ["WINDOW_CHUNKS", "home_order"]

WINDOW_CHUNKS = 16
"""Chunks per home in a window: how far (in chunks per home) a sample moves from its
shuffled place, about."""


def home_order(
    order: np.ndarray, homes: np.ndarray, *, block: int, seed: int, epoch: int
) -> np.ndarray:
    """`order` (manifest places) regrouped by `homes` (each place's home server).

    Args:
        order: the epoch's shuffled order.
        homes: each manifest place's home (`NO_HOME` where none: a home of its own).
        block: keys per chunk.
        seed: the job seed.
        epoch: the epoch (with `seed`, seeds the chunks' shuffle within windows).
    """
    kinds = np.unique(homes[order])
    if len(kinds) < 2 or len(order) <= block:
        return order
    rng = np.random.default_rng([seed, epoch, 0x10CA1])
    window = block * len(kinds) * WINDOW_CHUNKS
    carried = {int(h): order[:0] for h in kinds}
    out: list[np.ndarray] = []
    for start in range(0, len(order), window):
        part = order[start : start + window]
        blocks: list[np.ndarray] = []
        at: list[np.ndarray] = []
        for home in np.unique(homes[part]).tolist():
            mine = np.concatenate([carried[home], part[homes[part] == home]])
            whole = len(mine) - len(mine) % block
            if whole:
                blocks += np.split(mine[:whole], whole // block)
                # Its k-th of n chunks at (k + 1) / n of the window: evenly spread, and
                # every home's last at the window's end, so that no server runs out of
                # its own chunks while another has a few left (at an epoch's end, they
                # were taken away from home).
                n = whole // block
                at.append((np.arange(n) + 1) / n)
            carried[home] = mine[whole:]
        if blocks:
            # Ties (homes with as many chunks) in a random order.
            shuffled = rng.permutation(len(blocks))
            ranks = shuffled[np.argsort(np.concatenate(at)[shuffled], kind="stable")]
            out += [blocks[i] for i in ranks]
    # The epoch's end: the homes' remainders, largest first, so that each of these
    # chunks is mostly one home's; the one short chunk last.
    rest = sorted(carried.values(), key=len, reverse=True)
    out.append(np.concatenate(rest))
    return np.concatenate(out)
