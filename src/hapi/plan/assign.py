"""`assign`: which chunks the trainer computes itself, spread evenly over the epoch."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

from hapi.plan.cost import locals_before
from hapi.plan.plan import Plan

__all__ = ["assign"]

_Id = TypeVar("_Id")


def assign(chunk_ids: Sequence[_Id], share: float | Plan) -> tuple[bool, ...]:
    """For each chunk, in order, whether the trainer computes it from raw bytes.

    Chunk i is local when ceil(f·(i+1)) > ceil(f·i), as Bresenham draws a line: ceil(f·n)
    of n chunks are local, evenly interleaved with the pushed-down ones, so both tiers stay
    busy all epoch rather than one after the other. Rounding up puts a local chunk first
    (the trainer starts on raw bytes while the server computes) and, at f = j/n, a pushed
    chunk last (only its short tail is left after the server's last chunk): the ends the
    cost model charges. The answer depends only on the positions and the share, so every
    rank and every retry agrees. When the share changes mid-epoch, pass only the chunks
    not yet issued: those issued keep their side.

    Args:
        chunk_ids: the chunks in the order they will be issued.
        share: the local share f in [0, 1], or a plan (RAW plans are all local).
    """
    f = share.local_share if isinstance(share, Plan) else float(share)
    if not 0.0 <= f <= 1.0 or math.isnan(f):
        raise ValueError(f"local share must be in [0, 1], got {f}")
    marks = [locals_before(f, i) for i in range(len(chunk_ids) + 1)]
    return tuple(marks[i + 1] > marks[i] for i in range(len(chunk_ids)))
