"""`LinkTurns`: link time credited to the turns that carried buffered chunks' bytes.

Chunks in flight share the link: a chunk whose bytes were buffered before its turn reads
almost no link time, and the turn before it, which carried them, reads long. A turn's
time beyond its own bytes is held back until every chunk that could have crossed in it
has been read; only what none of them claims counts as a slower link
(docs/replanning.md, "Buffered link turns").
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from hapi.plan.chunk_measurements import ReadMeasurement
from hapi.plan.plan import Plan
from hapi.plan.profiles import LinkProfile, ServerProfile

__all__ = ["LinkTurns", "in_flight_s"]


@dataclass
class _Turn:
    """A measured turn's link time beyond its own bytes, held back: the buffered chunks
    whose bytes crossed in it claim it, and what none claims is a slower link."""

    excess: float
    """Seconds not yet claimed (spent as buffered chunks claim it)."""
    ended: float | None
    """When its read ended (None: not known)."""
    at: int
    """The observation it was (a step of the moving averages: `Replanner.steps`), for
    the moving average's weight."""
    pair: list[float]
    """Its (measured, profiled) link pair in the window, which what is left joins."""


def in_flight_s(plan: Plan, server: ServerProfile, link: LinkProfile, scale: float) -> float:
    """The link's time, at the rate believed (`link`'s times `scale`), for every chunk in
    flight: K at the plan's cut and, in a hybrid, its local window's raw ones (a window
    per route). The most one turn can carry of others' bytes."""
    workload = plan.workload
    in_flight_bytes = workload.prefetch * server.wire_bytes(plan.cut)
    if plan.share > 0:
        in_flight_bytes += workload.local_window * server.raw_bytes
    in_flight = workload.chunk_size * in_flight_bytes / link.bytes_per_s
    return in_flight * scale


class LinkTurns:
    """The last measured turns' time beyond their own bytes, held back for the buffered
    chunks to claim.

    The last `size` turns (2K, with up to 2K chunks in flight, K per route), not the last
    one: a chunk's bytes may cross in any of the turns before its own, and a short turn
    between (its own bytes only) must not hide the long one. A re-plan does not clear
    them: the chunks that may claim them are still in flight.

    Args:
        size: how many turns are held.
        decay: 1 - the moving average's weight of the newest chunk, by which held
            seconds are weighed when they are counted late.
    """

    def __init__(self, size: int, *, decay: float) -> None:
        self._decay = decay
        self._held: deque[_Turn] = deque(maxlen=size)

    def pair(
        self,
        chunk: ReadMeasurement,
        *,
        link_s: float,
        scale: float,
        in_flight_s: float,
        sudden: bool,
        now: int,
    ) -> tuple[list[float], tuple[float, float]]:
        """This chunk's (measured, profiled) link seconds for the window, and what the
        link's moving average takes in now: the credit a buffered chunk claims, a turn's
        excess none claimed, weighed as their turns are by now.

        Args:
            chunk: the chunk read.
            link_s: its bytes' time at the first plan's link profile.
            scale: the link's scale the plan in force was made with (the rate believed).
            in_flight_s: the link's time for every chunk in flight, at that rate.
            sudden: its turn is longer than any sharing of the link explains: none of it
                is held back.
            now: observations (`Replanner.steps`) before this one.
        """
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
                    weighed += claim * self._weight(turn, now)
            if spent > 1e-12:
                link_pair = [transfer_s + spent, (transfer_s + spent) / scale]
                link_average = (transfer_s + weighed, (transfer_s + weighed) / scale)
        expired = self._expire(chunk.issued, timed=transfer_s is not None, now=now)
        if transfer_s is not None and not claims:
            # A turn. Held back: what other chunks in flight could have put in it, unless
            # it is sudden - no sharing explains it, so it is the link's own pace.
            excess = max(0.0, transfer_s - believed)
            held = 0.0 if sudden else min(excess, in_flight_s)
            link_pair = [transfer_s - held, link_s]
            link_average = (transfer_s - held, link_s)
            expired += self._hold(
                _Turn(excess=held, ended=chunk.read_end, at=now, pair=link_pair), now
            )
        return link_pair, (link_average[0] + expired, link_average[1])

    def _hold(self, turn: _Turn, now: int) -> float:
        """Hold back a measured turn's excess for the buffered chunks to claim: the last
        `size` turns, the oldest counted when a newer one needs room (returned as
        `_count` does)."""
        full = len(self._held) == self._held.maxlen
        added = self._count(self._held.popleft(), now) if full else 0.0
        self._held.append(turn)
        return added

    def trained(self, issued: float | None, *, now: int) -> float:
        """A chunk requested at `issued` was trained, so it was read: count the held
        turns no chunk after it can claim (`_expire`). It carries no link time of its own.

        Returns:
            What those turns add to the link's moving average, weighed as they are by now.
        """
        return self._expire(issued, timed=False, now=now)

    def _expire(self, issued: float | None, *, timed: bool, now: int) -> float:
        """Count the held turns no chunk after one requested at `issued` can claim; what
        they add to the link's moving average, weighed as their turns are.

        Chunks are read in the order they were requested: once a chunk requested after a
        turn ended is observed, every chunk that could have crossed in it has been read.
        Where that time is not known, only the next read with a link time (`timed`)
        could have.
        """
        kept: list[_Turn] = []
        added = 0.0
        for turn in self._held:
            done = timed if issued is None or turn.ended is None else turn.ended <= issued
            if done:
                added += self._count(turn, now)
            else:
                kept.append(turn)
        self._held = deque(kept, maxlen=self._held.maxlen)
        return added

    def _count(self, turn: _Turn, now: int) -> float:
        """Count what no chunk claimed of a turn's excess as the link's own time: in the
        turn's window pair, and returned as the moving average weighs the turn by now."""
        turn.pair[0] += turn.excess
        weighed = turn.excess * self._weight(turn, now)
        turn.excess = 0.0
        return weighed

    def _weight(self, turn: _Turn, now: int) -> float:
        """What the moving average weighs a held turn's seconds at by now."""
        return self._decay ** (now - turn.at)
