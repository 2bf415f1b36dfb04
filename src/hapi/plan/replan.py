"""`Replanner`: weigh the plan in force against measured chunks, and re-plan on drift.

It composes three parts: `StageRates` (each stage's measured against its profiled time),
`LinkTurns` (link time credited to the turns that carried buffered chunks' bytes) and
`DriftWatch` (when a drift calls for a re-plan). docs/replanning.md gives the reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass

from hapi.errors import InvalidRequest
from hapi.graph.cut_point import INPUT, RAW
from hapi.plan.choose import choose_plan
from hapi.plan.chunk_measurements import ReadMeasurement, TrainMeasurement
from hapi.plan.cost import estimate
from hapi.plan.drift import DriftWatch, settled
from hapi.plan.plan import Plan
from hapi.plan.profiles import LinkProfile, ServerProfile, TrainerProfile
from hapi.plan.rates import StageRates
from hapi.plan.replan_config import ReplanConfig
from hapi.plan.turns import LinkTurns, in_flight_s

__all__ = ["PlanChange", "ReadMeasurement", "ReplanConfig", "Replanner", "TrainMeasurement"]


WINDOW_RUNS = 4
"""The longer window a change must also pay off in, in runs of `min_chunks` chunks."""


@dataclass(frozen=True, kw_only=True)
class PlanChange:
    """A re-plan: the plan before, the plan after and why."""

    previous: Plan
    plan: Plan
    reason: str
    """What was measured against what was planned."""
    chunks: int
    """Chunks observed in all when it happened."""

    @property
    def changed(self) -> bool:
        """Whether the cut or the share changed (else only the predictions did)."""
        return (self.plan.cut, self.plan.share) != (self.previous.cut, self.previous.share)


class Replanner:
    """Feeds on measured chunks; returns a new plan when the measurements call for one.

    Example:
        >>> replanner = Replanner(plan)
        >>> change = replanner.observe(ReadMeasurement(samples=64, bytes=..., ...))
        >>> if change is not None and change.changed:
        ...     issue the chunks not yet issued by change.plan
        >>> replanner.observe(trained=TrainMeasurement(samples=64, ...))  # a batch later
    """

    def __init__(self, plan: Plan, config: ReplanConfig | None = None) -> None:
        self.config = config or ReplanConfig()
        self.plan = plan
        """The plan in force."""
        self.changes: list[PlanChange] = []
        """Every re-plan so far, oldest first."""
        self.chunks = 0
        """Chunks observed, each once: counted at its read (its training is the same
        chunk)."""
        self.steps = 0
        """Observations: a chunk's read and its training are a step of the moving averages
        each (one, observed together)."""
        config = self.config
        self._rates = StageRates(
            (plan.server, plan.trainer, plan.link),
            weight=config.weight,
            min_stage_share=config.min_stage_share,
            link_busy_share=config.link_busy_share,
            window=WINDOW_RUNS * config.min_chunks,
        )
        self._drift = DriftWatch(
            threshold=config.threshold,
            min_chunks=config.min_chunks,
            significance=config.significance,
        )
        # Up to 2K chunks in flight (K per route) may have crossed in a turn.
        workload = plan.workload
        self._turns = LinkTurns(
            max(1, 2 * workload.prefetch * workload.servers), decay=1.0 - config.weight
        )

    def scales(self) -> dict[str, float]:
        """Per stage: measured time / the first plan's profiled time (1 before any data).
        A stage too idle to tell, below `min_stage_share` of the busiest, keeps the scale
        the plan in force was made with unless it measured faster; a link below
        `link_busy_share` of the busiest is believed faster only up to the probe's rate."""
        return self._rates.scales()

    def measured_profiles(self) -> tuple[ServerProfile, TrainerProfile, LinkProfile]:
        """The first plan's profiles scaled to the rates measured."""
        return self._rates.measured_profiles()

    def predicted_epoch_s(self) -> float:
        """The plan in force's epoch time at the measured rates."""
        return self._rates.predicted_epoch_s(self.plan)

    def observe(
        self, read: ReadMeasurement | None = None, trained: TrainMeasurement | None = None
    ) -> PlanChange | None:
        """Take in what one chunk measured at one moment - its read (server, link), its
        training (trainer), or both - as one step of the moving averages.

        Returns:
            A `PlanChange` when the measurements call for a re-plan, else None.

        Raises:
            InvalidRequest: neither is given, or the two are of different chunks.
        """
        _check_pair(read, trained)
        sudden = read is not None and self._sudden(read.transfer_s or 0.0)
        self._rates.add(*self._pair(read, trained, sudden=sudden))
        self.steps += 1
        self.chunks += read is not None
        if self._drift.reason(self.plan, self._rates) is None:
            self._drift.reset()
            return None
        # A chunk counts once in a run, read or trained; without an id, each step counts.
        chunk = read.chunk if read is not None else trained.chunk if trained is not None else None
        run = self._drift.run(self.steps if chunk is None else chunk, sudden=sudden)
        if run is None:
            return None
        # Those chunks alone (all from after the change) set the rates: the moving average
        # still remembers the old ones, and would re-plan again and again as it converges.
        averages = self._rates.averages()
        self._rates.restart_from_recent(min(run, self.config.min_chunks))
        reason = self._drift.reason(self.plan, self._rates)
        if reason is None:
            return None
        return self._replan(reason, averages)

    def _replan(
        self, reason: str, averages: tuple[dict[str, float], dict[str, float]]
    ) -> PlanChange | None:
        """Choose a plan at the measured rates; adopt it when it is worth a change, or the
        plan in force re-predicted when the window has settled on the new rates.

        A plan not worth it yet, on the last few chunks only, leaves the rates as
        `averages` (as they were before the run restarted them).
        """
        believed = self._drift.believed(self._rates)
        server, trainer, link = self._rates.profiles(believed)
        previous = self.plan
        plan = choose_plan(
            server,
            trainer,
            link,
            previous.workload,
            freeze=previous.freeze,
            names=previous.names,
            config=self.config.planner,
            current=previous,
        )
        now = estimate(previous.cut, previous.share, server, trainer, link, previous.workload)
        faster = plan.epoch_s <= now.epoch_s * (1 - self.config.min_gain)
        moved = max(now.epoch_s / previous.epoch_s, previous.epoch_s / now.epoch_s)
        if (
            faster
            and moved < self.config.swing
            and not settled(plan, previous, self._rates.window_profiles())
        ):
            # Only the last few chunks call for it: wait, from the averages as they were,
            # for the window to follow them (a real change) or not (a swing).
            self._rates.restore(averages)
            return None
        if not faster:
            if not self._drift.window_follows(self._rates):
                # A run of a few chunks only (chunks sharing the link read a turn slow,
                # then fast): re-predicted at their rates, the plan would stay but its
                # rates would be theirs. Wait, from the averages as they were.
                self._rates.restore(averages)
                return None
            # Not enough faster to be worth a change: the plan in force, re-predicted.
            plan = plan.with_choice(previous.cut, previous.share, reason=previous.reason)
        change = PlanChange(previous=previous, plan=plan, reason=reason, chunks=self.chunks)
        self.plan = plan
        self.changes.append(change)
        self._rates.rebase(believed)
        return change

    def adopt(self, plan: Plan) -> None:
        """Make `plan` the plan in force (one set from outside: the user's, a fallback).

        Drift is then measured from the rates seen so far, as after a re-plan.
        """
        self.plan = plan
        self._rates.rebase()
        self._drift.reset()

    def _sudden(self, link_s: float) -> bool:
        """Whether one chunk's link time shows the link itself slowed, beyond doubt.

        One chunk's turn may carry the bytes of every chunk in flight; no sharing
        explains a turn `swing` times longer than all of them take at the rate planned.
        Such a chunk is acted on at once, not after `min_chunks`: each chunk the old plan
        still issues after a large drop puts its raw bytes on the slow link. Its rate is
        read from its own bytes: the slowest the link can be (docs/replanning.md).
        """
        return link_s > self.config.swing * self._in_flight_s()

    def _in_flight_s(self) -> float:
        server, _, link = self._rates.base
        return in_flight_s(self.plan, server, link, self._rates.planned["link"])

    def _pair(
        self, read: ReadMeasurement | None, trained: TrainMeasurement | None, *, sudden: bool
    ) -> tuple[dict[str, list[float]], dict[str, tuple[float, float]]]:
        """Per stage, this step's (measured, profiled) seconds for the window, and what
        the moving averages take in now (the link's from `LinkTurns`). A stage the step
        did not measure is no evidence: it weighs nothing, (0, 0)."""
        server, trainer, link = self._rates.base
        server_pair, link_pair = [0.0, 0.0], [0.0, 0.0]
        link_average = (0.0, 0.0)
        if read is not None:
            workload = self.plan.workload
            latency = link.latency_s / min(workload.prefetch, workload.chunks)
            link_pair, link_average = self._turns.pair(
                read,
                link_s=read.bytes / link.bytes_per_s + latency,
                scale=self._rates.planned["link"],
                in_flight_s=self._in_flight_s(),
                sudden=sudden,
                now=self.steps,
            )
            # A hybrid's raw chunk: the server reads it beside the pushed chunks' heads, on
            # their core, in 3-20x its planned read - fixed costs and their compute, not a
            # rate of the server's. Its pushed chunks are the evidence.
            raw_in_hybrid = read.cut == RAW and self.plan.cut != RAW
            if read.server_s is not None and not raw_in_hybrid:
                server_pair = [read.server_s, read.samples * server.compute_s(read.cut)]
        elif trained is not None:
            # A training carries no link time, but its chunk was read: the turns no later
            # chunk can claim are counted now.
            link_average = (self._turns.trained(trained.issued, now=self.steps), 0.0)
        trainer_pair = [0.0, 0.0]
        if trained is not None:
            n, split = trained.samples, self._rates.trainer_split
            if trained.cut == RAW:
                feature_cut = INPUT if trained.feature_cut is None else trained.feature_cut
                per_sample = trainer.local_s(feature_cut)
                tail = trainer.tail_s[max(feature_cut, INPUT)]
                split.add_local(trained.trainer_s, n * (per_sample - tail), n * tail)
            else:
                per_sample = trainer.remote_s(trained.cut)
                split.add_pushed(trained.trainer_s, n * per_sample)
            trainer_pair = [trained.trainer_s, n * per_sample]
        pairs = {"server": server_pair, "link": link_pair, "trainer": trainer_pair}
        averaged = {s: (pair[0], pair[1]) for s, pair in pairs.items()}
        averaged["link"] = link_average
        return pairs, averaged


def _check_pair(read: ReadMeasurement | None, trained: TrainMeasurement | None) -> None:
    """Raise `InvalidRequest` unless one or both are given, of one chunk."""
    if read is None and trained is None:
        raise InvalidRequest("observe a chunk's read, its training, or both: got neither")
    if read is not None and trained is not None and read.chunk != trained.chunk:
        raise InvalidRequest(
            f"a read and a training observed together must be of one chunk, got chunk "
            f"{read.chunk!r} read and chunk {trained.chunk!r} trained"
        )
