"""Push and gc locks: how `gc` and concurrent pushes stay out of each other's way.

Intent objects, as restic's `prune` uses: a push writes `locks/push-<token>.json` then
waits for the live gc locks it sees; a gc writes `locks/gc-<token>.json` then withdraws if
it sees a live push lock. Each side writes before it looks, so they never both go ahead.
A lock older than the TTL, or whose process is seen gone (`liveness.py`), is stale. The
scheme and its guarantees: docs/repository.md, "Push and gc locks".
"""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hapi.data.store import ObjectStore
from hapi.errors import ObjectNotFound, RepoError
from hapi.repo.storage.layout import LOCKS
from hapi.repo.storage.liveness import holder_is_gone, machine_id, process_started

__all__ = ["HeldLock", "LockInfo", "Locks"]

log = logging.getLogger("hapi.repo")


@dataclass(frozen=True)
class LockInfo:
    """A lock object as read from the store."""

    key: str
    kind: str
    created: float
    owner: str
    """`host:pid`, for people."""
    machine: str | None = None
    """Where its process runs (`liveness.machine_id`); None where unknown."""
    pid: int = 0
    """Its process."""
    started: int | None = None
    """When its process started (`liveness.process_started`), to tell a reused pid."""

    @property
    def holder_gone(self) -> bool:
        """Whether its process is certainly not running (judged on its machine only)."""
        return holder_is_gone(self.machine, self.pid, self.started)


class HeldLock:
    """A lock this process wrote; refresh it while working, release it when done."""

    def __init__(self, locks: Locks, kind: str) -> None:
        self._locks = locks
        self.kind = kind
        self.key = f"{LOCKS}/{kind}-{uuid.uuid4().hex}.json"
        self.written_at = 0.0
        self.lapsed = False
        """Set when the lock went unrefreshed for a whole TTL: a gc may have run meanwhile."""
        self.write()

    def write(self) -> None:
        now = self._locks.clock()
        pid = os.getpid()
        body = {
            "kind": self.kind,
            "created": now,
            "owner": f"{socket.gethostname()}:{pid}",
            "machine": machine_id(),
            "pid": pid,
            "started": process_started(pid),
        }
        self._locks.store.put(self.key, json.dumps(body).encode())
        self.written_at = now

    def refresh(self) -> None:
        """Rewrite the lock's time when a quarter of the TTL has passed."""
        age = self._locks.clock() - self.written_at
        if age >= self._locks.ttl_s:
            self.lapsed = True
        if age > self._locks.ttl_s / 4:
            self.write()

    @property
    def expired(self) -> bool:
        """Whether others may have judged this lock stale since it was last written."""
        return self._locks.clock() - self.written_at >= self._locks.ttl_s

    def release(self) -> None:
        self._locks.store.delete(self.key)


class Locks:
    """The lock protocol on one store."""

    def __init__(
        self,
        store: ObjectStore,
        *,
        ttl_s: float,
        wait_s: float,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.wait_s = wait_s
        self.clock = clock
        """Wall-clock seconds; lock ages are measured with it (tests inject their own)."""
        self.sleep = sleep
        """Waits between looks at a gc's lock (tests inject one that moves their clock)."""

    def read(self, kind: str | None = None) -> list[LockInfo]:
        """Every lock in the store (of `kind`), stale or not."""
        keys = [k for k in self.store.list(LOCKS) if kind is None or _kind(k) == kind]
        found = []
        for key, data in zip(keys, self.store.get_many(keys), strict=True):
            if isinstance(data, ObjectNotFound):
                continue  # released since the listing
            if isinstance(data, BaseException):
                raise data
            try:
                body = json.loads(data)
                found.append(
                    LockInfo(
                        key,
                        _kind(key),
                        float(body["created"]),
                        str(body["owner"]),
                        machine=_optional(body.get("machine"), str),
                        pid=_optional(body.get("pid"), int) or 0,
                        started=_optional(body.get("started"), int),
                    )
                )
            except (ValueError, KeyError, TypeError, AttributeError):
                # Puts are atomic, so this is not a lock being written: treat it as stale.
                log.warning("unreadable lock %s is treated as stale", key)
                found.append(LockInfo(key, _kind(key), 0.0, "?"))
        return found

    def is_stale(self, lock: LockInfo, now: float) -> bool:
        """Whether `lock` is past its TTL at `now`, or its process is gone."""
        return now - lock.created >= self.ttl_s or lock.holder_gone

    def live(self, kind: str) -> list[LockInfo]:
        now = self.clock()
        return [lock for lock in self.read(kind) if not self.is_stale(lock, now)]

    def acquire_push(self) -> HeldLock:
        """Take a push lock, waiting up to `wait_s` for gcs that may not have seen it.

        Only gc locks already there when the push lock was written can belong to a gc that
        missed it; a gc that locks later sees the push lock and withdraws. So the push
        keeps its lock and waits for those first gcs alone: pushes never starve.

        Raises:
            RepoError: a gc still holds the repository after `wait_s` seconds.
        """
        held = HeldLock(self, "push")
        deadline = self.clock() + self.wait_s
        delay = 0.02
        blockers = {g.key: g for g in self.live("gc")}
        while blockers:
            if self.clock() >= deadline:
                held.release()
                g = next(iter(blockers.values()))
                raise RepoError(
                    f"a gc is running on {self.store.uri} (lock {g.key} by {g.owner}); push "
                    f"again when it ends. A lock older than {self.ttl_s:.0f}s, or whose process "
                    "has exited on this machine, is stale and ignored"
                )
            self.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 0.5)
            live = {g.key for g in self.live("gc")}
            blockers = {k: g for k, g in blockers.items() if k in live}
        return held

    def try_acquire_gc(self) -> tuple[HeldLock | None, list[LockInfo]]:
        """Take a gc lock unless a live push lock exists.

        Returns:
            The held lock, or None and the push locks that were in the way.
        """
        held = HeldLock(self, "gc")
        pushes = self.live("push")
        if pushes:
            held.release()
            return None, pushes
        return held, []

    def remove_stale(self, keep: str) -> int:
        """Delete stale locks (other than `keep`); return how many."""
        now = self.clock()
        stale = [x for x in self.read() if x.key != keep and self.is_stale(x, now)]
        for lock in stale:
            self.store.delete(lock.key)
        return len(stale)


def _optional(value: Any, kind: type) -> Any:
    # Locks written before a field existed lack it; a wrong type counts as absent.
    return value if isinstance(value, kind) and not isinstance(value, bool) else None


def _kind(key: str) -> str:
    return key.rsplit("/", 1)[-1].split("-", 1)[0]
