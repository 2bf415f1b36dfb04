"""A server's per-session bookkeeping on its own: the counters and the registry."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from hapi.data import Transforms
from hapi.errors import SessionNotFound
from hapi.graph import RAW
from hapi.server.chunks._counters import SessionCounters
from hapi.server.chunks.session import Session
from hapi.server.head_cache import HeadCache
from hapi.server.memory.scheduler import Scheduler
from hapi.server.metrics import Metrics
from hapi.server.registry import CLOSED_KEPT, SessionRegistry
from hapi.server.security.tenants import Tenant
from hapi.wire import SessionInfo, SessionRequest, SessionStats, raw_schema


def test_the_counters_are_the_wire_stats_fields() -> None:
    counters = SessionCounters()
    assert counters.snapshot() == SessionStats()
    counters.add(**dict.fromkeys(SessionStats.model_fields, 1))
    counters.add(chunks=2, read_s=0.5)
    snapshot = counters.snapshot()
    assert snapshot.chunks == 3 and snapshot.read_s == 1.5 and snapshot.cpu_s == 1
    with pytest.raises(KeyError):
        counters.add(no_such_counter=1)


class Clock:
    """Monotonic seconds the test moves by hand (threads read it)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def registry(
    clock: Clock, *, idle_s: float = 60, closed_kept: int = CLOSED_KEPT
) -> SessionRegistry:
    return SessionRegistry(
        heads=HeadCache("cpu", idle=0),
        scheduler=Scheduler(1 << 30, 1),
        metrics=Metrics(),
        idle_s=idle_s,
        clock=clock,
        closed_kept=closed_kept,
    )


def session(sid: str, tenant: str, *, used: float = 1000.0, sent: int = 0) -> Session:
    """A RAW session: the registry reads only its id, lease times, weight and counters."""
    transforms = Transforms.eval(32)
    request = SessionRequest(model="resnet18", cut=RAW, transforms=transforms.to_dict())
    info = SessionInfo(
        session=sid,
        cut=RAW,
        freeze=0,
        num_cuts=0,
        feature_shape=[],
        wire_dtype="fp32",
        bytes_per_sample=0,
    )
    opened = Session(
        id=sid,
        request=request,
        info=info,
        schema=raw_schema(),
        head=None,
        transforms=transforms,
        device=torch.device("cpu"),
        batch_size=1,
        last_used=used,
        tenant=tenant,
    )
    opened.stats.add(bytes_sent=sent)
    return opened


def test_the_oldest_closed_is_forgotten_first_its_bytes_kept_by_its_tenant() -> None:
    sessions = registry(Clock(), closed_kept=2)
    for i, owner in enumerate(["a", "b", "a", "b"]):
        sessions.open(session(f"s{i}", owner, sent=10**i), tenant=owner, lease=None)
    for sid in ["s2", "s0", "s3", "s1"]:  # closing order, not opening order, decides
        sessions.close(sid)
    every = sessions.usage(None)
    assert list(every.closed) == ["s3", "s1"] and every.open == {}
    assert dict(sessions.owners) == {"s3": "b", "s1": "b"}
    assert every.bytes_sent == 1111
    # s0 and s2 are forgotten, but their bytes stay in tenant a's total alone.
    a, b = sessions.usage("a"), sessions.usage("b")
    assert a.closed == {} and a.bytes_sent == 101
    assert list(b.closed) == ["s3", "s1"] and b.bytes_sent == 1010
    with pytest.raises(SessionNotFound):
        sessions.close("s1")  # closed already


def test_another_tenants_session_is_answered_like_an_unknown_one() -> None:
    clock = Clock()
    sessions = registry(clock)
    sessions.open(session("mine", "a", sent=7), tenant="a", lease=None)
    with pytest.raises(SessionNotFound) as theirs:
        sessions.get("mine", Tenant(name="b"))
    with pytest.raises(SessionNotFound) as unknown:
        sessions.get("nobody", Tenant(name="b"))
    assert str(theirs.value).replace("mine", "nobody") == str(unknown.value)
    assert sessions["mine"].last_used == 1000.0  # a refused call renews nothing
    assert sessions.usage("b").open == {} and sessions.usage("b").bytes_sent == 0

    clock.now += 30
    got = sessions.get("mine", Tenant(name="a", weight=3.0))
    assert got.last_used == 1030.0 and got.weight == 3.0  # renewed, at the tenant's weight
    assert list(sessions.usage("a").open) == ["mine"] and sessions.usage("a").bytes_sent == 7


def test_sessions_unused_past_the_idle_time_are_closed_and_free_their_heads() -> None:
    clock = Clock()
    sessions = registry(clock, idle_s=60)
    lease = sessions.heads.acquire_uploaded("d" * 64, lambda: torch.nn.Linear(2, 2))
    sessions.open(session("idle", "a", used=1000.0), tenant="a", lease=lease)
    sessions.open(session("edge", "a", used=1010.0), tenant="a", lease=None)
    sessions.open(session("used", "a", used=1020.0), tenant="a", lease=None)
    assert len(sessions.heads) == 1
    clock.now = 1070.0  # "idle" is 70 s unused, "edge" exactly 60 s: not yet abandoned
    sessions.close_abandoned()
    usage = sessions.usage(None)
    assert list(usage.closed) == ["idle"] and sorted(usage.open) == ["edge", "used"]
    assert len(sessions.heads) == 0  # its head was released (idle_heads=0 keeps none)


def test_the_reaper_closes_abandoned_sessions_until_it_is_stopped() -> None:
    clock = Clock()
    sessions = registry(clock, idle_s=0.2)  # the reaper looks every 0.02 s
    sessions.open(session("s", "a"), tenant="a", lease=None)
    stopped = threading.Event()
    reaper = threading.Thread(target=sessions.reap, args=(stopped,), daemon=True)
    reaper.start()
    try:
        clock.now += 1
        deadline = time.monotonic() + 30
        while "s" not in sessions.usage(None).closed:
            assert time.monotonic() < deadline, "the reaper never closed the session"
            time.sleep(0.01)
    finally:
        stopped.set()
        reaper.join(timeout=10)
    assert not reaper.is_alive()
