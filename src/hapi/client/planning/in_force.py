"""`PlanInForce`: the one owner of a job's plan - fixed or measured - and of its changes.

A job's chunks go by a (cut, local share): fixed by the user (`cut=`, `set_plan`), or
chosen by the planner from measurements (`cut="auto"`) and re-chosen while the job trains.
Between loops this object holds the (cut, share) and the plan; while a training loop runs
(`running`), its `Router` alone changes them, and the loop's end writes the router's back.
Measuring is the job's (`measure`); this object decides when: on first use, at once on
each server in turn - or, when none answers, in the background while the job trains on
the default plan (`hapi.client.planning._retry`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence

from hapi.client.pipeline.history import Event
from hapi.client.pipeline.routing import Router, check_choice
from hapi.client.planning._retry import DeferredPlan, measure_any, measure_round
from hapi.client.servers.connection import Connection
from hapi.client.servers.retry import RETRYABLE, RetryPolicy
from hapi.errors import HapiError
from hapi.plan import Plan, ReplanConfig, Replanner

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
            copy of its model, not on the one training).
        retries: how long measuring is retried.
        record: receives the events of planning (`plan-deferred`, `plan-failed`, `replan`).
        shared: under data parallelism, runs the measuring on rank 0 and gives every rank
            its plan; the ranks then never start on the default alone.
        cached: whether every feature of the next training epoch is in the trainer's
            cache: its chunks then need no server, and no plan is measured for them.
    """

    def __init__(
        self,
        *,
        fixed: Choice | None,
        default: Choice,
        connections: Sequence[Connection],
        measure: Callable[[Connection], Plan],
        measure_aside: Callable[[Connection], Plan],
        retries: RetryPolicy,
        record: Callable[[Event], None],
        shared: Callable[[Callable[[], Plan]], Plan] | None = None,
        cached: Callable[[], bool] | None = None,
    ) -> None:
        if fixed is not None:
            check_choice(*fixed)
        self._fixed = fixed
        self._default = default
        self._connections, self._measure, self._retries = connections, measure, retries
        self._measure_aside = measure_aside
        self._record, self._shared = record, shared
        self._cached = cached
        self._unmeasured = False
        """Every feature was cached when the plan was first needed: none was measured,
        and none is measured while the job trains (misses go at the default)."""
        self._choice: Choice | None = fixed
        self._plan: Plan | None = None
        self._router: Router | None = None

    @property
    def fixed(self) -> Choice | None:
        """The user's (cut, share), or None for a planned job."""
        return self._fixed

    @property
    def plan(self) -> Plan | None:
        """The plan in force (measured now if it has not been); None for a fixed job, and
        while a loop trains on the default plan because no server could be measured yet.

        Raises:
            ServerUnavailable, StoreUnavailable: no server could be measured within the
                retry budget.
        """
        if self._fixed is not None:
            return None
        if self._router is not None:
            return self._router.plan
        if self._plan is None:
            self._plan = self._plan_now()
            self._choice = (self._plan.cut, self._plan.share)
        return self._plan

    @property
    def current(self) -> Plan | None:
        """The plan in force if one was measured, without measuring it (None: a fixed job,
        or no plan yet)."""
        if self._fixed is not None:
            return None
        routed = self._router.plan if self._router is not None else None
        return routed or self._plan

    def in_force(self) -> Choice:
        """(cut, share) for the next chunk: the router's while a loop runs; else the
        plan's, measured on first use - or the default while no server answers."""
        if self._router is not None:
            return self._router.in_force
        if self._choice is None:
            self._choice = self._first_choice()
        return self._choice

    def set(self, cut: int, share: float, *, reason: str) -> None:
        """The user's (cut, share), for the chunks not yet issued (a cut already checked
        against the model).

        Raises:
            InvalidRequest: a share outside [0, 1], or a share with RAW.
        """
        check_choice(cut, share)
        plan = None
        if self._fixed is None and (current := self.plan) is not None:
            plan = current.with_choice(cut, share, reason=reason)
        if self._router is not None:
            self._router.set(cut, share, reason=reason, plan=plan)
        else:
            self._choice = (cut, share)
            if plan is not None:
                self._plan = plan
        if self._fixed is not None:
            self._fixed = (cut, share)

    @contextlib.contextmanager
    def running(
        self, *, train: bool, replan: bool | ReplanConfig, recall: Callable[[], list[str]]
    ) -> Iterator[Router]:
        """The router of one loop. A training loop's router changes the plan in force
        (re-planning when `replan`), and its plan is this object's when the loop ends.
        `recall` cuts the loop's streams in flight (`Router`)."""
        cut, share = self.in_force()
        config = replan if isinstance(replan, ReplanConfig) else None
        replans = train and self._fixed is None and replan is not False
        replanner = Replanner(self._plan, config) if replans and self._plan is not None else None
        served = threading.Event()  # a chunk was read while the plan is put off
        router = Router(cut, share, replanner=replanner, record=self._record, recall=recall,
                        served=served.set)  # fmt: skip
        deferred = replans and self._plan is None and not self._unmeasured
        if not train:
            yield router
            return
        self._router = router
        try:
            with self._deferred(router, config, served) if deferred else contextlib.nullcontext():
                yield router
        finally:
            router.settle()
            self._router = None
            self._choice = router.in_force
            if router.replanner is not None:
                self._plan = router.replanner.plan

    def _plan_now(self) -> Plan:
        """Measured now, retried and failed over within the budget. Data-parallel, rank 0
        measures and every rank takes its plan: the server is probed once, not by W ranks
        at once (each would measure a server the others load)."""
        measure = functools.partial(measure_any, self._connections, self._measure, self._retries)
        return measure() if self._shared is None else self._shared(measure)

    def _first_choice(self) -> Choice:
        """The plan's choice, measured now; or the default when no server can be measured:
        the plan is then measured while the job trains (`running`)."""
        if self._fixed is not None:
            return self._fixed
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
            return self._default
        if self._shared is not None:  # ranks take rank 0's plan together: none goes alone
            plan = self.plan
            assert plan is not None  # a planned job has one
            return (plan.cut, plan.share)
        try:
            self._plan = measure_round(self._connections, self._measure)
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
            return self._default
        return (self._plan.cut, self._plan.share)

    def _deferred(
        self, router: Router, config: ReplanConfig | None, served: threading.Event
    ) -> DeferredPlan:
        """The plan no server could be measured for, measured in the background and put
        into force when it comes."""

        def adopt(plan: Plan) -> None:
            router.begin(plan, Replanner(plan, config), reason="measured while training")

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

        return DeferredPlan(
            self._connections, self._measure_aside, self._retries, adopt=adopt, failed=failed,
            wake=served,
        )  # fmt: skip
