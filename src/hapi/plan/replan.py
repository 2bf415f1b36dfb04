"""`Replanner`: weigh the plan in force against measured chunks, and re-plan on drift.

Each stage keeps an exponentially weighted ratio of measured to profiled time over the
chunks seen (sums of both, decayed alike, so large chunks weigh more than small ones).
The profiles scaled by those ratios predict what each option would cost now. The plan
has *drifted* when its predicted epoch at the measured rates, or a stage's rate, has
moved more than `threshold` from what the plan was made with.

A drift must last `min_chunks` chunks in a row, or show in one chunk whose link time no
sharing of the link explains (a link 100x slower, `Replanner._sudden`). Then those
chunks alone (all from after the change) set the rates - not the moving average, which
still remembers the old rates and would re-plan again and again as it converges - and
the job re-plans from them. The server's and the trainer's rate is the median of the
chunks' ratios (weighted by their profiled time); the link's is their sum's ratio,
because chunks in flight together share the link: a chunk whose bytes came while the one
before it was read shows almost no time of its own, and the one before it shows the time
of both. After a passing spike (one stalled chunk) the median of the recent chunks
agrees with the plan, and nothing changes. The next re-plan needs another move of
`threshold` from the new rates: that, the run of drifting chunks and the planner's
preference for the plan in force within its tolerance are the hysteresis. Runs of a few
chunks can also swing around a rate that has not changed (a server core that also serves
the store and the link): a change that moves the plan's epoch by less than `swing` must
pay off at a longer window's rates too, which no re-plan restarts; until it does, the
averages stay as they were.
A stage too idle to tell (a cut that sends a few bytes, a tail of one layer) keeps the
rate its plan was made with, not the first profile's - else a link measured slow, then
made idle by the re-plan it caused, would read as fast again and undo it - unless it
measures faster than that: fixed costs only add time, so a faster reading is real.
A chunk whose bytes were buffered before its turn reads almost no time, and a turn
before it, which carried them, reads long. So a turn's time beyond its own bytes' (at
the rate believed) is held back, not counted as a slow link, until every chunk that
could have crossed in it - those requested before it ended - has been read: the
buffered ones among them claim it, at the link's pace, and only what none claims is
counted, late but at the turn's weight. Counted at once, one long turn made a drift
run with the chunks read before the one it carried, and a hybrid at 100 Mbit/s left
its plan in its first epoch. A slower link is seen `prefetch` chunks later for it,
except a drop no sharing explains (`_sudden`), acted on at once.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from hapi.errors import InvalidRequest
from hapi.graph.cut_point import INPUT, RAW
from hapi.plan.cost import STAGES, estimate
from hapi.plan.plan import Plan
from hapi.plan.planner import PlannerConfig, choose_plan
from hapi.plan.profiles import LinkProfile, ServerProfile, TrainerProfile

__all__ = ["ChunkMeasurement", "PlanChange", "ReplanConfig", "Replanner"]


WINDOW_RUNS = 4
"""The longer window a change must also pay off in, in runs of `min_chunks` chunks."""


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
    a lower bound, evidence of a link as slow as that but not of a faster one. At a late
    cut after a link drop, such chunks read 5-13x faster than the link, and the plan went
    back to sending raw chunks over it. Their bytes are credited instead to what the turns
    before them took beyond their own (`Replanner._pair`)."""
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


@dataclass(frozen=True, kw_only=True)
class ReplanConfig:
    """When to re-plan."""

    threshold: float = 0.15
    """Re-plan when the predicted epoch or a stage's rate moves by more than this."""
    min_chunks: int = 3
    """Chunks in a row that must show a drift before the plan changes (and that then set
    the rates it is re-planned from)."""
    weight: float = 0.3
    """Weight of the newest chunk in each stage's moving average."""
    min_stage_share: float = 0.1
    """A stage whose measured time is below this share of the busiest stage's keeps its
    profiled rate: a link that carries a few bytes per chunk, or a trainer that trains one
    layer, measures mostly fixed costs, and scaling its per-sample costs by that would
    mislead every option that leans on it."""
    link_busy_share: float = 0.5
    """A link measured faster than planned is believed beyond the probe's rate only when
    its measured time is at least this share of the busiest stage's (`Replanner.scales`)."""
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    """How re-plans choose."""
    min_gain: float = 0.1
    """A re-plan changes the cut or share only when the new choice is predicted this much
    faster than the plan in force at the measured rates: measured rates are noisy, and a
    change costs the chunks already issued by the old plan."""

    swing: float = 2.0
    """A drift that moves the plan's predicted epoch by less than this factor must also
    show in a longer window before the plan changes (`_settled`): runs of a few chunks
    swing by up to 1.5x around an unchanged rate. A larger move, a link 10x slower, is
    acted on at once."""

    def __post_init__(self) -> None:
        if not self.swing >= 1.0:
            raise ValueError(f"swing must be >= 1, got {self.swing}")
        if not self.threshold > 0.0:
            raise ValueError(f"threshold must be > 0, got {self.threshold}")
        if self.min_chunks < 1:
            raise ValueError(f"min_chunks must be >= 1, got {self.min_chunks}")
        if not 0.0 <= self.min_gain < 1.0:
            raise ValueError(f"min_gain must be in [0, 1), got {self.min_gain}")
        if not 0.0 <= self.link_busy_share <= 1.0:
            raise ValueError(f"link_busy_share must be in [0, 1], got {self.link_busy_share}")
        if not 0.0 <= self.min_stage_share < 1.0:
            raise ValueError(f"min_stage_share must be in [0, 1), got {self.min_stage_share}")
        if not 0.0 < self.weight <= 1.0:
            raise ValueError(f"weight must be in (0, 1], got {self.weight}")


@dataclass
class _Turn:
    """A measured turn's link time beyond its own bytes, held back: the buffered chunks
    whose bytes crossed in it claim it, and what none claims is a slower link."""

    excess: float
    """Seconds not yet claimed (spent as buffered chunks claim it)."""
    ended: float | None
    """When its read ended (None: not known)."""
    at: int
    """The observation it was (`Replanner.chunks`), for the moving average's weight."""
    pair: list[float]
    """Its (measured, profiled) link pair in the window, which what is left joins."""


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
        >>> change = replanner.observe(ChunkMeasurement(samples=64, bytes=..., ...))
        >>> if change is not None and change.changed:
        ...     issue the chunks not yet issued by change.plan
    """

    def __init__(self, plan: Plan, config: ReplanConfig | None = None) -> None:
        self.config = config or ReplanConfig()
        self.plan = plan
        """The plan in force."""
        self.changes: list[PlanChange] = []
        """Every re-plan so far, oldest first."""
        self.chunks = 0
        """Chunks observed."""
        self._base = (plan.server, plan.trainer, plan.link)
        self._measured = dict.fromkeys(STAGES, 0.0)
        self._profiled = dict.fromkeys(STAGES, 0.0)
        self._planned_scales = dict.fromkeys(STAGES, 1.0)
        # Per stage, its last measured (measured, profiled) pairs - a chunk's server and
        # link are observed when it is read, its trainer when it is trained: the last
        # `min_chunks` restart the averages, the whole window is what `_settled` weighs a
        # change by (no re-plan restarts it).
        self._window: dict[str, deque[list[float]]] = {
            s: deque(maxlen=WINDOW_RUNS * self.config.min_chunks) for s in STAGES
        }
        # The chunks (by id) observed in a row since the drift began: a chunk is observed
        # twice, read and trained, and counts once - else a long turn and two chunks'
        # training re-planned before the read that shows what the turn carried.
        self._drifting: set[object] = set()
        # Per stage, the pairs measured since the plan in force was made: a re-plan
        # restarts from its last few of those only. A stage the drifting chunks did not
        # measure (trainings carry no link time) keeps its average, not pairs from before
        # the last change (a link restarted from one pair after its drop and two before it
        # read 3x faster than it was).
        self._fresh = dict.fromkeys(STAGES, 0)
        # The last measured turns' time beyond their own bytes, held back (see the
        # module's note): the last 2K, not the last one - with up to 2K chunks in flight
        # (K per route) a chunk's bytes may cross in any of the turns before its own, and
        # a short turn between (its own bytes only) must not hide the long one. Not
        # cleared by a re-plan: the chunks that may claim them are still in flight.
        self._held: deque[_Turn] = deque(
            maxlen=max(1, 2 * plan.workload.prefetch * plan.workload.servers)
        )

    def scales(self) -> dict[str, float]:
        """Per stage: measured time / the first plan's profiled time (1 before any data).
        A stage too idle to tell, below `min_stage_share` of the busiest, keeps the scale
        the plan in force was made with unless it measured faster; a link below
        `link_busy_share` of the busiest is believed faster only up to the probe's rate."""
        busiest = max(self._measured.values())
        scales = {}
        for s in STAGES:
            planned = self._planned_scales[s]
            if self._profiled[s] <= 1e-12:
                scales[s] = planned
                continue
            ratio = self._measured[s] / self._profiled[s]
            if s == "link":
                # A link that waits for the server gets the next chunk's first bytes while
                # it waits, so its chunks' turns read fast: from a link less busy than
                # about the busiest stage, a faster reading is believed only up to the
                # probe's rate (a link that recovers from a drop), not beyond it.
                busy = self._measured[s] >= self.config.link_busy_share * busiest
                scales[s] = ratio if busy else max(ratio, min(planned, 1.0))
                continue
            idle = self._measured[s] < self.config.min_stage_share * busiest
            # An idle stage's time is mostly fixed costs, so its ratio only bounds its
            # rate from above: believed when it says faster than planned, not slower.
            scales[s] = min(ratio, planned) if idle else ratio
        return scales

    def measured_profiles(self) -> tuple[ServerProfile, TrainerProfile, LinkProfile]:
        """The first plan's profiles scaled to the rates measured."""
        return self._scaled(self.scales())

    def _scaled(
        self, scales: dict[str, float]
    ) -> tuple[ServerProfile, TrainerProfile, LinkProfile]:
        server, trainer, link = self._base
        return (
            server.scaled(scales["server"]),
            trainer.scaled(scales["trainer"]),
            link.scaled(scales["link"]),
        )

    def predicted_epoch_s(self) -> float:
        """The plan in force's epoch time at the measured rates."""
        server, trainer, link = self.measured_profiles()
        plan = self.plan
        return estimate(plan.cut, plan.share, server, trainer, link, plan.workload).epoch_s

    def observe(self, chunk: ChunkMeasurement) -> PlanChange | None:
        """Take in one chunk's measurements; a `PlanChange` when they call for a re-plan."""
        pairs, averaged = self._pair(chunk)
        sudden = self._sudden(chunk.transfer_s or 0.0)
        for stage, pair in pairs.items():
            if pair[1] > 1e-12:
                self._window[stage].append(pair)
                self._fresh[stage] += 1
        decay = 1.0 - self.config.weight
        for stage, (measured, profiled) in averaged.items():
            self._measured[stage] = decay * self._measured[stage] + measured
            self._profiled[stage] = decay * self._profiled[stage] + profiled
        self.chunks += 1
        if self._drift() is None:
            self._drifting = set()
            return None
        self._drifting.add(self.chunks if chunk.chunk is None else chunk.chunk)
        if len(self._drifting) < self.config.min_chunks and not sudden:
            return None
        drifting = len(self._drifting)
        self._drifting = set()
        averages = dict(self._measured), dict(self._profiled)
        self._restart_from_recent(min(drifting, self.config.min_chunks))
        reason = self._drift()
        if reason is None:
            return None
        server, trainer, link = self.measured_profiles()
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
            and not _settled(plan, previous, self._window_profiles())
        ):
            # Only the last few chunks call for it: wait, from the averages as they were,
            # for the window to follow them (a real change) or not (a swing).
            self._measured, self._profiled = averages
            return None
        if not faster:
            if not self._window_follows():
                # A run of a few chunks only (chunks sharing the link read a turn slow,
                # then fast): re-predicted at their rates, the plan would stay but its
                # rates would be theirs. Wait, from the averages as they were.
                self._measured, self._profiled = averages
                return None
            # Not enough faster to be worth a change: the plan in force, re-predicted.
            plan = plan.with_choice(previous.cut, previous.share, reason=previous.reason)
        change = PlanChange(previous=previous, plan=plan, reason=reason, chunks=self.chunks)
        self.plan = plan
        self.changes.append(change)
        self._planned_scales = self.scales()
        self._fresh = dict.fromkeys(STAGES, 0)
        return change

    def adopt(self, plan: Plan) -> None:
        """Make `plan` the plan in force (one set from outside: the user's, a fallback).

        Drift is then measured from the rates seen so far, as after a re-plan.
        """
        self.plan = plan
        self._planned_scales = self.scales()
        self._drifting = set()
        self._fresh = dict.fromkeys(STAGES, 0)

    def _window_profiles(self) -> tuple[ServerProfile, TrainerProfile, LinkProfile]:
        """The first plan's profiles scaled to the longer window's rates."""
        return self._scaled(self._window_scales())

    def _window_scales(self) -> dict[str, float]:
        """Per stage, the longer window's rate: the ratio of its sums (a stage too idle in
        it to tell keeps its scale now)."""
        scales = self.scales()
        totals = {s: sum(m for m, _ in self._window[s]) for s in STAGES}
        busiest = max(totals.values())
        for stage in STAGES:
            profiled = sum(p for _, p in self._window[stage])
            if profiled > 1e-12 and totals[stage] >= self.config.min_stage_share * busiest:
                scales[stage] = totals[stage] / profiled
        return scales

    def _window_follows(self) -> bool:
        """Whether the longer window moved, from the rates the plan in force was made
        with, the way the recent chunks did, by half the threshold, in some stage that
        moved. Only the stages that moved are asked: after a link drop a trainer 20x
        slower must re-predict the plan though the window still holds pre-drop links."""
        limit = self.config.threshold
        recent, window = self.scales(), self._window_scales()
        for stage in STAGES:
            planned = self._planned_scales[stage]
            moved = recent[stage] / planned - 1.0
            if abs(moved) <= limit:
                continue
            follows = window[stage] / planned - 1.0
            if follows * moved > 0 and abs(follows) > limit / 2:
                return True
        return False

    def _sudden(self, link_s: float) -> bool:
        """Whether one chunk's link time shows the link itself slowed, beyond doubt.

        Chunks in flight share the link, so one chunk's turn may carry the bytes of
        every chunk in flight (`prefetch` at the plan's cut and, in a hybrid, its local
        window's raw ones: `_in_flight_s`); no sharing explains a turn `swing` times
        longer than all of them take at the rate planned.
        Such a chunk is acted on at once, not after `min_chunks`: after a 100x drop each
        chunk the old plan still issues puts up to a second of raw bytes on the link (a
        1 Gbit/s to 10 Mbit/s drop cost 0.3-0.7 s an epoch in chunks issued while the
        re-planner waited for two more).

        Its rate is read from its own bytes: the slowest the link can be. Its turn may
        have carried the other chunks in flight too, but a rate read faster (between the
        two) kept raw chunks on the dropped link (10% slower an epoch), while a rate too
        slow costs at most a later cut than the best.
        """
        return link_s > self.config.swing * self._in_flight_s()

    def _in_flight_s(self) -> float:
        """The link's time, at the rate believed, for every chunk in flight: K at the
        plan's cut and, in a hybrid, its local window's raw ones (a window per route).
        The most one turn can carry of others' bytes."""
        server, _, link = self._base
        workload = self.plan.workload
        in_flight_bytes = workload.prefetch * server.wire_bytes(self.plan.cut)
        if self.plan.share > 0:
            in_flight_bytes += workload.local_window * server.raw_bytes
        in_flight = workload.chunk_size * in_flight_bytes / link.bytes_per_s
        return in_flight * self._planned_scales["link"]

    def _restart_from_recent(self, count: int) -> None:
        """Restart each stage's moving average at the rate of its last `count` pairs (the
        chunks that showed the drift), of those measured under the plan in force.

        The server's and the trainer's: the median of the chunks' own ratios, so that one
        stalled chunk among them (a retry, a pause) does not set the rate, each weighted by
        its profiled time - a hybrid's raw chunk costs the server a read, mostly fixed
        costs, and its ratio says little of the head's rate. The link's: the ratio of
        their sums, as the chunks shared it (see the module's note).
        """
        decay = 1.0 - self.config.weight
        recent = {s: _last(self._window[s], min(count, self._fresh[s])) for s in STAGES}
        totals = {s: sum(m for m, _ in recent[s]) for s in STAGES}
        busiest = max(totals.values())
        for stage in STAGES:
            pairs = recent[stage]
            if not pairs or totals[stage] < self.config.min_stage_share * busiest:
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

    def _pair(
        self, chunk: ChunkMeasurement
    ) -> tuple[dict[str, list[float]], dict[str, tuple[float, float]]]:
        """Per stage, this chunk's (measured, profiled) seconds for the window, and what
        the moving averages take in now: the link's differs by what the turns held back
        weigh by now - the credit a buffered chunk claims, a turn's excess none claimed."""
        server, trainer, link = self._base
        n = chunk.samples
        if chunk.cut == RAW:
            trainer_s = trainer.local_s(INPUT if chunk.feature_cut is None else chunk.feature_cut)
        else:
            trainer_s = trainer.remote_s(chunk.cut)
        workload = self.plan.workload
        latency = link.latency_s / min(workload.prefetch, workload.chunks)
        link_s = chunk.bytes / link.bytes_per_s + latency
        scale = self._planned_scales["link"]
        believed = link_s * scale
        transfer_s = chunk.transfer_s
        # (A turn that waited for the server, or a training, is no evidence: it holds or
        # claims nothing.)
        link_pair = [0.0, 0.0]
        link_average = (0.0, 0.0)
        claims = chunk.transfer_buffered and transfer_s is not None and transfer_s < believed
        if transfer_s is not None and claims:
            # Faster than believed, but perhaps only out of the buffers: the rest of its
            # bytes crossed in the turns before it that ended after it was requested (not
            # knowing when, the last turn only). What they held back pays for that rest at
            # the pace believed - never faster: no excess, no evidence. (Its own turn
            # counts: a raw chunk the server sent in order crossed mostly in its turn, and
            # paired with only the claim's time a turn of 0.14 s read as a link 15x slower.)
            left = believed - transfer_s
            spent = weighed = 0.0
            turns = list(self._held)
            for turn in turns if chunk.issued is not None else turns[-1:]:
                if chunk.issued is None or turn.ended is None or chunk.issued < turn.ended:
                    claim = min(turn.excess, left)
                    turn.excess, left, spent = turn.excess - claim, left - claim, spent + claim
                    weighed += claim * self._weight(turn)
            if spent > 1e-12:
                link_pair = [transfer_s + spent, (transfer_s + spent) / scale]
                link_average = (transfer_s + weighed, (transfer_s + weighed) / scale)
        expired = self._expire(chunk)
        if transfer_s is not None and not claims:
            # A turn. Held back: what other chunks in flight could have put in it, unless
            # it is sudden - no sharing explains it, so it is the link's own pace.
            excess = max(0.0, transfer_s - believed)
            held = 0.0 if self._sudden(transfer_s) else min(excess, self._in_flight_s())
            link_pair = [transfer_s - held, link_s]
            link_average = (transfer_s - held, link_s)
            expired += self._hold(
                _Turn(excess=held, ended=chunk.read_end, at=self.chunks, pair=link_pair)
            )
        server_s = chunk.server_s
        if chunk.cut == RAW and self.plan.cut != RAW:
            # A hybrid's raw chunk: the server reads it beside the pushed chunks' heads, on
            # their core, in 3-20x its planned read - fixed costs and their compute, not a
            # rate of the server's. Its pushed chunks are the evidence.
            server_s = None
        # A stage not measured (None) is no evidence: it weighs nothing.
        pairs = {
            "server": _evidence(server_s, n * server.compute_s(chunk.cut)),
            "link": link_pair,
            "trainer": _evidence(chunk.trainer_s, n * trainer_s),
        }
        averaged = {s: (pair[0], pair[1]) for s, pair in pairs.items()}
        averaged["link"] = (link_average[0] + expired, link_average[1])
        return pairs, averaged

    def _hold(self, turn: _Turn) -> float:
        """Hold back a measured turn's excess for the buffered chunks to claim: the last
        K turns (K chunks in flight), the oldest counted when a newer one needs room
        (returned as `_count` does)."""
        added = self._count(self._held.popleft()) if len(self._held) == self._held.maxlen else 0.0
        self._held.append(turn)
        return added

    def _expire(self, chunk: ChunkMeasurement) -> float:
        """Count the held turns no chunk after `chunk` can claim; what they add to the
        link's moving average, weighed as their turns are.

        Chunks are read in the order they were requested: once a chunk requested after a
        turn ended is observed, every chunk that could have crossed in it has been read.
        Where that time is not known, only the next read could have.
        """
        read = chunk.transfer_s is not None
        kept: list[_Turn] = []
        added = 0.0
        for turn in self._held:
            if chunk.issued is None or turn.ended is None:
                done = read
            else:
                done = turn.ended <= chunk.issued
            if done:
                added += self._count(turn)
            else:
                kept.append(turn)
        self._held = deque(kept, maxlen=self._held.maxlen)
        return added

    def _count(self, turn: _Turn) -> float:
        """Count what no chunk claimed of a turn's excess as the link's own time: in the
        turn's window pair, and returned as the moving average weighs the turn by now."""
        turn.pair[0] += turn.excess
        weighed = turn.excess * self._weight(turn)
        turn.excess = 0.0
        return weighed

    def _weight(self, turn: _Turn) -> float:
        """What the moving average weighs a held turn's seconds at by now."""
        return (1.0 - self.config.weight) ** (self.chunks - turn.at)

    def _drift(self) -> str | None:
        """Why the plan in force no longer fits the measurements, or None if it does."""
        limit = self.config.threshold
        scales = self.scales()
        moved = {s: scales[s] / self._planned_scales[s] for s in STAGES}
        predicted = self.predicted_epoch_s()
        drift = predicted / self.plan.epoch_s - 1.0
        stage_moves = [s for s in STAGES if abs(moved[s] - 1.0) > limit]
        if abs(drift) <= limit and not stage_moves:
            return None
        parts = [self._describe(s, moved[s]) for s in stage_moves]
        parts.append(
            f"the plan's epoch now predicted {predicted:.2f} s vs {self.plan.epoch_s:.2f} s"
        )
        return "; ".join(parts)

    def _describe(self, stage: str, moved: float) -> str:
        if stage == "link":
            planned = self.plan.link.bytes_per_s
            return f"link measured {_rate(planned / moved)} vs {_rate(planned)} planned"
        return f"{stage} measured {moved:.2f}x the planned time"


def _settled(
    plan: Plan, previous: Plan, profiles: tuple[ServerProfile, TrainerProfile, LinkProfile]
) -> bool:
    """Whether `plan` is no slower than `previous` at the longer window's rates as well.

    A few chunks can read fast, then slow, with nothing changed: a server core that also
    serves the store and the link runs chunks at uneven paces, and a plan that followed
    each run would swing with them (a hybrid went between 53% and 64% local five times in
    one epoch). A real change - a link 100x slower - moves the window's rates too, at
    once or within a few chunks more, so the new plan is faster by both.
    """
    server, trainer, link = profiles
    workload = previous.workload

    def epoch(p: Plan) -> float:
        return estimate(p.cut, p.share, server, trainer, link, workload).epoch_s

    return epoch(plan) <= epoch(previous)


def _evidence(measured: float | None, profiled: float) -> list[float]:
    """A stage's (measured, profiled) pair: none, (0, 0), where it was not measured."""
    return [0.0, 0.0] if measured is None else [measured, profiled]


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


def _rate(bytes_per_s: float) -> str:
    for unit, size in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_s >= size:
            return f"{bytes_per_s / size:.1f} {unit}"
    return f"{bytes_per_s:.0f} B/s"
