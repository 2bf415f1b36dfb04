"""A plan put off because no server answered is measured again as soon as a chunk shows a
server is back, not at the end of its backoff; a job with nothing measured before trains
at once and is planned from its own chunks."""

from __future__ import annotations

import threading
import time

from hapi.client.pipeline.history import Event
from hapi.client.pipeline.routing import recall_nothing
from hapi.client.planning._retry import measure_any
from hapi.client.planning.chunk_tally import ChunkTally
from hapi.client.planning.in_force import PlanInForce
from hapi.client.servers.connection import Connection
from hapi.client.servers.retry import RetryPolicy
from hapi.errors import ServerUnavailable
from hapi.plan import (
    LinkProfile,
    Plan,
    ReadMeasurement,
    ServerProfile,
    TrainerProfile,
    TrainMeasurement,
    Workload,
    choose_plan,
)

SLOW = RetryPolicy(budget_s=120.0, initial_s=30.0, max_wait_s=30.0)
"""Backoffs of 30 s: a retry within seconds can only be the wake's."""


def _plan() -> Plan:
    """A plan at cut 2 of three (the default below is cut 1)."""
    server = ServerProfile(
        read_s=0.001, decode_s=0.010, head_s=(0.0, 0.010, 0.020),
        out_bytes=(150_000, 50_000, 2_000), memory_bytes=(0, 0, 0), raw_bytes=100_000,
    )  # fmt: skip
    trainer = TrainerProfile(decode_s=0.002, head_s=(0.0, 0.0, 0.0), tail_s=(0.0, 0.0, 0.0))
    link = LinkProfile(bytes_per_s=1e6)
    plan = choose_plan(server, trainer, link, Workload(samples=640, chunk_size=64), freeze=2)
    assert plan.cut == 2
    return plan


def test_a_wake_ends_the_backoff_and_the_next_try_goes_at_once() -> None:
    tries: list[float] = []
    wake = threading.Event()

    def measure(connection: Connection) -> object:
        tries.append(time.monotonic())
        if len(tries) == 1:
            threading.Timer(0.2, wake.set).start()  # a chunk was served meanwhile
            raise ServerUnavailable("down")
        return "plan"

    t0 = time.monotonic()
    plan = measure_any([object()], measure, SLOW, wake=wake)  # type: ignore[list-item, arg-type]
    assert plan == "plan" and len(tries) == 2
    assert tries[1] - t0 < 10.0  # not the 30 s backoff
    assert not wake.is_set()  # taken


def test_a_stop_still_ends_a_backoff_that_waits_for_a_wake() -> None:
    stop, wake = threading.Event(), threading.Event()
    tries = 0

    def measure(connection: Connection) -> object:
        nonlocal tries
        tries += 1
        threading.Timer(0.2, stop.set).start()
        raise ServerUnavailable("down")

    t0 = time.monotonic()
    try:
        measure_any([object()], measure, SLOW, stop=stop, wake=wake)  # type: ignore[list-item]
    except ServerUnavailable:
        pass
    else:
        raise AssertionError("a stopped measurement gives up with its last error")
    assert tries == 1 and time.monotonic() - t0 < 10.0


def test_a_plan_put_off_is_measured_once_a_chunk_is_read_and_then_routes_the_chunks() -> None:
    # No server answers the first measurings: the loop starts on the default, and the plan
    # is retried in the background with 30 s backoffs. A chunk read says a server is back:
    # the retry goes at once, and the plan it measures routes the next chunk.
    tries: list[float] = []
    plan = _plan()

    def measure(connection: Connection) -> Plan:
        tries.append(time.monotonic())
        if len(tries) <= 2:  # the job's first measuring, and the first in the background
            raise ServerUnavailable("down")
        return plan

    events: list[Event] = []
    plans = PlanInForce(
        fixed=None, default=(1, 0.0), connections=[object()], measure=measure,  # type: ignore[list-item]
        measure_aside=lambda connection, seen: measure(connection), retries=SLOW,
        record=events.append,
    )  # fmt: skip
    with plans.running(train=True, replan=True, recall=recall_nothing) as router:
        router.start(epoch=0, chunks=4)
        assert router.route(0).cut == 1 and [e.kind for e in events] == ["plan-deferred"]
        router.observe(TrainMeasurement(samples=4, cut=1, trainer_s=0.1, chunk=0))
        time.sleep(0.3)
        assert len(tries) == 2  # trained: says nothing of a server
        router.observe(ReadMeasurement(samples=4, bytes=400, cut=1, server_s=0.1,
                                       transfer_s=0.01, chunk=0))  # fmt: skip
        deadline = time.monotonic() + 10.0
        while router.in_force != (plan.cut, plan.share) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert router.route(1).cut == plan.cut
    assert len(tries) == 3 and tries[2] - tries[1] < 10.0
    assert plans.plan is plan and plans.in_force() == (plan.cut, plan.share)


def test_a_first_run_trains_at_once_and_its_own_chunks_measure_the_plan() -> None:
    # Nothing measured before: the loop starts on the default, and the plan measured
    # beside it waits for the job's chunks at the default's cut (after the first).
    plan = _plan()
    tallies: list[ChunkTally | None] = []

    def before(connection: Connection) -> Plan:
        raise AssertionError("measured before the loop started")

    def beside(connection: Connection, seen: ChunkTally | None) -> Plan:
        tallies.append(seen)
        assert seen is not None
        totals = seen.wait(2, 10.0)
        assert totals is not None and totals.samples == 8
        return plan

    events: list[Event] = []
    plans = PlanInForce(
        fixed=None, default=(1, 0.0), connections=[object()], measure=before,  # type: ignore[list-item]
        measure_aside=beside, retries=SLOW, record=events.append, beside=lambda: True,
    )  # fmt: skip
    with plans.running(train=True, replan=True, recall=recall_nothing) as router:
        router.start(epoch=0, chunks=8)
        assert router.route(0).cut == 1 and [e.kind for e in events] == ["plan-aside"]
        for chunk in range(3):
            router.observe(ReadMeasurement(samples=4, bytes=400, cut=1, server_s=0.1,
                                           transfer_s=0.01, chunk=chunk))  # fmt: skip
        deadline = time.monotonic() + 10.0
        while router.in_force != (plan.cut, plan.share) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert router.route(3).cut == plan.cut
    assert len(tallies) == 1 and plans.plan is plan


def test_a_job_measured_before_is_planned_before_its_loop_starts() -> None:
    plan = _plan()
    measured: list[str] = []

    def before(connection: Connection) -> Plan:
        measured.append("before")
        return plan

    def beside(connection: Connection, seen: ChunkTally | None) -> Plan:
        raise AssertionError("measured beside the loop")

    plans = PlanInForce(
        fixed=None, default=(1, 0.0), connections=[object()], measure=before,  # type: ignore[list-item]
        measure_aside=beside, retries=SLOW, record=lambda e: None, beside=lambda: False,
    )  # fmt: skip
    with plans.running(train=True, replan=True, recall=recall_nothing) as router:
        router.start(epoch=0, chunks=8)
        assert measured == ["before"] and router.route(0).cut == plan.cut
