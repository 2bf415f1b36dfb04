"""`ReadMeasurement` and `TrainMeasurement`: what one chunk measured, stage by stage.

A chunk's server and link are known when it is read, its trainer when it is trained, a
batch or more later: the loader reports each when it is known, so a drift is seen that
much sooner. `Replanner` weighs them against the plan's profiles (docs/replanning.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hapi.errors import InvalidRequest

__all__ = ["ReadMeasurement", "TrainMeasurement"]


@dataclass(frozen=True, kw_only=True)
class ReadMeasurement:
    """One chunk as the loader read it: the server's and the link's time on it."""

    samples: int
    """Samples read (its keys, less any the server skipped)."""
    bytes: int
    """Bytes that crossed the link for it."""
    cut: int
    """The cut it travelled at: RAW for raw bytes (a local chunk, or the baseline)."""
    server_s: float | None
    """The server's busy time on it, as the server reported it (wall time of reading,
    decoding and the head, not time spent waiting to send: a shared server shows).
    None: the server reported none, no evidence either way."""
    transfer_s: float | None
    """The link's busy time on it: with several chunks streaming at once, its share.
    None: its stream showed the server's pace, not the link's (no evidence either way)."""
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
    chunk: int | str | None = None
    """The chunk's id: its training is the same chunk (None: not known)."""

    def __post_init__(self) -> None:
        _check_counts(self.samples, self.bytes)
        _check_seconds(server_s=self.server_s, transfer_s=self.transfer_s)


@dataclass(frozen=True, kw_only=True)
class TrainMeasurement:
    """One chunk as the trainer consumed it: the trainer's time on it."""

    samples: int
    """Samples trained."""
    cut: int
    """The cut it travelled at: RAW for raw bytes (a local chunk, or the baseline)."""
    trainer_s: float
    """The trainer's compute on it: decoding and the head for a local chunk, the tail."""
    feature_cut: int | None = None
    """Where a raw chunk's samples joined the stream (the hybrid's cut; None: INPUT,
    the trainer ran the whole model). Ignored for pushed-down chunks."""
    issued: float | None = None
    """When it was requested, on the clock its read's `issued` shares (None: not known).
    Trained, it was read: the link turns that ended before then have been claimed by
    every chunk that could have crossed in them (chunks are read in the order requested)."""
    chunk: int | str | None = None
    """The chunk's id: its read is the same chunk (None: not known)."""

    def __post_init__(self) -> None:
        _check_counts(self.samples)
        _check_seconds(trainer_s=self.trainer_s)


def _check_counts(*counts: int) -> None:
    for name, value in zip(("samples", "bytes"), counts, strict=False):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidRequest(f"{name} must be an int >= 0, got {value!r}")


def _check_seconds(**seconds: float | None) -> None:
    for name, value in seconds.items():
        if value is None:
            continue
        if not isinstance(value, int | float) or not 0 <= value < math.inf:
            raise InvalidRequest(f"{name} must be a finite number >= 0, got {value!r}")
