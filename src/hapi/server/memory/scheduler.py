"""`Scheduler`: which chunks run, at what batch size, within the memory budget.

Every batch a chunk computes is a `Grant`: a compute slot and `fixed + per_sample * batch`
bytes of the budget, taken before the batch is decoded and given back once it is encoded.
Grants go by weighted fair queuing over sessions, chunks in (epoch, chunk) order within a
session, the configured batch or the largest power of two that fits (idle heads evicted
through the `Reclaimer` first), and nothing for a requester that has gone (`Abandoned`).
The rules, and why a greedy choice rather than a solver: docs/server.md, "The scheduler".
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from hapi._sizes import format_bytes
from hapi.errors import HapiError, MemoryBusy, OverBudget
from hapi.server.memory.budget import MemoryModel

__all__ = [
    "Abandoned",
    "Demand",
    "Grant",
    "Place",
    "Reclaimer",
    "Scheduler",
    "SchedulerStats",
    "never",
]

POLL_S = 0.1
"""How often a waiting batch asks whether its requester has gone."""


def never() -> bool:
    """A requester that never goes (what a batch has when nobody can leave)."""
    return False


class Abandoned(HapiError):
    """A batch's requester went away while it waited: it left the queue, nothing granted.

    Defined here, not among the wire's errors: no client ever receives it (its requester
    has gone); the server logs it as a request's end, not as an internal error.
    """


class Reclaimer(Protocol):
    """What holds memory the scheduler may take back: the head cache's idle heads.

    A protocol, so the scheduler knows nothing of heads: it only asks how much could be
    freed and asks for it, and is never holding its own lock when it does.
    """

    def idle_bytes(self) -> int:
        """Bytes that `reclaim` could free now."""
        ...

    def reclaim(self, nbytes: int) -> int:
        """Free at least `nbytes` if possible (releasing them to the scheduler); return
        what was freed."""
        ...


@dataclass(frozen=True, kw_only=True)
class Demand:
    """What a chunk asks for to run its next batch."""

    model: MemoryModel
    """The session's memory per batch."""
    max_batch: int
    """The most samples the batch may take (the configured batch, or what is left)."""
    compute: bool = True
    """Whether it takes a compute slot; a RAW chunk only reads and sends."""


@dataclass(eq=False)
class Grant:
    """A batch's permission to run: its size and the bytes it holds."""

    batch: int
    nbytes: int
    queue_s: float
    """Seconds it waited for the scheduler."""
    started: float
    _scheduler: Scheduler = field(repr=False)
    _place: Place = field(repr=False)

    def grow(self, nbytes: int) -> bool:
        """Take `nbytes` more if they are free now (an image larger than expected)."""
        return self._scheduler._grow(self, nbytes)

    def follow(self, demand: Demand) -> Place:
        """Queue the chunk's next batch now, before this one ends, so that the chunk
        keeps its turn: otherwise the moment between two of its batches lets the next
        chunk in, and every chunk in flight advances together. Pass the place to `run`
        (or to `Scheduler.cancel` if the batch is not run after all)."""
        place = self._place
        return self._scheduler._enqueue(
            place.session, place.order, demand, place.weight, place.gone
        )


@dataclass(frozen=True)
class SchedulerStats:
    """The budget and what holds it now."""

    budget: int
    used: int
    peak: int
    """The most `used` has been since the server started."""
    reserved: int
    """Of `used`, what heads hold (the rest is running batches)."""
    slots: int
    running: int
    waiting: int


@dataclass
class _Share:
    weight: float
    vtime: float = 0.0
    active: int = 0
    """Its batches running or waiting."""
    rate: float = 0.0
    """Seconds per sample of its recent batches (the charge estimated at a grant)."""
    removed: bool = False
    """Its session is closed: forget the share when nothing of it runs or waits."""


@dataclass(eq=False)
class Place:
    """A batch's place in the scheduler's queue."""

    session: str
    order: tuple[int, ...]
    demand: Demand
    weight: float
    seq: int
    since: float
    gone: Callable[[], bool] = never
    """Whether its requester has gone (then it leaves the queue ungranted)."""
    grant: Grant | None = None
    charged: float = 0.0


class Scheduler:
    """Grants batches of every session's chunks within a memory budget and compute slots.

    Args:
        budget: bytes that heads and running batches may hold together.
        slots: batches that compute at once (the server's cores, or 1-2 per GPU).
        reclaimer: frees idle heads when a batch needs their memory.
        clock: monotonic seconds (tests pass a fake one).
        kept: bytes the C allocator may keep of batches that ended (`bound_allocator`),
            which the budget does not count: a batch granted when less than this is free
            first has `give_back` return them.
        give_back: returns the allocator's kept memory to the system.
    """

    def __init__(
        self,
        budget: int,
        slots: int,
        *,
        reclaimer: Reclaimer | None = None,
        clock: Callable[[], float] = time.monotonic,
        kept: int = 0,
        give_back: Callable[[], object] | None = None,
    ) -> None:
        if budget < 1 or slots < 1:
            raise ValueError(f"budget and slots must be >= 1, got {budget} and {slots}")
        self.budget = budget
        self.slots = slots
        self.reclaimer = reclaimer
        self.kept, self._give_back = kept, give_back
        self._clock = clock
        self._cond = threading.Condition()
        self._shares: dict[str, _Share] = {}
        self._waiting: list[Place] = []
        self._seq = itertools.count()
        self._used = 0
        self._reserved = 0
        self._pending = 0
        self._peak = 0
        self._running = 0
        self._vclock = 0.0
        self._granted = 0
        self._quiet_since: float | None = None
        """When the last granted batch ended; None while one is granted, and before any."""

    # Sessions ------------------------------------------------------------------------

    def remove_session(self, session: str) -> None:
        """Forget a closed session's share once its running batches have finished."""
        with self._cond:
            share = self._shares.get(session)
            if share is not None:
                share.removed = True
                if not share.active:
                    del self._shares[session]

    # Memory that is not a batch (heads) --------------------------------------------------

    def reserve(self, nbytes: int, what: str = "a head") -> None:
        """Hold `nbytes` for something long-lived, waiting for batches to end if needed.

        While it waits no new batch starts, so a stream of batches cannot starve it.

        Raises:
            OverBudget: it cannot fit even when every idle head is evicted and no batch
                runs (what open sessions hold stays).
        """
        with self._cond:
            self._pending += nbytes
        try:
            while True:
                held = self._held()
                if nbytes > self.budget - held:
                    raise _refusal(nbytes, self.budget)(
                        f"{what} needs {format_bytes(nbytes)}, but this server's memory "
                        f"budget is {format_bytes(self.budget)}, of which open sessions "
                        f"hold {format_bytes(held)}: close sessions, use a smaller model, "
                        "compute it in the trainer, or raise --memory-budget"
                    )
                with self._cond:
                    free = self.budget - self._used
                    if free >= nbytes:
                        self._used += nbytes
                        self._reserved += nbytes
                        self._peak = max(self._peak, self._used)
                        return
                reclaimed = self.reclaimer.reclaim(nbytes - free) if self.reclaimer else 0
                if not reclaimed:
                    with self._cond:
                        if self.budget - self._used < nbytes:
                            # A timeout, as idle heads may become evictable without a
                            # release here (a session closing).
                            self._cond.wait(timeout=0.5)
        finally:
            with self._cond:
                self._pending -= nbytes
                self._cond.notify_all()

    def release(self, nbytes: int) -> None:
        """Give back memory taken with `reserve`."""
        with self._cond:
            self._used -= nbytes
            self._reserved -= nbytes
            self._cond.notify_all()

    def check_fits(self, model: MemoryModel, what: str, extra: int = 0) -> None:
        """Refuse what could never run: one sample of `model` (plus `extra` bytes not yet
        reserved, a new head) beyond the budget less what open sessions' heads hold.

        Raises:
            OverBudget: naming the budget and the sizes.
        """
        need = model.batch_bytes(1) + extra
        held = self._held()
        if need > self.budget - held:
            raise _refusal(need, self.budget)(
                f"{what} needs {format_bytes(need)} for one sample (head "
                f"{format_bytes(extra)}, batch {format_bytes(model.batch_bytes(1))}) but "
                f"this server's memory budget is {format_bytes(self.budget)}, of which "
                f"open sessions' heads hold {format_bytes(held)}: use a smaller image "
                "size, transforms or cut, compute it in the trainer, or raise "
                "--memory-budget"
            )

    # Batches -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def run(
        self,
        session: str,
        order: tuple[int, ...],
        demand: Demand,
        *,
        weight: float = 1.0,
        place: Place | None = None,
        gone: Callable[[], bool] = never,
    ) -> Iterator[Grant]:
        """Wait for a grant to run one batch of `session`'s chunk `order`, hold it while
        the block runs, and give it back.

        Args:
            session: whose share the batch counts in.
            order: the chunk's place in its session (lowest first): (epoch, chunk).
            demand: the batch's memory and largest size.
            weight: the session's weight now (a tenant's weight may change on reload).
            place: the place `Grant.follow` queued for this batch (then the other
                arguments are those it was queued with).
            gone: whether the batch's requester has gone; asked every `POLL_S` while it
                waits, from the waiting thread, so it must be safe to call from there.

        Raises:
            OverBudget: one sample of `demand` can never fit (see `check_fits`).
            Abandoned: `gone()` said so before the batch was granted.
        """
        if place is None:
            self.check_fits(demand.model, "this chunk")
            place = self._enqueue(session, order, demand, weight, gone)
        waiter = place
        grant = self._await(waiter)
        try:
            self._make_room()
            yield grant
        finally:
            self._finish(waiter, grant)

    def cancel(self, place: Place) -> None:
        """Give up a place `Grant.follow` queued, granted or not."""
        with self._cond:
            granted = place.grant is not None
            if not granted:
                self._waiting.remove(place)
                share = self._shares[place.session]
                share.active -= 1
                if share.removed and not share.active:
                    del self._shares[place.session]
                self._cond.notify_all()
        if place.grant is not None:
            self._finish(place, place.grant)

    def free_share(self, running_self: int = 1) -> float:
        """The share of compute slots no other batch uses or waits for (push-back)."""
        with self._cond:
            busy = self._running - running_self + sum(w.demand.compute for w in self._waiting)
            return max(0.0, min(1.0, (self.slots - busy) / self.slots))

    def quiet_since(self) -> float | None:
        """When the last batch ended, if none runs or waits now (the clock's seconds); None
        while one does, and before the first (`give_back_when_quiet`)."""
        with self._cond:
            return None if self._waiting else self._quiet_since

    def stats(self) -> SchedulerStats:
        """The budget and what holds it now."""
        with self._cond:
            return SchedulerStats(
                budget=self.budget,
                used=self._used,
                peak=self._peak,
                reserved=self._reserved,
                slots=self.slots,
                running=self._running,
                waiting=len(self._waiting),
            )

    # Internals ---------------------------------------------------------------------------

    def _make_room(self) -> None:
        """Have the allocator give back what it kept of earlier batches where the budget
        has no room left for it: a full budget is what a memory cap is sized for."""
        if self._give_back is None:
            return
        with self._cond:
            tight = self.budget - self._used < self.kept
        if tight:
            self._give_back()

    def _held(self) -> int:
        idle = self.reclaimer.idle_bytes() if self.reclaimer is not None else 0
        with self._cond:
            return max(self._reserved - idle, 0)

    def _enqueue(
        self,
        session: str,
        order: tuple[int, ...],
        demand: Demand,
        weight: float,
        gone: Callable[[], bool] = never,
    ) -> Place:
        with self._cond:
            share = self._shares.setdefault(session, _Share(weight=weight))
            share.weight = weight
            if not share.active:
                share.vtime = max(share.vtime, self._vclock)
            share.active += 1
            waiter = Place(
                session, order, demand, weight, next(self._seq), self._clock(), gone=gone
            )
            self._waiting.append(waiter)
            return waiter

    def _await(self, waiter: Place) -> Grant:
        try:
            while True:
                with self._cond:
                    # Every wait follows a dispatch under the same hold of the lock, so
                    # no release is missed; the timeout asks `gone` now and then.
                    shortfall = self._dispatch()
                    if waiter.grant is None and not shortfall:
                        self._cond.wait(POLL_S)
                    if waiter.grant is not None:
                        return waiter.grant
                # Asked outside the lock: it may be a call into gRPC.
                if waiter.gone():
                    waited = self._clock() - waiter.since
                    raise Abandoned(
                        f"a batch of session {waiter.session} waited {waited:.1f}s and its "
                        "requester went away: it leaves the queue without running"
                    )
                if not shortfall:
                    continue
                # Evict idle heads outside the lock: the head cache gives back what it
                # frees through `release`, which takes the lock.
                reclaimed = self.reclaimer.reclaim(shortfall) if self.reclaimer else 0
                if not reclaimed:
                    with self._cond:
                        self._dispatch()
                        if waiter.grant is None:
                            self._cond.wait(POLL_S)
        except BaseException:
            self.cancel(waiter)
            raise

    def _dispatch(self) -> int:
        """Grant what fits, in fair order; return the bytes the next in line lacks."""
        now = self._clock()
        while self._waiting:
            candidates = [
                w for w in self._waiting if not w.demand.compute or self._running < self.slots
            ]
            if not candidates:
                return 0
            w = min(
                candidates,
                key=lambda w: (self._shares[w.session].vtime, w.session, w.order, w.seq),
            )
            free = self.budget - self._used - self._pending
            batch = w.demand.model.largest_batch(free, max(w.demand.max_batch, 1))
            if batch == 0:
                return w.demand.model.batch_bytes(1) - free
            nbytes = w.demand.model.batch_bytes(batch)
            self._waiting.remove(w)
            self._used += nbytes
            self._peak = max(self._peak, self._used)
            if w.demand.compute:
                self._running += 1
            self._granted += 1
            self._quiet_since = None
            share = self._shares[w.session]
            self._vclock = share.vtime
            w.charged = share.rate * batch
            share.vtime += w.charged / share.weight
            w.grant = Grant(batch, nbytes, now - w.since, now, self, w)
            self._cond.notify_all()
        return 0

    def _grow(self, grant: Grant, nbytes: int) -> bool:
        with self._cond:
            if self.budget - self._used < nbytes:
                return False
            self._used += nbytes
            self._peak = max(self._peak, self._used)
            grant.nbytes += nbytes
            return True

    def _finish(self, waiter: Place, grant: Grant) -> None:
        with self._cond:
            self._used -= grant.nbytes
            if waiter.demand.compute:
                self._running -= 1
            self._granted -= 1
            if not self._granted:
                self._quiet_since = self._clock()
            share = self._shares[waiter.session]
            share.active -= 1
            if share.removed and not share.active:
                del self._shares[waiter.session]
            spent = max(self._clock() - grant.started, 0.0)
            share.vtime += (spent - waiter.charged) / share.weight
            per_sample = spent / max(grant.batch, 1)
            share.rate = per_sample if not share.rate else 0.7 * share.rate + 0.3 * per_sample
            self._cond.notify_all()


def _refusal(need: int, budget: int) -> type[OverBudget]:
    """`OverBudget` for what no budget of this size holds; `MemoryBusy` for what it would
    hold once other sessions close theirs: a job waits for that (it is retried)."""
    return OverBudget if need > budget else MemoryBusy
