"""The tracing lock: shared holders run together, an exclusive holder runs alone, and a
shared holder that must export (take it exclusively) neither deadlocks nor runs beside
another exclusive holder."""

from __future__ import annotations

import threading
import time

from hapi._fx_lock import TracingLock

TIMEOUT = 10.0


def test_two_shared_holders_can_each_take_it_exclusively_without_deadlock() -> None:
    lock = TracingLock()
    both_shared = threading.Barrier(2)
    inside: list[int] = []
    overlap: list[bool] = []
    done: list[int] = []

    def worker(n: int) -> None:
        with lock.shared():
            both_shared.wait(TIMEOUT)
            with lock.exclusive():
                inside.append(n)
                overlap.append(len(inside) > 1)
                time.sleep(0.05)
                inside.remove(n)
            with lock.shared():  # nested share after the upgrade: taken at once
                pass
        done.append(n)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert sorted(done) == [0, 1], "a shared holder's upgrade deadlocked"
    assert overlap == [False, False], "two threads held the lock exclusively at once"


def test_a_shared_holders_exclusive_waits_for_other_sharers_and_holds_them_off() -> None:
    lock = TracingLock()
    other_in = threading.Event()
    release_other = threading.Event()
    events: list[str] = []

    def other() -> None:
        with lock.shared():
            other_in.set()
            release_other.wait(TIMEOUT)
            events.append("other leaves")
        with lock.shared():  # a new share waits while the upgrader holds it alone
            events.append("other back")

    t = threading.Thread(target=other)
    t.start()
    assert other_in.wait(TIMEOUT)
    with lock.shared():
        threading.Timer(0.1, release_other.set).start()
        with lock.exclusive():
            events.append("exclusive")
            time.sleep(0.1)
            events.append("exclusive ends")
        events.append("shared again")
    t.join(TIMEOUT)
    assert events.index("other leaves") < events.index("exclusive")
    assert events.index("exclusive ends") < events.index("other back")
    assert "shared again" in events and not t.is_alive()
