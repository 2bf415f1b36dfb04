"""`DriftWatch`: when the plan in force no longer fits the measured rates.

A plan has drifted when its predicted epoch at the measured rates, or a stage's rate, has
moved more than `threshold` from what it was made with. A drift must last `min_chunks`
chunks in a row (or show in one sudden chunk), beyond the scatter of the stage's own
chunks, and a small one must show in the longer window too: the hysteresis that keeps a
plan from following noise (docs/replanning.md, "Drift and hysteresis").
"""

from __future__ import annotations

from hapi.plan.cost import STAGES, estimate
from hapi.plan.plan import Plan
from hapi.plan.rates import Profiles, StageRates

__all__ = ["DriftWatch", "settled"]


class DriftWatch:
    """Says why the plan in force drifted, and counts the run of chunks that show it.

    Args:
        threshold: a move of the predicted epoch or of a stage's rate beyond this drifts.
        min_chunks: chunks in a row that must show a drift before it calls for a re-plan.
        significance: a server's or trainer's move drifts only beyond this many standard
            errors of a run of `min_chunks` (`StageRates.noise`); 0 for any move.
    """

    def __init__(self, *, threshold: float, min_chunks: int, significance: float = 0.0) -> None:
        self._threshold = threshold
        self._min_chunks = min_chunks
        self._significance = significance
        # The chunks (by id) observed in a row since the drift began: a chunk is observed
        # twice, read and trained, and counts once - else a long turn and two chunks'
        # training re-planned before the read that shows what the turn carried.
        self._run: set[object] = set()

    def reason(self, plan: Plan, rates: StageRates) -> str | None:
        """Why `plan` no longer fits the measurements, or None if it does.

        A stage's move counts beyond `threshold` and beyond `significance` standard
        errors of a run of `min_chunks` (`StageRates.noise`); a move within them is noise,
        and the epoch is predicted with that stage at the rate the plan was made at.
        """
        scales = rates.scales()
        moved = {s: scales[s] / rates.planned[s] for s in STAGES}
        limits = self._limits(rates)
        stage_moves = [s for s in STAGES if abs(moved[s] - 1.0) > limits[s]]
        predicted = rates.predicted_epoch_s(plan, self.believed(rates))
        drift = predicted / plan.epoch_s - 1.0
        if abs(drift) <= self._threshold and not stage_moves:
            return None
        parts = [_describe(plan, s, moved[s]) for s in stage_moves]
        parts.append(f"the plan's epoch now predicted {predicted:.2f} s vs {plan.epoch_s:.2f} s")
        return "; ".join(parts)

    def believed(self, rates: StageRates) -> dict[str, float]:
        """Per stage, the rate a re-plan is made at: the measured one, but for a server or
        trainer whose move lies within its noise (`reason`), which keeps the rate the plan
        in force was made at - a move too small to tell from chance must not steer the
        choice either, once another stage's drift calls for one."""
        scales, limits = rates.scales(), self._limits(rates)
        believed = {}
        for stage in STAGES:
            planned = rates.planned[stage]
            noisy = limits[stage] > self._threshold
            within = abs(scales[stage] / planned - 1.0) <= limits[stage]
            believed[stage] = planned if noisy and within else scales[stage]
        return believed

    def _limits(self, rates: StageRates) -> dict[str, float]:
        """Per stage, the move beyond which it drifted: `threshold`, or its noise's."""
        noise = rates.noise(self._min_chunks)
        return {s: max(self._threshold, self._significance * noise[s]) for s in STAGES}

    def run(self, chunk: object, *, sudden: bool) -> int | None:
        """Count `chunk` (its id) into the run of drifting chunks; the run's length once it
        calls for a re-plan - `min_chunks` long, or `sudden` - which ends it, else None."""
        self._run.add(chunk)
        if len(self._run) < self._min_chunks and not sudden:
            return None
        length = len(self._run)
        self._run = set()
        return length

    def reset(self) -> None:
        """End the run: a chunk fits the plan, or a new plan is in force."""
        self._run = set()

    def window_follows(self, rates: StageRates) -> bool:
        """Whether the longer window moved, from the rates the plan in force was made
        with, the way the recent chunks did, by half the threshold, in some stage that
        moved. Only the stages that moved are asked: after a link drop a trainer 20x
        slower must re-predict the plan though the window still holds pre-drop links."""
        limit = self._threshold
        recent, window = rates.scales(), rates.window_scales()
        for stage in STAGES:
            planned = rates.planned[stage]
            moved = recent[stage] / planned - 1.0
            if abs(moved) <= limit:
                continue
            follows = window[stage] / planned - 1.0
            if follows * moved > 0 and abs(follows) > limit / 2:
                return True
        return False


def settled(plan: Plan, previous: Plan, profiles: Profiles) -> bool:
    """Whether `plan` is no slower than `previous` at the longer window's rates as well.

    A few chunks can read fast, then slow, with nothing changed (a server core that also
    serves the store and the link runs chunks at uneven paces), and a plan that followed
    each run would swing with them. A real change moves the window's rates too, at once
    or within a few chunks more, so the new plan is faster by both.
    """
    server, trainer, link = profiles
    workload = previous.workload

    def epoch(p: Plan) -> float:
        return estimate(p.cut, p.share, server, trainer, link, workload).epoch_s

    return epoch(plan) <= epoch(previous)


def _describe(plan: Plan, stage: str, moved: float) -> str:
    if stage == "link":
        planned = plan.link.bytes_per_s
        return f"link measured {_rate(planned / moved)} vs {_rate(planned)} planned"
    return f"{stage} measured {moved:.2f}x the planned time"


def _rate(bytes_per_s: float) -> str:
    for unit, size in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_s >= size:
            return f"{bytes_per_s / size:.1f} {unit}"
    return f"{bytes_per_s:.0f} B/s"
