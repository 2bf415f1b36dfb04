"""Egress shaping: rate parsing and the token bucket's accounting."""

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
        ("1000", 1000),
    ],
)
def test_parse_rate(text: str, bytes_per_s: float) -> None:
    assert parse_rate(text) == pytest.approx(bytes_per_s)


@pytest.mark.parametrize("text", ["fast", "50 furlongs", "-3mbit", "0mbit", ""])
def test_bad_rates_say_how_to_write_one(text: str) -> None:
    with pytest.raises(InvalidRequest):
        parse_rate(text)


def test_bucket_charges_what_exceeds_the_burst() -> None:
    bucket = TokenBucket(rate=1e6, burst=1e4)
    assert bucket.consume(10_000) == 0.0  # the burst is free
    wait = bucket.consume(100_000)  # 0.1 s of link time owed
    assert 0.09 <= wait <= 0.101


def test_bucket_is_shared_by_concurrent_callers() -> None:
    bucket = TokenBucket(rate=1e6, burst=1e3)
    with ThreadPoolExecutor(2) as pool:
        waits = sorted(pool.map(bucket.consume, [50_000, 50_000]))
    # The later caller queues behind the earlier one: together they pay for 100 kB.
    assert waits[0] == pytest.approx(0.049, abs=0.01)
    assert waits[1] == pytest.approx(0.099, abs=0.02)
