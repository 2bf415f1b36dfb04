"""`ChunkMeasurement`: what one chunk measured, the input of re-planning.

The loader reports each chunk's samples, bytes and the time each stage spent on it;
`Replanner` weighs these against the plan's profiles (docs/replanning.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hapi.errors import InvalidRequest

__all__ = ["ChunkMeasurement"]


@dataclass(frozen=True, kw_only=True)
class ChunkMeasurement:
    """One chunk as the loader received it and the trainer consumed it."""

    samples: int
    """Samples in the chunk (its keys, less any the server skipped)."""
    bytes: int
    """Bytes that crossed the link for it."""
    cut: int
    """The cut it travelled at: RAW for raw bytes (a local chunk, or the baseline)."""
    server_s: float | None
    """The server's busy time on it, as the server reported it (wall time of reading,
    decoding and the head, not time spent waiting to send: a shared server shows).
    None, as for each stage: not measured, no evidence either way."""
    transfer_s: float | None
    """The link's busy time on it: with several chunks streaming at once, its share.
    None: its stream showed the server's pace, not the link's (no evidence either way)."""
    trainer_s: float | None
    """The trainer's compute on it: decoding and the head for a local chunk, the tail.
    (A chunk's server and link are known when it is read, its trainer when it is trained:
    the loader observes the two apart, so a drift is seen a batch sooner.)"""
    transfer_buffered: bool = False
    """Its bytes may have crossed before its turn (the server was done with it while the
    chunk before it was read, and the buffers between took them in): `transfer_s` is then
    a lower bound, evidence of a link as slow as that but not of a faster one. Its bytes
    are credited instead to what the turns before it took beyond their own (`LinkTurns`)."""
    issued: float | None = None
    """When it was requested, on a clock every chunk shares (None: not known). A buffered
    chunk's bytes crossed in a turn that ended after it was requested, not before."""
    read_end: float | None = None
    """When its read ended, on the same clock (None: not known)."""
    feature_cut: int | None = None
    """Where a raw chunk's samples joined the stream (the hybrid's cut; None: INPUT,
    the trainer ran the whole model). Ignored for pushed-down chunks."""
    chunk: int | str | None = None
    """The chunk's id, for the record."""

    def __post_init__(self) -> None:
        for name in ("samples", "bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidRequest(f"{name} must be an int >= 0, got {value!r}")
        for name in ("server_s", "transfer_s", "trainer_s"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, int | float) or not 0 <= value < math.inf:
                raise InvalidRequest(f"{name} must be a finite number >= 0, got {value!r}")
