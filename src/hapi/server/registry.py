"""`SessionRegistry`: the sessions a server holds, whose each is, and when they go."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from hapi.errors import SessionNotFound, shorten
from hapi.server.chunks.session import Session
from hapi.server.head_cache import HeadCache, HeadLease
from hapi.server.memory.scheduler import Scheduler
from hapi.server.metrics import Metrics
from hapi.server.security.tenants import Tenant
from hapi.wire import SessionStats

__all__ = ["CLOSED_KEPT", "SessionRegistry", "TenantSessions"]

log = logging.getLogger("hapi.server")

CLOSED_KEPT = 1024
"""Closed sessions whose counters `stats` still shows; older ones are forgotten (a server
runs for months), their bytes kept in their tenant's total."""


@dataclass(frozen=True, kw_only=True)
class TenantSessions:
    """What `SessionRegistry.usage` shows of one tenant's sessions (or every tenant's)."""

    open: dict[str, SessionStats]
    """Counters of the open sessions, by id."""
    closed: dict[str, SessionStats]
    """Final counters of the closed sessions still kept, oldest first."""
    bytes_sent: int
    """By every session, open, closed or forgotten."""


class SessionRegistry:
    """The open sessions of a server, the counters of the last `closed_kept` closed ones,
    and the tenant of each.

    A session belongs to the tenant that opened it: `get` answers another tenant's session
    exactly like an unknown one. Every `get` renews a session's lease; one that neither a
    chunk nor a keepalive used for `idle_s` is abandoned, and `close_abandoned` (every call
    runs it, and `reap` every few seconds) closes it. Closing releases the session's head
    lease and its share of the scheduler and ends its metrics series; past `closed_kept`
    closed sessions, the oldest closed is forgotten, its bytes kept in its tenant's total.
    Thread-safe: one lock guards the bookkeeping; sessions change their own counters.

    Args:
        heads: the cache the sessions' head leases come from.
        scheduler: the scheduler that holds each session's share.
        metrics: where sessions opened and closed are counted.
        idle_s: seconds unused after which a session is abandoned.
        clock: monotonic seconds, the sessions' `last_used` clock.
        closed_kept: closed sessions whose counters are kept.
    """

    def __init__(
        self,
        *,
        heads: HeadCache,
        scheduler: Scheduler,
        metrics: Metrics,
        idle_s: float,
        clock: Callable[[], float],
        closed_kept: int = CLOSED_KEPT,
    ) -> None:
        self.heads = heads
        self.scheduler = scheduler
        self.metrics = metrics
        self.idle_s = idle_s
        self._clock = clock
        self.closed_kept = closed_kept
        self._sessions: dict[str, Session] = {}
        self._leases: dict[str, HeadLease] = {}
        self._closed: dict[str, SessionStats] = {}
        self._owners: dict[str, str] = {}
        """Tenant name of every session, open or closed (as long as `_closed` keeps it)."""
        self._forgotten_bytes: dict[str, int] = {}
        """Bytes sent by each tenant's closed sessions that `_closed` no longer keeps."""
        self._lock = threading.Lock()

    def __getitem__(self, session_id: str) -> Session:
        """An open session, whoever's, without renewing it (for the server's operator).

        Raises:
            KeyError: no such open session.
        """
        with self._lock:
            return self._sessions[session_id]

    @property
    def owners(self) -> Mapping[str, str]:
        """The tenant of every session, open or closed and kept (a live, read-only view)."""
        return MappingProxyType(self._owners)

    def open(self, session: Session, *, tenant: str, lease: HeadLease | None) -> None:
        """Register a new session of `tenant`, holding `lease` (released when it closes)."""
        with self._lock:
            self._sessions[session.id] = session
            self._owners[session.id] = tenant
            if lease is not None:
                self._leases[session.id] = lease
        self.metrics.session_opened(tenant, session.id)

    def get(self, session_id: str, tenant: Tenant) -> Session:
        """`tenant`'s open session, its lease renewed and its weight as `tenant`'s now.

        Raises:
            SessionNotFound: no such session, or another tenant's.
        """
        with self._lock:
            session = self._sessions.get(session_id)
            owner = self._owners.get(session_id)
        # Another tenant's session is answered like an unknown one: its id tells nothing.
        if session is None or owner != tenant.name:
            raise SessionNotFound(_unknown_session(session_id))
        session.last_used = self._clock()
        # The caller's tenant is as the tenants file says now: a reload's new weight
        # applies to the session's next batches.
        session.weight = tenant.weight
        return session

    def close(self, session_id: str) -> SessionStats:
        """Close a session, whoever's; return its final counters.

        Raises:
            SessionNotFound: no such open session.
        """
        with self._lock:
            session = self._sessions.pop(session_id, None)
            if session is None:
                raise SessionNotFound(_unknown_session(session_id))
            lease = self._leases.pop(session_id, None)
            if lease is not None:
                self.heads.release(lease)
            stats = session.stats.snapshot()
            self._closed[session_id] = stats
            self.scheduler.remove_session(session_id)
            owner = self._owners[session_id]
            while len(self._closed) > self.closed_kept:
                oldest = next(iter(self._closed))  # dicts keep the order of closing
                gone = self._closed.pop(oldest)
                tenant_name = self._owners.pop(oldest)
                self._forgotten_bytes[tenant_name] = (
                    self._forgotten_bytes.get(tenant_name, 0) + gone.bytes_sent
                )
        self.metrics.session_closed(owner, session_id)
        return stats

    def close_abandoned(self) -> None:
        """Close sessions neither a chunk nor a keepalive used for `idle_s`: their jobs
        died without closing them, and they hold heads in memory."""
        cutoff = self._clock() - self.idle_s
        with self._lock:
            abandoned = [sid for sid, s in self._sessions.items() if s.last_used < cutoff]
        for sid in abandoned:
            log.info("closing session %s: unused for %.0fs", sid, self.idle_s)
            with contextlib.suppress(SessionNotFound):
                self.close(sid)

    def reap(self, stopped: threading.Event) -> None:
        """Close abandoned sessions every few seconds until `stopped` is set, so that the
        heads of a server no call reaches are freed too."""
        # A tenth of the idle time, at most 5 s: a session is closed within 10% of it.
        period = min(5.0, self.idle_s / 10)
        while not stopped.wait(period):
            try:
                self.close_abandoned()
            except Exception:  # the reaper must outlive any one failed close
                log.exception("closing abandoned sessions failed")

    def usage(self, tenant: str | None) -> TenantSessions:
        """The counters of `tenant`'s sessions, open and closed; None: every tenant's."""
        with self._lock:
            mine = {sid for sid, owner in self._owners.items() if tenant is None or owner == tenant}
            sessions = {sid: s.stats.snapshot() for sid, s in self._sessions.items() if sid in mine}
            closed = {sid: s for sid, s in self._closed.items() if sid in mine}
            forgotten = sum(
                n for name, n in self._forgotten_bytes.items() if tenant is None or name == tenant
            )
        sent = sum(s.bytes_sent for s in [*sessions.values(), *closed.values()])
        return TenantSessions(open=sessions, closed=closed, bytes_sent=forgotten + sent)


def _unknown_session(session_id: str) -> str:
    """The message of `SessionNotFound` for `session_id`."""
    return (
        f"no session {shorten(repr(session_id), 100)} on this server (closed, unused for "
        "too long, or the server restarted): open a new session"
    )
