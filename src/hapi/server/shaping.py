"""Egress shaping: a token bucket that caps what the server sends, to emulate a slow link.

On one machine the storage network is loopback (GB/s); `hapi serve --egress-limit 50mbit`
makes the server send no faster than the link it stands in for, whatever the number of
streams, so pushdown and the raw-bytes baseline are measured through the same link.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable

from hapi.errors import InvalidRequest

__all__ = ["TokenBucket", "parse_rate"]

_UNITS = {
    "bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8,
    "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9,
    "kib": 2**10, "mib": 2**20, "gib": 2**30,
}  # fmt: skip

POLL_S = 0.1
"""How often a sleeping `consume` asks whether its stream's client has gone."""

_FORMS = "a number with a unit such as 50mbit, 1gbit, 100MB or 64KiB (per second)"


def parse_rate(text: str | float | int) -> float:
    """Parse a rate like `50mbit`, `1gbit`, `12.5MB/s`, `64KiB` into bytes per second.

    A string needs its unit: a bare `50` could mean bits or bytes, and a link cap off by a
    factor of eight would go unnoticed. A number given from Python is bytes per second.
    `Xbps` is bits and `XBps` bytes per second, as the two are usually written.

    Raises:
        InvalidRequest: not a positive number with a known unit.
    """
    if isinstance(text, bool) or not isinstance(text, str | int | float):
        raise InvalidRequest(f"a rate is {_FORMS}, got {type(text).__name__}")
    if isinstance(text, int | float):
        rate = float(text)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+?)(/s|ps)?\s*", text)
        unit = _unit(match.group(2), per_second=match.group(3)) if match else None
        if match is None or unit is None:
            raise InvalidRequest(f"cannot read rate {text[:60]!r}: use {_FORMS}")
        rate = float(match.group(1)) * _UNITS[unit]
    if not 0 < rate < float("inf"):
        raise InvalidRequest(f"rate must be positive and finite, got {text!r}")
    return rate


def _unit(unit: str, per_second: str | None) -> str | None:
    """The `_UNITS` key `unit` means, or None; a `ps` suffix reads `b` as bit, `B` as byte."""
    if per_second == "ps":
        if unit.endswith("b"):
            unit = unit[:-1] + "bit"
        elif not unit.endswith("B"):
            return None
    unit = unit.lower()
    return unit if unit in _UNITS else None


class TokenBucket:
    """A thread-safe token bucket in bytes.

    `consume(n)` blocks until `n` bytes may go out. Callers share one bucket, so the
    total over all streams keeps to `rate`. A message larger than the burst goes out once
    the bucket has paid for it (the balance goes negative), so big batches are not refused.

    Args:
        rate: bytes per second.
        burst: bytes that may go out at once after a quiet spell; None: 1 ms of `rate`,
            at least 4 KiB.
        clock: seconds, monotonic; tests pass a fake one to check the accounting exactly.
        sleep: waits the given seconds; a fake clock's tests pass one that advances it.

    Raises:
        InvalidRequest: `rate` or `burst` is not positive.
    """

    def __init__(
        self,
        rate: float,
        burst: float | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not rate > 0:
            raise InvalidRequest(f"rate must be positive bytes per second, got {rate!r}")
        if burst is not None and not burst > 0:
            raise InvalidRequest(f"burst must be positive bytes or None, got {burst!r}")
        self.rate = rate
        # A link emulated with a large bucket is not the link: after an idle spell a 50 ms
        # bucket let a late cut's chunk (65 KB) out at once, faster than the rate, and the
        # re-planner read that as a faster link. With 1 ms, what a chunk takes is its
        # bytes at the rate; a message larger than the bucket waits for its own bytes.
        self.burst = burst if burst is not None else max(rate * 0.001, 4 * 1024)
        self._clock = clock
        self._sleep = sleep
        self._tokens = self.burst
        self._last = clock()
        self._lock = threading.Lock()

    def consume(self, nbytes: int, *, gone: Callable[[], bool] | None = None) -> float:
        """Take `nbytes` from the bucket, sleeping as long as the link needs; return the
        seconds slept.

        Args:
            nbytes: the bytes about to go out.
            gone: asked every `POLL_S` while sleeping: True ends the sleep early (the
                stream's client left, and a batch of 4 MiB at 10 Mbit/s would hold its
                memory for 3 s more). The bytes stay booked: what a stream took of the
                link before its client left is not given to the others. None: one sleep.
        """
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= nbytes
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        # Sleep outside the lock: later callers book their turn behind this one meanwhile.
        if gone is None:
            if wait > 0:
                self._sleep(wait)
            return wait
        slept = 0.0
        while slept < wait:
            step = min(wait - slept, POLL_S)
            self._sleep(step)
            slept += step
            if slept < wait and gone():
                return slept
        return wait
