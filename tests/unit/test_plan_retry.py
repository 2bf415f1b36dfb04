"""A plan put off because no server answered is measured again as soon as a chunk shows a
server is back, not at the end of its backoff."""

from __future__ import annotations

import threading
import time

from hapi.client.pipeline.routing import Router
from hapi.client.planning._retry import measure_any
from hapi.client.servers.connection import Connection
from hapi.client.servers.retry import RetryPolicy
from hapi.errors import ServerUnavailable
from hapi.plan import ReadMeasurement, TrainMeasurement

SLOW = RetryPolicy(budget_s=120.0, initial_s=30.0, max_wait_s=30.0)
"""Backoffs of 30 s: a retry within seconds can only be the wake's."""


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


def test_the_router_says_a_server_served_while_no_plan_is_in_force() -> None:
    served: list[bool] = []
    router = Router(3, served=lambda: served.append(True))
    router.observe(TrainMeasurement(samples=4, cut=3, trainer_s=0.1, chunk=0))
    assert served == []  # trained: says nothing of a server
    router.observe(ReadMeasurement(samples=4, bytes=400, cut=3, server_s=0.1, transfer_s=0.01,
                                   chunk=0))  # fmt: skip
    assert served == [True]
