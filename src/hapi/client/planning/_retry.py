"""Planning that survives its servers: measuring retried, failed over, or put off.

A job's plan is measured in its first seconds, which is when a server restart or a store
outage lands as often as any other time. The measuring calls are idempotent (a probe
reads a few objects, a profile computes them), so they are retried as chunks are: on the
next server first, then after a backoff, for the job's retry budget. A job that finds no
server to measure does not wait for one: it starts on the default plan (the freeze cut,
nothing local) - its chunks have their own retries and the store fallback - and
`DeferredPlan` keeps measuring in the background, handing the plan over when it comes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from hapi.client.servers.retry import RETRYABLE, RetryPolicy
from hapi.client.servers.source import Server
from hapi.errors import HapiError
from hapi.plan import Plan

__all__ = ["DeferredPlan", "measure_any", "measure_round"]

Measure = Callable[[Server], Plan]


def measure_any(
    connections: Sequence[Server],
    measure: Measure,
    policy: RetryPolicy,
    *,
    stop: threading.Event | None = None,
    wake: threading.Event | None = None,
) -> Plan:
    """`measure` on the servers in turn until one answers, within `policy`'s budget.

    A failure moves to the next server at once; after every server failed, the next
    round waits the policy's backoff (any server has the whole store, and measures the
    same job) - or until `wake` is set.

    Raises:
        ServerUnavailable, StoreUnavailable, SessionNotFound: the last failure, once the
            budget is spent (or `stop` is set).
        HapiError: a failure a retry would meet again (a bad request, a head over the
            server's budget): at once.
    """
    n = len(connections)
    tried = 0
    last: BaseException | None = None

    def next_server(error: BaseException | None) -> bool:
        return tried % n != 0  # a server of this round not yet tried: no backoff

    for attempt in policy.retrying(stop=stop, at_once=next_server, wake=wake):
        if stop is not None and stop.is_set() and last is not None:
            raise last
        with attempt:
            connection = connections[tried % n]
            tried += 1
            try:
                return measure(connection)
            except BaseException as exc:
                last = exc
                raise
    raise AssertionError("unreachable: tenacity returns or raises")


def measure_round(connections: Sequence[Server], measure: Measure) -> Plan:
    """`measure` on each server once, in order, until one answers (no backoff).

    Raises:
        the last server's error when none answered.
    """
    error: Exception | None = None
    for connection in connections:
        try:
            return measure(connection)
        except RETRYABLE as exc:
            error = exc
    assert error is not None  # a job has at least one server
    raise error


class DeferredPlan:
    """Measures a job's plan in a background thread, retrying within `policy`.

    Args:
        connections: the job's servers.
        measure: measures one server and returns the plan (`TransferJob._make_plan`).
        policy: how long to keep trying.
        adopt: called with the plan, from the background thread, once it is measured.
        failed: called with the last error when the budget is spent.
        wake: set when a chunk was served meanwhile: the next try goes at once rather
            than at the end of its backoff (up to `RetryPolicy.max_wait_s`), so a short
            job back on its server is planned before it ends.
        put_off: called with the first try's error, where it is one a retry may outlast.
    """

    def __init__(
        self,
        connections: Sequence[Server],
        measure: Measure,
        policy: RetryPolicy,
        *,
        adopt: Callable[[Plan], None],
        failed: Callable[[HapiError], None],
        wake: threading.Event | None = None,
        put_off: Callable[[Exception], None] | None = None,
    ) -> None:
        self._connections, self._measure, self._policy = connections, measure, policy
        self._adopt, self._failed, self._wake = adopt, failed, wake
        self._put_off = put_off
        self._tries = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hapi-plan", daemon=True)

    def __enter__(self) -> DeferredPlan:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        # A measurement under way ends with its calls (seconds) and its plan is taken; the
        # next try is not started.
        self._stop.set()
        self._thread.join()

    def _try(self, connection: Server) -> Plan:
        self._tries += 1
        try:
            return self._measure(connection)
        except RETRYABLE as exc:
            if self._tries == 1 and self._put_off is not None:
                self._put_off(exc)
            raise

    def _run(self) -> None:
        try:
            plan = measure_any(
                self._connections, self._try, self._policy, stop=self._stop, wake=self._wake
            )
        except HapiError as exc:
            if not self._stop.is_set():
                self._failed(exc)
            return
        self._adopt(plan)
