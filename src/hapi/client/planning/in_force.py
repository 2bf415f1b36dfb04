"""`PlanInForce`: the one owner of a job's plan - fixed or measured - and of its changes.

A job's chunks go by a (cut, local share): fixed by the user (`cut=`, `set_plan`), or
chosen by the planner from measurements (`cut="auto"`) and re-chosen while the job trains.
The plan in force is one immutable value in a `PlanCell` that this object alone publishes
to - the user's choice, the re-planner's, a plan measured late - and every loop's router
reads per chunk. Measuring is the job's (`measure`); this object decides when: on first
use, on each server in turn, or in the background while the job trains on the default.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence

from hapi.client.pipeline.history import Event
from hapi.client.pipeline.routing import PlanCell, PlanVersion, Router, check_choice
from hapi.client.planning._retry import DeferredPlan, measure_any, measure_round
from hapi.client.planning.chunk_tally import ChunkTally
from hapi.client.servers.retry import RETRYABLE, RetryPolicy
from hapi.client.servers.source import Server
from hapi.errors import HapiError
from hapi.plan import Plan, ReadMeasurement, ReplanConfig, Replanner, TrainMeasurement

__all__ = ["PlanInForce"]

Choice = tuple[int, float]


class PlanInForce:
    """A job's plan in force.

    Args:
        fixed: the (cut, share) the user fixed; None: the planner chooses (`cut="auto"`).
        default: the (cut, share) a job trains on while its plan cannot be measured (the
            freeze cut, nothing local).
        connections: the job's servers, measured in turn.
        measure: measures one server and returns the plan.
        measure_aside: the same, safe to run while the job trains (the trainer timed on a
            copy of its model, not on the one training), given the job's own chunks at
            the default's cut where it trains on them meanwhile.
        retries: how long measuring is retried.
        record: receives the events of planning (`plan-deferred`, `plan-failed`, `replan`).
        shared: under data parallelism, runs the measuring on rank 0 and gives every rank
            its plan; the ranks then never start on the default alone.
        cached: whether every feature of the next training epoch is in the trainer's
            cache: its chunks then need no server, and no plan is measured for them.
        beside: whether a training loop starts at once on the default while its plan is
            measured beside it, its own chunks standing in for the probe at the freeze
            cut (a job with nothing measured before: `docs/cost-model.md`, "Measured
            while it trains"); None or False: measured before the loop starts.
    """

    def __init__(
        self,
        *,
        fixed: Choice | None,
        default: Choice,
        connections: Sequence[Server],
        measure: Callable[[Server], Plan],
        measure_aside: Callable[[Server, ChunkTally | None], Plan],
        retries: RetryPolicy,
        record: Callable[[Event], None],
        shared: Callable[[Callable[[], Plan]], Plan] | None = None,
        cached: Callable[[], bool] | None = None,
        beside: Callable[[], bool] | None = None,
    ) -> None:
        self._fixed = fixed is not None
        self._default = default
        self._cell = PlanCell(*(fixed or default))
        """The plan in force: published here only, read by the routers of the loops."""
        self._chosen = self._fixed
        """Whether the first choice was made (the default counts, when nothing answered)."""
        self._connections, self._measure, self._retries = connections, measure, retries
        self._measure_aside = measure_aside
        self._record, self._shared = record, shared
        self._cached, self._beside = cached, beside
        self._tally: ChunkTally | None = None
        """The job's chunks at the default's cut, while its plan is measured beside them."""
        self._unmeasured = False
        """Every feature was cached when the plan was first needed: none was measured,
        and none is measured while the job trains (misses go at the default)."""
        self._running = False
        """A training loop runs: the plan is measured in the background, not on demand."""
        self._replanner: Replanner | None = None
        """The running training loop's, weighing its chunks against the plan in force."""
        # Chunks are observed from the fetching threads (read) and the training thread
        # (trained). Never held while publishing: a publish may recall streams.
        self._replanning = threading.Lock()

    @property
    def fixed(self) -> Choice | None:
        """The user's (cut, share), or None for a planned job."""
        return self.in_force() if self._fixed else None

    @property
    def plan(self) -> Plan | None:
        """The plan in force (measured now if it has not been); None for a fixed job, and
        while a loop trains on the default plan because no server could be measured yet.

        Raises:
            ServerUnavailable, StoreUnavailable: no server could be measured within the
                retry budget.
        """
        if self._fixed:
            return None
        if self._running and self._replanner is not None:
            return self._replanner.plan  # re-predicted as chunks are measured
        if self._cell.get().plan is None and not self._running:
            plan = self._plan_now()
            self._cell.publish(plan.cut, plan.share, reason=plan.reason, plan=plan)
            self._chosen = True
        return self._cell.get().plan

    @property
    def current(self) -> Plan | None:
        """The plan in force if one was measured, without measuring it (None: a fixed job,
        or no plan yet)."""
        return None if self._fixed else self._cell.get().plan

    def in_force(self) -> Choice:
        """(cut, share) for the next chunk: the plan's, measured on first use - or the
        default while no server answers."""
        if not self._chosen:
            self._first_choice()
            self._chosen = True
        value = self._cell.get()
        return value.cut, value.share

    def set(self, cut: int, share: float, *, reason: str) -> None:
        """The user's (cut, share), for the chunks not yet issued (a cut already checked
        against the model).

        Raises:
            InvalidRequest: a share outside [0, 1], or a share with RAW.
        """
        check_choice(cut, share)
        plan = None
        if not self._fixed and (current := self.plan) is not None:
            plan = current.with_choice(cut, share, reason=reason)
        self._cell.publish(cut, share, reason=reason, plan=plan)
        self._chosen = True

    @contextlib.contextmanager
    def running(
        self, *, train: bool, replan: bool | ReplanConfig, recall: Callable[[], list[str]]
    ) -> Iterator[Router]:
        """The router of one loop. A training loop's re-planner (when `replan`) publishes
        the plans it measures. `recall` cuts the loop's streams in flight (`Router`)."""
        config = replan if isinstance(replan, ReplanConfig) else None
        replans = train and not self._fixed and replan is not False
        if not self._chosen:
            self._first_choice(beside=replans)
            self._chosen = True
        plan = self._cell.get().plan
        served = threading.Event()  # a chunk was read while the plan is put off
        observe = functools.partial(self._observe, served)
        router = Router(
            self._cell, observe=observe, applied=self._applied, record=self._record, recall=recall
        )
        if not train:
            try:
                yield router
            finally:
                router.close()
            return
        deferred = replans and plan is None and not self._unmeasured
        self._replanner = Replanner(plan, config) if replans and plan is not None else None
        self._running = True
        tally = self._tally
        if tally is not None:
            tally.reopen()
        try:
            with self._deferred(router, config, served) if deferred else contextlib.nullcontext():
                try:
                    yield router
                finally:
                    if tally is not None:  # a plan waiting for more of its chunks ends now
                        tally.close()
        finally:
            router.settle()
            router.close()
            self._running = False
            with self._replanning:
                last, self._replanner = self._replanner, None
            value = self._cell.get()
            if last is not None and last.plan is not value.plan:  # re-predicted meanwhile
                self._cell.publish(value.cut, value.share, reason=value.reason, plan=last.plan)

    def _observe(
        self, served: threading.Event, measured: ReadMeasurement | TrainMeasurement
    ) -> None:
        """What a chunk measured, for the re-planner; a plan it calls for is published."""
        with self._replanning:
            replanner = self._replanner
            if replanner is None:
                if isinstance(measured, ReadMeasurement):
                    served.set()  # a server answers: a plan put off may be measured now
                    if self._tally is not None:
                        self._tally.add(measured)
                return
            if isinstance(measured, ReadMeasurement):
                change = replanner.observe(measured)
            else:
                change = replanner.observe(trained=measured)
        if change is not None and change.changed:  # a re-prediction alone stays its own
            plan = change.plan
            self._cell.publish(plan.cut, plan.share, reason=change.reason, plan=plan)

    def _applied(self, value: PlanVersion) -> None:
        """A router issues chunks by `value` from now on: the re-planner measures drift
        from here, the chunks in flight under the version before no longer count."""
        if value.plan is not None:
            with self._replanning:
                if self._replanner is not None:
                    self._replanner.adopt(value.plan)

    def _plan_now(self) -> Plan:
        """Measured now, retried and failed over within the budget. Data-parallel, rank 0
        measures and every rank takes its plan: the server is probed once, not by W ranks
        at once (each would measure a server the others load)."""
        measure = functools.partial(measure_any, self._connections, self._measure, self._retries)
        return measure() if self._shared is None else self._shared(measure)

    def _first_choice(self, *, beside: bool = False) -> None:
        """The plan's choice put into force, measured now; or the default kept - where
        a training loop starts (`beside`) on a job with nothing measured before, or no
        server can be measured - and the plan measured while the job trains (`running`)."""
        if self._shared is None and self._cached is not None and self._cached():
            self._unmeasured = True
            self._record(
                Event(
                    "plan",
                    None,
                    None,
                    "every feature of the epoch is in the trainer's cache: no plan measured; "
                    "chunks that miss go at the freeze cut",
                    {"cut": self._default[0], "share": self._default[1], "cached": True},
                )
            )
            return
        if self._shared is not None:  # ranks take rank 0's plan together: none goes alone
            self.plan  # noqa: B018 - measured and published by the property
            return
        if beside and self._beside is not None and self._first_run():
            self._tally = ChunkTally(self._default[0])
            self._record(
                Event(
                    "plan-aside",
                    None,
                    None,
                    "nothing measured before for this job: training starts on the freeze cut "
                    "and the plan is measured beside it, from its own chunks",
                    {"cut": self._default[0], "share": self._default[1]},
                )
            )
            return
        try:
            plan = measure_round(self._connections, self._measure)
        except RETRYABLE as exc:
            self._record(
                Event(
                    "plan-deferred",
                    None,
                    None,
                    f"no server could be measured ({exc}): training starts on the freeze "
                    f"cut and the plan follows once a server answers",
                    {"error": type(exc).__name__},
                )
            )
            return
        self._cell.publish(plan.cut, plan.share, reason=plan.reason, plan=plan)

    def _first_run(self) -> bool:
        """Whether the job has nothing measured before (`beside`); a job that cannot tell
        for want of a server is measured beside its training as well."""
        assert self._beside is not None
        try:
            return self._beside()
        except RETRYABLE:
            return True

    def _deferred(
        self, router: Router, config: ReplanConfig | None, served: threading.Event
    ) -> DeferredPlan:
        """The plan no server could be measured for, measured in the background and put
        into force when it comes."""

        def adopt(plan: Plan) -> None:
            with self._replanning:
                self._replanner = Replanner(plan, config)
                self._tally = None
            self._cell.publish(plan.cut, plan.share, reason="measured while training", plan=plan)

        def put_off(error: Exception) -> None:
            if self._tally is None:  # deferred for want of a server: said already
                return
            self._record(
                Event(
                    "plan-deferred",
                    router.epoch,
                    None,
                    f"no server could be measured ({error}): training goes on on the freeze "
                    f"cut and the plan follows once a server answers",
                    {"error": type(error).__name__},
                )
            )

        def failed(error: HapiError) -> None:
            self._record(
                Event(
                    "plan-failed",
                    router.epoch,
                    None,
                    f"no server could be measured within {self._retries.budget_s:g} s "
                    f"({error}): the job keeps the freeze cut",
                    {"error": type(error).__name__},
                )
            )

        tally = self._tally

        def measure(connection: Server) -> Plan:
            return self._measure_aside(connection, tally)

        return DeferredPlan(
            self._connections, measure, self._retries, adopt=adopt, failed=failed,
            wake=served, put_off=put_off,
        )  # fmt: skip
