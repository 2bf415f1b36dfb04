"""A server's per-session bookkeeping on its own: the counters and the registry."""

from __future__ import annotations

import pytest

from hapi.server._counters import SessionCounters
from hapi.wire import SessionStats


def test_the_counters_are_the_wire_stats_fields() -> None:
    counters = SessionCounters()
    assert counters.snapshot() == SessionStats()
    counters.add(**dict.fromkeys(SessionStats.model_fields, 1))
    counters.add(chunks=2, read_s=0.5)
    snapshot = counters.snapshot()
    assert snapshot.chunks == 3 and snapshot.read_s == 1.5 and snapshot.cpu_s == 1
    with pytest.raises(KeyError):
        counters.add(no_such_counter=1)
