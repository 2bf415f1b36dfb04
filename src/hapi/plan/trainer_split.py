"""`TrainerSplit`: a hybrid trainer's two kinds of work, each at its own measured rate.

A trainer runs the tail (and receives) for a pushed chunk, and decodes, runs the front and
the tail for a local one. One scale for both, read mostly from pushed chunks, misprices
the local ones: in the planner's sweep at 1 Gbit/s (ResNet-18 to `layer3`) pushed chunks
trained at 0.88x their profile and local ones at about 1.15x, so a trainer that looked
fast drew a 6% local share up to 25%, and the epoch ran 1.2x longer (docs/replanning.md,
"Rates").
"""

from __future__ import annotations

__all__ = ["TrainerSplit"]

BOUND = 4.0
"""The front's factor stays within this factor of the tail's: a few local chunks whose
tail dominates could otherwise fit a front at any rate."""


class TrainerSplit:
    """Moving sums of pushed chunks' (measured, profiled) and local chunks' (measured,
    profiled front, profiled tail) training, decayed alike per chunk of its kind.

    Args:
        weight: the newest chunk's weight in each moving sum.
    """

    def __init__(self, weight: float) -> None:
        self._decay = 1.0 - weight
        self._pushed = [0.0, 0.0]
        self._local = [0.0, 0.0, 0.0]

    def add_pushed(self, measured: float, profiled: float) -> None:
        """A pushed chunk's training: its seconds and the profile's."""
        self._pushed = [
            self._decay * a + b for a, b in zip(self._pushed, (measured, profiled), strict=True)
        ]

    def add_local(self, measured: float, front: float, tail: float) -> None:
        """A local chunk's training: its seconds, and the profile's for its decode and
        front, and for its tail."""
        self._local = [
            self._decay * a + b for a, b in zip(self._local, (measured, front, tail), strict=True)
        ]

    def factors(self, scale: float) -> tuple[float, float]:
        """(front, tail) factors for a trainer measured at `scale` overall: `scale` for both
        until both kinds of chunk were measured; then the tail's (and receiving's) is the
        pushed chunks' rate and the front's (and decoding's) what the local chunks took
        beyond their tail at that rate, both relative to their mix's rate so that `scale`
        (which re-plans restart and idle stages bound) still sets the level."""
        measured, profiled = self._pushed
        local, front, tail = self._local
        if profiled <= 1e-12 or front <= 1e-12:
            return scale, scale
        pushed = measured / profiled
        fitted = min(max((local - pushed * tail) / front, pushed / BOUND), pushed * BOUND)
        mix = (measured + local) / (profiled + front + tail)
        return scale * fitted / mix, scale * pushed / mix
