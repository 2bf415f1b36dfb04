"""A feature cache directory's files, as a test damages them: where each entry lies."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hapi.cache._index import RECORD

__all__ = ["flip_entries"]


def flip_entries(root: Path, every: int = 1, *, limit: int | None = None) -> int:
    """Flip a byte in the payload of every `every`-th entry the cache at `root` indexes (at
    most `limit`); the number flipped."""
    flipped = 0
    for index in sorted(root.glob("v2/*/*.idx")):
        data = index.read_bytes()
        records = np.frombuffer(data[: len(data) // RECORD.itemsize * RECORD.itemsize], RECORD)
        segment = index.with_suffix(".seg")
        body = bytearray(segment.read_bytes())
        for record in records[::every]:
            if limit is not None and flipped >= limit:
                break
            body[int(record["offset"]) + int(record["length"]) - 20] ^= 0xFF
            flipped += 1
        segment.write_bytes(bytes(body))
    return flipped
