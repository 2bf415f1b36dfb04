"""Egress shaping: rate parsing, and the token bucket's accounting on a fake clock."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from hapi.errors import InvalidRequest
from hapi.server import TokenBucket, parse_rate


@pytest.mark.parametrize(
    ("text", "bytes_per_s"),
    [
        ("50mbit", 6.25e6),
        ("1gbit", 1.25e8),
        ("25Mbit", 3.125e6),
        ("100MB", 1e8),
        ("64KiB", 65536),
        ("12.5mbit/s", 12.5e6 / 8),
        (" 2 MB/s ", 2e6),
        ("50mbps", 6.25e6),  # b: bits
        ("50MBps", 5e7),  # B: bytes
        (1000, 1000),  # from Python, a number is bytes per second
        (2.5e6, 2.5e6),
    ],
)
def test_parse_rate(text: str | float, bytes_per_s: float) -> None:
    assert parse_rate(text) == pytest.approx(bytes_per_s)


@pytest.mark.parametrize(
    "text", ["50", "1000", "fast", "50 furlongs", "-3mbit", "0mbit", "", "mbit", "50ps"]
)
def test_bad_rates_say_how_to_write_one(text: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_rate(text)
    if text != "0mbit":
        assert all(form in str(caught.value) for form in ("50mbit", "1gbit", "100MB", "64KiB"))


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), True, None])
def test_bad_numeric_rates_are_refused(value: object) -> None:
    with pytest.raises(InvalidRequest):
        parse_rate(value)  # type: ignore[arg-type]


class FakeClock:
    """A monotonic clock that moves only when the bucket sleeps (or the test says so)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_bucket_charges_what_exceeds_the_burst() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate=1e6, burst=1e4, clock=clock, sleep=clock.sleep)
    assert bucket.consume(10_000) == 0.0  # the burst is free
    assert clock.sleeps == []
    assert bucket.consume(100_000) == pytest.approx(0.1)  # 0.1 s of link time owed
    assert clock.sleeps == [pytest.approx(0.1)]
    clock.now += 0.004  # 4 kB of tokens accrue while the link is idle
    assert bucket.consume(4_000) == pytest.approx(0.0, abs=1e-9)
    assert bucket.consume(1_000) == pytest.approx(0.001)


def test_idle_time_refills_only_up_to_the_burst() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate=1e6, burst=1e4, clock=clock, sleep=clock.sleep)
    clock.now += 3600
    assert bucket.consume(10_000) == 0.0
    assert bucket.consume(10_000) == pytest.approx(0.01)  # an hour idle saved no more


def test_a_stream_of_small_messages_keeps_to_the_rate() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate=2e6, burst=5e4, clock=clock, sleep=clock.sleep)
    start = clock.now
    for _ in range(1000):
        bucket.consume(2_000)  # 2 MB in all
    # All but the first burst went out at 2 MB/s.
    assert clock.now - start == pytest.approx((2e6 - 5e4) / 2e6)


def test_default_burst_is_1ms_of_rate_and_at_least_4kib() -> None:
    assert TokenBucket(rate=1e8).burst == pytest.approx(1e5)
    assert TokenBucket(rate=1e5).burst == 4 * 1024


@pytest.mark.parametrize(("rate", "burst"), [(0, None), (-1.0, None), (1e6, 0), (1e6, -5.0)])
def test_bucket_refuses_a_rate_or_burst_that_is_not_positive(
    rate: float, burst: float | None
) -> None:
    with pytest.raises(InvalidRequest):
        TokenBucket(rate=rate, burst=burst)


def test_bucket_is_shared_by_concurrent_callers() -> None:
    clock = FakeClock()
    # The clock stands still, so each caller's wait is exactly the debt queued before it.
    bucket = TokenBucket(rate=1e6, burst=1e3, clock=clock, sleep=clock.sleeps.append)
    with ThreadPoolExecutor(4) as pool:
        waits = sorted(pool.map(bucket.consume, [50_000] * 8))
    # Whatever order the threads ran in, the k-th to book pays for k messages.
    assert waits == pytest.approx([(50_000 * k - 1e3) / 1e6 for k in range(1, 9)])
    assert sorted(clock.sleeps) == waits
