"""`StageRates`: each stage's measured time against its profiled time, as scales.

Each stage keeps an exponentially weighted ratio of measured to profiled time (sums of
both, decayed alike, so large chunks weigh more than small ones) and a longer window of
recent pairs. The first plan's profiles scaled by those ratios predict what each option
would cost now (docs/replanning.md, "Rates").
"""

from __future__ import annotations

import itertools
from collections import deque
from math import sqrt

from hapi.plan.cost import STAGES, estimate
from hapi.plan.plan import Plan
from hapi.plan.profiles import LinkProfile, ServerProfile, TrainerProfile
from hapi.plan.trainer_split import TrainerSplit

__all__ = ["Profiles", "StageRates"]

Profiles = tuple[ServerProfile, TrainerProfile, LinkProfile]
"""A server's, a trainer's and a link's profile, in that order."""

MIN_SCATTER_PAIRS = 6
"""Chunks a stage must have measured before their scatter is believed (`noise`)."""
PRIOR_SCATTER = 0.2
"""A chunk's scatter until then, relative: chunks on the 2-core machines the planner's
sweeps ran on scatter about this much (their runs of a few chunks read 0.7-1.4x)."""
SCATTER_CHUNKS = 64
"""The chunks per stage whose scatter `noise` reads."""
DIFFERENCE_MEDIAN = 0.954
"""The median of |x1 - x0| for two independent draws of unit standard deviation
(0.6745 x sqrt 2, normal): it turns the median difference into a standard deviation."""


class StageRates:
    """Per stage, the measured rate against the first plan's profiles.

    Args:
        base: the first plan's profiles, which every scale multiplies.
        weight: weight of the newest chunk in each stage's moving average.
        min_stage_share: a stage below this share of the busiest is too idle to tell.
        link_busy_share: a link below this share of the busiest is believed faster only
            up to the probe's rate.
        window: (measured, profiled) pairs kept per stage for the longer window.
    """

    def __init__(
        self,
        base: Profiles,
        *,
        weight: float,
        min_stage_share: float,
        link_busy_share: float,
        window: int,
    ) -> None:
        self.base = base
        """The first plan's profiles."""
        self.planned = dict.fromkeys(STAGES, 1.0)
        """Per stage, the scale the plan in force was made with."""
        self._weight = weight
        self.trainer_split = TrainerSplit(weight)
        """A hybrid trainer's local and pushed chunks, each kind at its own rate."""
        self._min_stage_share = min_stage_share
        self._link_busy_share = link_busy_share
        self._measured = dict.fromkeys(STAGES, 0.0)
        self._profiled = dict.fromkeys(STAGES, 0.0)
        # Per stage, its last measured (measured, profiled) pairs - a chunk's server and
        # link are observed when it is read, its trainer when it is trained: the last
        # `min_chunks` restart the averages, the whole window is what `drift.settled` weighs a
        # change by (no re-plan restarts it).
        self._window: dict[str, deque[list[float]]] = {s: deque(maxlen=window) for s in STAGES}
        # Per stage, a longer history for `noise`: a spread read from a dozen chunks is
        # itself too noisy to tell chance from a change by.
        self._history: dict[str, deque[list[float]]] = {
            s: deque(maxlen=SCATTER_CHUNKS) for s in STAGES
        }
        # Per stage, the pairs measured since the plan in force was made: a re-plan
        # restarts from its last few of those only. A stage the drifting chunks did not
        # measure (trainings carry no link time) keeps its average, not pairs from before
        # the last change (a link restarted from one pair after its drop and two before it
        # read 3x faster than it was).
        self._fresh = dict.fromkeys(STAGES, 0)

    def add(self, pairs: dict[str, list[float]], averaged: dict[str, tuple[float, float]]) -> None:
        """Take in one chunk: per stage, its (measured, profiled) pair for the window, and
        what the moving average takes in (the link's differs: `LinkTurns.pair`)."""
        for stage, pair in pairs.items():
            if pair[1] > 1e-12:
                self._window[stage].append(pair)
                self._history[stage].append(pair)
                self._fresh[stage] += 1
        decay = 1.0 - self._weight
        for stage, (measured, profiled) in averaged.items():
            self._measured[stage] = decay * self._measured[stage] + measured
            self._profiled[stage] = decay * self._profiled[stage] + profiled

    def scales(self) -> dict[str, float]:
        """Per stage: measured time / the first plan's profiled time (1 before any data).
        A stage too idle to tell, below `min_stage_share` of the busiest, keeps the scale
        the plan in force was made with unless it measured faster; a link below
        `link_busy_share` of the busiest is believed faster only up to the probe's rate."""
        busiest = max(self._measured.values())
        scales = {}
        for s in STAGES:
            planned = self.planned[s]
            if self._profiled[s] <= 1e-12:
                scales[s] = planned
                continue
            ratio = self._measured[s] / self._profiled[s]
            if s == "link":
                # A link that waits for the server gets the next chunk's first bytes while
                # it waits, so its chunks' turns read fast: from a link less busy than
                # about the busiest stage, a faster reading is believed only up to the
                # probe's rate (a link that recovers from a drop), not beyond it.
                busy = self._measured[s] >= self._link_busy_share * busiest
                scales[s] = ratio if busy else max(ratio, min(planned, 1.0))
                continue
            idle = self._measured[s] < self._min_stage_share * busiest
            # An idle stage's time is mostly fixed costs, so its ratio only bounds its
            # rate from above: believed when it says faster than planned, not slower.
            scales[s] = min(ratio, planned) if idle else ratio
        return scales

    def measured_profiles(self) -> Profiles:
        """The first plan's profiles scaled to the rates measured."""
        return self.profiles(self.scales())

    def profiles(self, scales: dict[str, float]) -> Profiles:
        """The first plan's profiles scaled by `scales` (the trainer's local work by what
        its local chunks measured beside its pushed ones: `trainer_split`)."""
        server, trainer, link = self.base
        front, tail = self.trainer_split.factors(scales["trainer"])
        return (
            server.scaled(scales["server"]),
            trainer.scaled(tail, front=front),
            link.scaled(scales["link"]),
        )

    def predicted_epoch_s(self, plan: Plan, scales: dict[str, float] | None = None) -> float:
        """`plan`'s epoch time at the measured rates (or at `scales`)."""
        server, trainer, link = self.profiles(self.scales() if scales is None else scales)
        return estimate(plan.cut, plan.share, server, trainer, link, plan.workload).epoch_s

    def noise(self, run: int) -> dict[str, float]:
        """Per compute stage, the standard error of a rate read from its last `run`
        chunks, relative to the rate, from how widely its last `SCATTER_CHUNKS` chunks'
        own ratios scatter (from medians, as robust as `restart_from_recent`'s).

        Each chunk weighs its profiled time, and so the run counts as fewer chunks where
        a few dominate it: a hybrid's run of three holds one pushed chunk among raw reads.
        `PRIOR_SCATTER` until it has measured `MIN_SCATTER_PAIRS` chunks. 0 for the link:
        a chunk's turn shares the link with the chunks in flight, so one chunk's link time
        says little alone (`LinkTurns` and `Replanner._sudden` weigh it instead).
        """
        noise = dict.fromkeys(STAGES, 0.0)
        for stage in ("server", "trainer"):
            pairs = list(self._history[stage])
            weights = [p for _, p in pairs[-run:]]
            if not weights:
                continue
            chunks = sum(weights) ** 2 / sum(w * w for w in weights)
            if len(pairs) < MIN_SCATTER_PAIRS:
                noise[stage] = PRIOR_SCATTER / sqrt(chunks)
                continue
            # From successive chunks' differences, each weighing the lighter chunk of the
            # two: a real change of rate is one large difference among many, where it
            # would widen a spread around a median as much as the noise it hides in.
            steps = [
                [abs(m1 / p1 - m0 / p0) * min(p0, p1), min(p0, p1)]
                for (m0, p0), (m1, p1) in itertools.pairwise(pairs)
            ]
            scatter = _weighted_median(steps) / DIFFERENCE_MEDIAN
            noise[stage] = scatter / _weighted_median(pairs) / sqrt(chunks)
        return noise

    def window_profiles(self) -> Profiles:
        """The first plan's profiles scaled to the longer window's rates."""
        return self.profiles(self.window_scales())

    def window_scales(self) -> dict[str, float]:
        """Per stage, the longer window's rate: the ratio of its sums (a stage too idle in
        it to tell keeps its scale now)."""
        scales = self.scales()
        totals = {s: sum(m for m, _ in self._window[s]) for s in STAGES}
        busiest = max(totals.values())
        for stage in STAGES:
            profiled = sum(p for _, p in self._window[stage])
            if profiled > 1e-12 and totals[stage] >= self._min_stage_share * busiest:
                scales[stage] = totals[stage] / profiled
        return scales

    def averages(self) -> tuple[dict[str, float], dict[str, float]]:
        """The moving averages as they are, for `restore`."""
        return dict(self._measured), dict(self._profiled)

    def restore(self, averages: tuple[dict[str, float], dict[str, float]]) -> None:
        """Put back the moving averages `averages` took (a restart not acted on)."""
        self._measured, self._profiled = averages

    def rebase(self, scales: dict[str, float] | None = None) -> None:
        """Measure drift from the rates now (or from `scales`): a plan was made or adopted
        at them."""
        self.planned = self.scales() if scales is None else dict(scales)
        self._fresh = dict.fromkeys(STAGES, 0)

    def restart_from_recent(self, count: int) -> None:
        """Restart each stage's moving average at the rate of its last `count` pairs (the
        chunks that showed the drift), of those measured under the plan in force.

        The server's and the trainer's: the median of the chunks' own ratios, so that one
        stalled chunk among them (a retry, a pause) does not set the rate, each weighted by
        its profiled time - a hybrid's raw chunk costs the server a read, mostly fixed
        costs, and its ratio says little of the head's rate. The link's: the ratio of
        their sums, as the chunks shared it (docs/replanning.md).
        """
        decay = 1.0 - self._weight
        recent = {s: _last(self._window[s], min(count, self._fresh[s])) for s in STAGES}
        totals = {s: sum(m for m, _ in recent[s]) for s in STAGES}
        busiest = max(totals.values())
        for stage in STAGES:
            pairs = recent[stage]
            if not pairs or totals[stage] < self._min_stage_share * busiest:
                # Not measured since the plan in force was made, or too idle in these few
                # chunks to tell (a link's few bytes may all have come during another
                # chunk's turn): its longer average stands.
                continue
            if stage == "link":
                rate = sum(m for m, _ in pairs) / sum(p for _, p in pairs)
            else:
                rate = _weighted_median(pairs)
            profiled = 0.0
            for _, planned in pairs:
                profiled = decay * profiled + planned
            self._measured[stage] = rate * profiled
            self._profiled[stage] = profiled


def _last(pairs: deque[list[float]], count: int) -> list[list[float]]:
    return list(pairs)[-count:] if count > 0 else []


def _weighted_median(pairs: list[list[float]]) -> float:
    """The median of measured / profiled over (measured, profiled) pairs, each weighted by
    its profiled time."""
    ordered = sorted(pairs, key=lambda pair: pair[0] / pair[1])
    half = sum(p for _, p in ordered) / 2
    seen = 0.0
    for measured, profiled in ordered:
        seen += profiled
        if seen >= half:
            return measured / profiled
    return ordered[-1][0] / ordered[-1][1]
