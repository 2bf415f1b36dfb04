"""Egress shaping: a token bucket that caps what the server sends, to emulate a slow link.

On one machine the storage network is loopback (GB/s); `hapi serve --egress-limit 50mbit`
makes the server send no faster than the link it stands in for, whatever the number of
streams, so pushdown and the raw-bytes baseline are measured through the same link.
"""

from __future__ import annotations

import re
import threading
import time

from hapi.errors import InvalidRequest

__all__ = ["TokenBucket", "parse_rate"]

_UNITS = {
    "bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8,
    "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9,
    "kib": 2**10, "mib": 2**20, "gib": 2**30,
}  # fmt: skip


def parse_rate(text: str | float | int) -> float:
    """Parse a rate like `50mbit`, `1gbit`, `12.5MB` (per second) into bytes per second.

    Raises:
        InvalidRequest: the text is not a positive number with a known unit.
    """
    if isinstance(text, int | float):
        rate = float(text)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*?)(?:/s|ps)?\s*", text)
        unit = match.group(2).lower() if match else ""
        if not match or (unit and unit not in _UNITS):
            raise InvalidRequest(
                f"cannot read rate {text!r}: use a number with a unit such as 50mbit, 1gbit, "
                "100MB or 64KiB (per second)"
            )
        rate = float(match.group(1)) * _UNITS.get(unit, 1)
    if rate <= 0:
        raise InvalidRequest(f"rate must be positive, got {text!r}")
    return rate


class TokenBucket:
    """A thread-safe token bucket in bytes.

    `consume(n)` blocks until `n` bytes may go out. Callers share one bucket, so the
    total over all streams keeps to `rate`. A message larger than the burst goes out once
    the bucket has paid for it (the balance goes negative), so big batches are not refused.
    """

    def __init__(self, rate: float, burst: float | None = None) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be positive, got {rate}")
        self.rate = rate
        # A 50 ms burst keeps the shaped rate smooth without a sleep per tiny message.
        self.burst = burst if burst is not None else max(rate * 0.05, 64 * 1024)
        self._tokens = self.burst
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def consume(self, nbytes: int) -> float:
        """Take `nbytes` from the bucket, sleeping as long as the link needs; return the wait."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= nbytes
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)
        return wait
