"""Retrying a chunk: which failures deserve another try, and for how long.

Chunks are idempotent per key (a sample's seed depends on the job seed, the epoch and
the key alone), so a chunk that failed is asked for again - only for the keys it had not
delivered. The waiting is tenacity's (exponential backoff with jitter, a time budget);
what counts as transient is decided here, by error class, never by message.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import tenacity

from hapi.errors import (
    InvalidRequest,
    MemoryBusy,
    ServerUnavailable,
    SessionNotFound,
    StoreUnavailable,
)

__all__ = ["RETRYABLE", "RetryPolicy"]

RETRYABLE: tuple[type[Exception], ...] = (
    ServerUnavailable,
    StoreUnavailable,
    SessionNotFound,
    MemoryBusy,
)
"""Failures a later try may not meet: the server or its store away (a restart, a network
blip, a stream cut), a session a restarted server no longer holds (re-opened first), or a
server whose budget other sessions fill for now."""


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How long a chunk is retried."""

    budget_s: float = 60.0
    """Seconds from a chunk's first failure after which it fails for good (0: at once)."""
    retries: int | None = None
    """At most this many retries per chunk; None: as many as the budget allows."""
    initial_s: float = 0.1
    """First backoff; it doubles each retry, with jitter so that chunks spread out."""
    max_wait_s: float = 4.0
    """Longest single backoff."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.budget_s < float("inf"):
            raise InvalidRequest(f"retry budget must be >= 0 seconds, got {self.budget_s}")
        if self.retries is not None and self.retries < 0:
            raise InvalidRequest(f"retries must be >= 0 (0: never retry), got {self.retries}")
        if not 0.0 <= self.initial_s <= self.max_wait_s:
            raise InvalidRequest(
                f"backoff must satisfy 0 <= initial_s <= max_wait_s, got {self.initial_s} "
                f"and {self.max_wait_s}"
            )

    def retrying(
        self,
        *,
        on_retry: Callable[[tenacity.RetryCallState], None] | None = None,
        stop: threading.Event | None = None,
        at_once: Callable[[BaseException | None], bool] | None = None,
        wake: threading.Event | None = None,
    ) -> tenacity.Retrying:
        """A tenacity controller for one chunk.

        Args:
            on_retry: called before each backoff (to record the retry).
            stop: when set, a backoff ends early (the caller then gives up).
            at_once: says whether a failure is retried without a backoff (the chunk
                moved to another server: nothing to wait for).
            wake: when set, a backoff ends early and the call is tried again at once
                (something says the server is back); cleared as it is taken.
        """
        until: tenacity.stop.stop_base = tenacity.stop_after_delay(self.budget_s)
        if self.retries is not None:
            until = until | tenacity.stop_after_attempt(self.retries + 1)
        backoff = tenacity.wait_exponential_jitter(
            multiplier=self.initial_s, jitter=self.initial_s, max=self.max_wait_s
        )

        def wait(state: tenacity.RetryCallState) -> float:
            # A lost session was re-opened before the retry: nothing to wait for.
            error = state.outcome.exception() if state.outcome is not None else None
            if isinstance(error, SessionNotFound) or (at_once is not None and at_once(error)):
                return 0.0
            return backoff(state)

        def sleep(seconds: float) -> None:
            if wake is not None:
                _nap_until(seconds, stop, wake)
            elif stop is None:
                tenacity.nap.sleep(seconds)
            else:
                stop.wait(seconds)

        return tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(RETRYABLE),
            stop=until,
            wait=wait,
            before_sleep=on_retry,
            sleep=sleep,
            reraise=True,
        )


def _nap_until(seconds: float, stop: threading.Event | None, wake: threading.Event) -> None:
    """Sleep `seconds`, or until `stop` or `wake` is set (`wake` is taken: cleared). Two
    events cannot be waited on at once, so `stop` is looked at every 50 ms."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if stop is not None and stop.is_set():
            return
        if wake.wait(min(left, 0.05)):
            wake.clear()
            return
