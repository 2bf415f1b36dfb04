"""The scheduler: memory within the budget, fair shares by weight, chunks in order.

Time is a fake clock that batches advance while they hold the only compute slot, so the
shares are deterministic and nothing is asserted on wall time.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import pytest

from hapi.errors import OverBudget
from hapi.server.memory.budget import MemoryModel
from hapi.server.memory.scheduler import Abandoned, Demand, Scheduler


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


def _wait_until(condition: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "the scheduler never got there"
        time.sleep(0.005)


def _demand(fixed: int = 0, per_sample: int = 1, max_batch: int = 1) -> Demand:
    return Demand(model=MemoryModel(fixed=fixed, per_sample=per_sample), max_batch=max_batch)


def test_sessions_get_compute_in_proportion_to_their_weights() -> None:
    clock = FakeClock()
    scheduler = Scheduler(1 << 30, 1, clock=clock)
    weights = {"heavy": 2.0, "light": 1.0}
    served: list[str] = []
    stop = threading.Event()

    def job(session: str, chunk: int) -> None:
        while not stop.is_set():
            with scheduler.run(session, (0, chunk), _demand(), weight=weights[session]):
                served.append(session)
                clock.advance(1.0)  # one second of compute per batch, for both
                if len(served) >= 90:
                    stop.set()

    threads = [threading.Thread(target=job, args=(s, c)) for s in weights for c in range(3)]
    with scheduler.run("heavy", (0, -1), _demand()):
        # Every job waits before any runs: each session always has batches waiting.
        for t in threads:
            t.start()
        _wait_until(lambda: scheduler.stats().waiting == 6)
    for t in threads:
        t.join(timeout=60)
    counts = Counter(served[:90])
    assert counts["heavy"] / counts["light"] == pytest.approx(2.0, rel=0.1)


def test_a_session_coming_back_gets_its_share_not_a_burst() -> None:
    clock = FakeClock()
    scheduler = Scheduler(1 << 30, 1, clock=clock)
    for _ in range(20):
        with scheduler.run("early", (0, 0), _demand()):
            clock.advance(1.0)
    order: list[str] = []
    blocker = threading.Event()
    holding = threading.Event()

    def hold() -> None:
        with scheduler.run("early", (0, 0), _demand()):
            holding.set()
            blocker.wait()
            clock.advance(1.0)

    def job(session: str, chunk: int) -> None:
        with scheduler.run(session, (0, chunk), _demand()):
            order.append(session)
            clock.advance(1.0)

    first = threading.Thread(target=hold)
    first.start()
    holding.wait()
    threads = [
        threading.Thread(target=job, args=(s, c)) for c in range(4) for s in ("early", "late")
    ]
    for t in threads:
        t.start()
    _wait_until(lambda: scheduler.stats().waiting == 8)
    blocker.set()
    for t in [first, *threads]:
        t.join(timeout=60)
    # "late" was away while "early" ran 20 batches; it starts from now, so they alternate.
    assert Counter(order[:4]) == Counter({"early": 2, "late": 2})


def test_chunks_of_a_session_run_lowest_first() -> None:
    scheduler = Scheduler(1 << 30, 1)
    order: list[int] = []
    release = threading.Event()
    holding = threading.Event()

    def hold() -> None:
        with scheduler.run("job", (0, 99), _demand()):
            holding.set()
            release.wait()

    def chunk(n: int) -> None:
        with scheduler.run("job", (0, n), _demand()):
            order.append(n)

    blocker = threading.Thread(target=hold)
    blocker.start()
    holding.wait()
    threads = [threading.Thread(target=chunk, args=(n,)) for n in (3, 1, 2, 0)]
    for t in threads:
        t.start()
    _wait_until(lambda: scheduler.stats().waiting == 4)
    release.set()
    for t in [blocker, *threads]:
        t.join(timeout=60)
    assert order == [0, 1, 2, 3]


def test_memory_held_never_passes_the_budget_and_batches_shrink_to_fit() -> None:
    budget = 10_000
    scheduler = Scheduler(budget, 3)
    seen: list[tuple[int, int, int]] = []
    lock = threading.Lock()
    rng = random.Random(0)
    demands = [
        _demand(fixed=rng.randrange(0, 2000), per_sample=rng.randrange(100, 1500), max_batch=32)
        for _ in range(12)
    ]

    def job(i: int) -> None:
        for n in range(10):
            with scheduler.run(f"s{i % 4}", (0, i * 10 + n), demands[i]) as grant:
                stats = scheduler.stats()
                with lock:
                    seen.append((stats.used, stats.running, grant.batch))
                assert grant.nbytes == demands[i].model.batch_bytes(grant.batch)
                time.sleep(0.001)

    threads = [threading.Thread(target=job, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(seen) == 120
    assert max(used for used, _, _ in seen) <= budget
    assert max(running for _, running, _ in seen) <= 3
    assert scheduler.stats().peak <= budget and scheduler.stats().used == 0
    # Under contention some batches were cut below what they asked for, none to zero.
    batches = [b for _, _, b in seen]
    assert min(batches) >= 1 and len(set(batches)) > 1


def test_one_sample_that_can_never_fit_is_refused_at_once() -> None:
    scheduler = Scheduler(1000, 1)
    too_big = _demand(fixed=600, per_sample=500)
    with (
        pytest.raises(OverBudget, match="memory budget is 1000 B"),
        scheduler.run("s", (0, 0), too_big),
    ):
        pass
    assert scheduler.stats().waiting == 0 == scheduler.stats().used


def test_a_grant_grows_only_into_free_memory() -> None:
    scheduler = Scheduler(1000, 2)
    with scheduler.run("a", (0, 0), _demand(fixed=100, per_sample=100, max_batch=4)) as a:
        assert a.batch == 4 and a.nbytes == 500
        assert a.grow(300) and a.nbytes == 800
        assert not a.grow(300)
        with scheduler.run("b", (0, 0), _demand(per_sample=100, max_batch=8)) as b:
            assert b.batch == 2  # what is left: 200 bytes
    assert scheduler.stats().used == 0


def test_reserved_memory_waits_for_batches_and_blocks_new_ones() -> None:
    scheduler = Scheduler(1000, 2)
    done = threading.Event()
    with scheduler.run("a", (0, 0), _demand(per_sample=100, max_batch=8)):
        reserver = threading.Thread(target=lambda: (scheduler.reserve(500), done.set()))
        reserver.start()
        _wait_until(lambda: scheduler._pending == 500)
        assert not done.is_set()
    reserver.join(timeout=30)
    assert done.is_set() and scheduler.stats().reserved == 500
    with pytest.raises(OverBudget, match="open sessions hold 500 B"):
        scheduler.reserve(600)
    scheduler.release(500)
    assert scheduler.stats().used == 0


def test_free_share_counts_what_others_run_and_wait_for() -> None:
    scheduler = Scheduler(1 << 20, 2)
    assert scheduler.free_share(running_self=0) == 1.0
    with scheduler.run("a", (0, 0), _demand()):
        assert scheduler.free_share() == 1.0  # only itself
        assert scheduler.free_share(running_self=0) == 0.5


def test_a_batch_whose_requester_has_gone_leaves_the_queue_ungranted() -> None:
    scheduler = Scheduler(1 << 20, 1)
    left = threading.Event()
    outcome: list[object] = []

    def wait(**how: object) -> None:
        try:
            with scheduler.run("gone", (0, 1), _demand(), **how):  # type: ignore[arg-type]
                outcome.append("granted")
        except Abandoned as exc:
            outcome.append(exc)

    with scheduler.run("gone", (0, 0), _demand(), gone=left.is_set) as first:
        # Both wait while this batch holds the only slot: a new batch with the same
        # `gone`, and the chunk's next batch, queued by `follow`, which inherits it.
        waiters = [
            threading.Thread(target=wait, kwargs={"gone": left.is_set}),
            threading.Thread(target=wait, kwargs={"place": first.follow(_demand())}),
        ]
        for t in waiters:
            t.start()
        _wait_until(lambda: scheduler.stats().waiting == 2)
        left.set()
        # They leave while the slot is still taken: neither was ever granted.
        _wait_until(lambda: scheduler.stats().waiting == 0)
        for t in waiters:
            t.join(timeout=30)
        assert [type(o) for o in outcome] == [Abandoned, Abandoned]
    stats = scheduler.stats()
    assert stats.used == stats.running == stats.waiting == 0
    # Its session's share is whole: its next batch runs.
    with scheduler.run("gone", (0, 2), _demand()) as grant:
        assert grant.batch == 1


def test_the_scheduler_is_quiet_from_its_last_batch_s_end_until_the_next() -> None:
    clock = FakeClock()
    scheduler = Scheduler(1000, 2, clock=clock)
    assert scheduler.quiet_since() is None  # nothing ran yet: nothing to give back
    with scheduler.run("a", (0, 0), _demand(per_sample=100)):
        with scheduler.run("b", (0, 0), _demand(per_sample=100)):
            clock.advance(1.0)
        assert scheduler.quiet_since() is None  # a still runs
        clock.advance(1.0)
    assert scheduler.quiet_since() == 2.0
    with scheduler.run("a", (0, 1), _demand(per_sample=100)):
        assert scheduler.quiet_since() is None
        clock.advance(1.0)
    assert scheduler.quiet_since() == 3.0


def test_a_batch_granted_into_a_nearly_full_budget_has_the_allocator_give_back_first() -> None:
    gave: list[int] = []
    scheduler = Scheduler(1000, 2, kept=300, give_back=lambda: gave.append(1))
    with scheduler.run("a", (0, 0), _demand(per_sample=100, max_batch=6)):
        assert gave == []  # 400 B free: room for what the allocator keeps
        with scheduler.run("b", (0, 0), _demand(per_sample=100, max_batch=2)):
            assert gave == [1]  # 200 B free: less than it may keep
