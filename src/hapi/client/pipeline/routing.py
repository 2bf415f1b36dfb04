"""`Router`: which way each chunk goes - pushed down at the cut, or computed locally.

The plan in force is a cut `k` and a local share `f`. Chunks are routed when they are
issued, so a change of plan (the re-planner's or the user's) applies to the chunks not
yet issued; a chunk in flight follows a change of cut, or a fall of the share, with the
keys it has not yet delivered, when that saves time (`reroute`): each key is still
delivered once. Local chunks are spread evenly over the rest of the epoch
(`hapi.plan.assign`) from the chunk where the share took effect.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from hapi.client.pipeline.history import Event, ignore_event
from hapi.errors import InvalidRequest
from hapi.graph import INPUT, RAW
from hapi.plan import Plan, ReadMeasurement, TrainMeasurement, assign

__all__ = [
    "ChunkRecord",
    "PlanCell",
    "PlanVersion",
    "Route",
    "Router",
    "check_choice",
    "recall_nothing",
]


def recall_nothing() -> list[str]:
    """A router's recall with no streams to cut (a loop whose sources it does not know)."""
    return []


@dataclass(frozen=True)
class Route:
    """How one chunk travels."""

    local: bool
    """The server sends raw bytes and the trainer computes the features."""
    cut: int
    """The cut its features reach the tail at (INPUT for the baseline's chunks)."""
    share: float = field(default=0.0, compare=False)
    """The local share of the plan it was routed by (what `Router.reroute` weighs)."""

    @property
    def wire_cut(self) -> int:
        """The session's cut: RAW for a local chunk."""
        return RAW if self.local else self.cut


@dataclass(frozen=True, kw_only=True)
class ChunkRecord:
    """One chunk, delivered and trained: what the loader measured (the epoch's record;
    the router hears it stage by stage, as `ReadMeasurement` and `TrainMeasurement`)."""

    chunk: int
    epoch: int
    route: Route
    samples: int
    bytes: int
    server_s: float | None
    """The server's compute on it as it reported; None: it reported none."""
    transfer_s: float | None
    """The link's time on it; None: its stream showed the server's pace, not the link's."""
    trainer_s: float
    """The trainer's compute on it."""
    transfer_buffered: bool = False
    """Its bytes may have crossed before its turn: `transfer_s` is a lower bound."""
    issued: float | None = None
    """When it was requested (`time.perf_counter`)."""
    read_end: float | None = None
    """When its read ended (`time.perf_counter`)."""


@dataclass(frozen=True)
class PlanVersion:
    """One version of the plan in force: chunks issued under it follow it whole."""

    cut: int
    share: float = 0.0
    version: int = 0
    """Counts the versions published before it: a router applies each new one once."""
    reason: str = ""
    plan: Plan | None = None
    """The measured plan it comes from (None: the user's cut, or the default)."""


class PlanCell:
    """The plan in force: one immutable `PlanVersion`, replaced whole by `publish` and read
    whole by `get`, so a reader never sees a cut with another version's share.

    A job's `PlanInForce` owns one and is its only publisher (the user's `set_plan`, the
    re-planner, a plan measured late); routers read it per chunk and watch it, to recall
    the chunks in flight that a new version moves.
    """

    def __init__(self, cut: int, share: float = 0.0, *, plan: Plan | None = None) -> None:
        check_choice(cut, share)
        self._value = PlanVersion(cut, share, plan=plan)
        self._lock = threading.Lock()
        self._watchers: list[Callable[[PlanVersion], None]] = []

    def get(self) -> PlanVersion:
        """The version in force now."""
        return self._value

    def publish(
        self, cut: int, share: float = 0.0, *, reason: str, plan: Plan | None = None
    ) -> None:
        """Put (`cut`, `share`) into force for the chunks issued from now on; each watcher
        hears the version it replaced.

        Raises:
            InvalidRequest: a share outside [0, 1], or a share with RAW.
        """
        check_choice(cut, share)
        with self._lock:
            before = self._value
            self._value = PlanVersion(cut, share, before.version + 1, reason, plan)
            watchers = list(self._watchers)
        for watcher in watchers:
            watcher(before)

    def watch(self, watcher: Callable[[PlanVersion], None]) -> Callable[[], None]:
        """Call `watcher` with the version replaced at each publish, until the returned
        function is called."""
        with self._lock:
            self._watchers.append(watcher)

        def unwatch() -> None:
            with self._lock:
                self._watchers.remove(watcher)

        return unwatch


class Router:
    """Routes chunks by the plan in force, read from its `PlanCell` at each chunk issued.

    Args:
        plan: the plan in force (a cut alone: a cell of its own, with `share`).
        share: the local share, with a cut.
        observe: hears what each chunk measured (the re-planner's food).
        applied: hears each new version when the first chunk goes by it.
        record: receives an `Event` for each change of plan applied, and each recall.
        recall: cuts the chunk streams in flight (a change of plan moved their chunks)
            and returns the addresses of the servers that had some; the loop's sources'
            (`hapi.client.servers.source.recall_all`). Default: nothing is in flight to cut.
    """

    def __init__(
        self,
        plan: PlanCell | int,
        share: float = 0.0,
        *,
        observe: Callable[[ReadMeasurement | TrainMeasurement], None] | None = None,
        applied: Callable[[PlanVersion], None] | None = None,
        record: Callable[[Event], None] = ignore_event,
        recall: Callable[[], list[str]] = recall_nothing,
    ) -> None:
        self.cell = plan if isinstance(plan, PlanCell) else PlanCell(plan, share)
        self._observe = observe
        self._on_applied = applied
        self._record = record
        self._recall = recall
        self._lock = threading.Lock()
        self._applied = self.cell.get()
        self._epoch: int | None = None
        self._chunks = 0
        self._origin = 0
        self._issued = 0
        self.close = self.cell.watch(self._published)
        """Stop following the cell's changes (the loop ended)."""

    @property
    def applied(self) -> tuple[int, float]:
        """(cut, share) of the last chunk issued: a change not yet applied left out."""
        with self._lock:
            return self._applied.cut, self._applied.share

    @property
    def in_force(self) -> tuple[int, float]:
        """(cut, share) for the next chunk issued: a change not yet applied included."""
        value = self.cell.get()
        return value.cut, value.share

    @property
    def epoch(self) -> int | None:
        """The epoch being routed (None: before the first)."""
        with self._lock:
            return self._epoch

    @property
    def changing(self) -> bool:
        """Whether a change of plan waits for the next chunk routed."""
        with self._lock:
            return self._applied.version != self.cell.get().version

    def start(self, epoch: int, chunks: int) -> None:
        """A new epoch of `chunks` chunks: local chunks are spread over all of it."""
        with self._lock:
            self._epoch, self._chunks, self._origin, self._issued = epoch, chunks, 0, 0

    def route(self, chunk: int) -> Route:
        """The route of `chunk`, issued now (chunks are issued in order). Asked again for
        the same chunk, not yet issued, after a change of plan: its route under the new
        plan, which applies from it."""
        with self._lock:
            self._apply(chunk)
            self._issued = chunk + 1
            cut, share = self._applied.cut, self._applied.share
            if cut == RAW:
                return Route(local=True, cut=INPUT, share=1.0)
            ids = range(self._origin, max(self._chunks, chunk + 1))
            local = share > 0 and assign(ids, share)[chunk - self._origin]
            return Route(local=local, cut=cut, share=share)

    def reroute(self, route: Route) -> Route:
        """The route a chunk issued on `route`, with keys still to come, takes now.

        A pushed-down chunk follows a change of cut - on a link that has just dropped,
        the chunks in flight at the old cut would cost seconds each - with the keys it has
        not yet delivered. A local chunk goes pushed down at the plan's cut when the
        plan's share fell below the one it was routed by: its raw bytes are the most a
        chunk puts on the link. (When the share rises, the chunks issued from the change
        on carry it.) Under a plan with profiles (`cut="auto"`) a chunk moves only when
        that pays (`_pays`); the user's own cut is followed at once.
        """
        value = self.cell.get()
        cut, share = value.cut, value.share
        if route.local:
            if cut == RAW or share >= route.share:
                return route
        elif cut == route.cut:
            return route
        elif cut == RAW:
            return Route(local=True, cut=INPUT, share=1.0)
        moved = Route(local=False, cut=cut, share=share)
        return moved if _pays(value.plan, route.wire_cut, cut) else route

    def recall(self) -> None:
        """Cut the chunk streams in flight with what the servers had sent ahead on them,
        which would otherwise cross the link on the old route first; each chunk asks again
        for the keys it has not delivered. Called outside the router's lock."""
        cut = self._recall()
        if cut:
            self._record(
                Event(
                    "recall",
                    self.epoch,
                    None,
                    f"the plan moved the chunks in flight: their streams from {', '.join(cut)} "
                    "were cut with what the server had sent ahead, and asked again",
                    {"servers": cut},
                )
            )

    def _published(self, before: PlanVersion) -> None:
        """A new version is in force: the chunks in flight, which follow the version it
        replaced, are recalled if it moves them."""
        if self._moves(before.cut, before.share):
            self.recall()

    def _moves(self, cut: int, share: float) -> bool:
        """Whether chunks routed by (`cut`, `share`) move under the plan in force."""
        if cut == RAW:
            routes = [Route(local=True, cut=INPUT, share=1.0)]
        else:
            routes = [Route(local=False, cut=cut, share=share)]
            if share > 0:
                routes.append(Route(local=True, cut=cut, share=share))
        return any(self.reroute(route) != route for route in routes)

    def observe(self, measured: ReadMeasurement | TrainMeasurement) -> None:
        """Pass on what a chunk measured (its server's and link's time when it is read, its
        trainer's when it is trained). Thread-safe."""
        if self._observe is not None:
            self._observe(measured)

    def settle(self) -> None:
        """At the loop's end: a change no chunk was issued under yet is the next loop's,
        and is recorded now (or the history would show an epoch's cut with no re-plan)."""
        with self._lock:
            self._apply(self._issued, at_end=True)

    def _apply(self, chunk: int, *, at_end: bool = False) -> None:
        """Issue from `chunk` on under the version in force, if it is new (under the lock)."""
        value = self.cell.get()
        if value.version == self._applied.version:
            return
        before, self._applied = self._applied, value
        if self._on_applied is not None:
            self._on_applied(value)
        self._origin = chunk  # local chunks spread anew from here
        if (before.cut, before.share) == (value.cut, value.share):
            return  # the same choice again: nothing to record
        data = {
            "from": {"cut": before.cut, "share": before.share},
            "to": {"cut": value.cut, "share": value.share},
        }
        if value.plan is not None:
            data["plan"] = value.plan.to_dict()
        self._record(
            Event(
                "replan",
                self._epoch,
                chunk,
                f"{'for the next loop' if at_end else f'from chunk {chunk}'}: "
                f"{_label(before.cut, before.share)} -> {_label(value.cut, value.share)} "
                f"({value.reason})",
                data,
            )
        )


def _pays(plan: Plan | None, wire_cut: int, cut: int) -> bool:
    """Whether a chunk's keys sent at `cut` instead of `wire_cut` save more link time
    than the server's computing them again costs (per sample, at the plan's rates; with
    no plan - the user's cut - always).

    The server has mostly computed a chunk by its turn, and what it wrote crosses
    anyway: a move from cut 10 (16 KB a sample) to cut 11 (8 KB) after a re-plan
    made a chunk's turn 0.23-0.49 s where staying would have taken 0.11 s. After a
    link drop the saving is 30x the cost, and the chunks move.
    """
    if plan is None:
        return True
    server = plan.server
    saved = (server.wire_bytes(wire_cut) - server.wire_bytes(cut)) / plan.link.bytes_per_s
    return saved > server.compute_s(cut)


def check_choice(cut: int, share: float) -> None:
    """Raise `InvalidRequest` for a (cut, share) no router can follow."""
    if not 0.0 <= share <= 1.0:
        raise InvalidRequest(f"local share must be in [0, 1], got {share}")
    if cut == RAW and share:
        raise InvalidRequest("RAW computes every chunk locally already: give it no share")
    if cut < RAW:
        raise InvalidRequest(f"cut must be RAW (-1), INPUT (0) or a cut point, got {cut}")


def _label(cut: int, share: float) -> str:
    base = {RAW: "RAW", INPUT: "INPUT"}.get(cut, f"cut {cut}")
    return f"{base} + {share:.0%} local" if share else base
