"""`Sessions`: a job's sessions on its server, one per cut, re-opened when lost."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

from hapi.client.servers.source import Server
from hapi.errors import HapiError, SessionNotFound
from hapi.wire import SessionRequest

__all__ = ["KEEPALIVE_S", "Sessions"]

KEEPALIVE_S = 20.0
"""Seconds between a loop's keepalives: a third of the server's default `session_idle_s`,
so two may be lost before the server closes a session of a job that is alive."""

# (cut, the lost session's id, the new one's): for the job's history.
OnReopen = Callable[[int, str, str], None]


class Sessions:
    """The sessions a loop uses: one per cut, opened on first use, closed at the end.

    A plan may change its cut mid-epoch and a hybrid plan fetches raw bytes beside
    features, so a loop may need several cuts. A restarted server has forgotten every
    session; `reopen` opens it again from the same request, once however many chunks
    found it lost.

    Args:
        connection: the server.
        request: the session request for a cut; None for a fixed session that cannot be
            re-opened (a loader given a session id).
        on_reopen: called after a lost session was opened again.
        keepalive_s: seconds between keepalives while the sessions are open (`with`), so
            a job that is alive but between chunks (evaluating, or a slow step of its
            own) keeps its sessions; None: none are sent.
    """

    def __init__(
        self,
        connection: Server,
        request: Callable[[int], SessionRequest] | None,
        *,
        on_reopen: OnReopen | None = None,
        keepalive_s: float | None = KEEPALIVE_S,
    ) -> None:
        self.connection = connection
        self._request = request
        self._on_reopen = on_reopen
        self._ids: dict[int, str] = {}
        self._lock = threading.Lock()
        self.opened: list[str] = []
        """Every session id this object opened, re-opened ones included."""
        self.keepalive_s = keepalive_s
        self.local_prefixes: tuple[str, ...] = ()
        """Prefixes the server says are local to it (known once a session has opened)."""
        self._idle_s = float("inf")
        """The shortest idle limit of the servers' sessions this object opened."""
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None

    @classmethod
    def fixed(cls, connection: Server, session: str, cut: int) -> Sessions:
        """An already open session at `cut`, which this object neither re-opens nor closes."""
        sessions = cls(connection, None)
        sessions._ids[cut] = session
        return sessions

    def get(self, cut: int) -> str:
        """The session for `cut`, opened now if it is not yet.

        Raises:
            HapiError: the server refused or cannot be reached (`ServerUnavailable`).
            SessionNotFound: a fixed loader has no session for this cut.
        """
        with self._lock:
            if cut not in self._ids:
                if self._request is None:
                    raise SessionNotFound(f"this loader was given no session for cut {cut}")
                self._ids[cut] = self._open(cut)
            return self._ids[cut]

    def reopen(self, cut: int, lost: str) -> str:
        """Open `cut`'s session again if `lost` is still its id; its id either way.

        Raises:
            SessionNotFound: a fixed session, which cannot be re-opened.
            HapiError: the server refused or cannot be reached.
        """
        with self._lock:
            current = self._ids.get(cut)
            if current is not None and current != lost:
                return current  # another chunk re-opened it already
            if self._request is None:
                raise SessionNotFound(
                    f"session {lost} is gone from the server and this loader cannot re-open "
                    "it: give it a request (TransferJob does)"
                )
            self._ids[cut] = new = self._open(cut)
        if self._on_reopen is not None:
            self._on_reopen(cut, lost, new)
        return new

    def ids(self) -> list[str]:
        """The ids in use now, one per cut."""
        with self._lock:
            return list(self._ids.values())

    def close(self) -> None:
        """Close the sessions this object opened (the server may be gone: no error)."""
        if self._request is None:
            return
        with self._lock:
            ids, self._ids = list(self._ids.values()), {}
        for session in ids:
            with contextlib.suppress(HapiError):
                self.connection.close_session(session)

    def _open(self, cut: int) -> str:
        assert self._request is not None  # callers check
        info = self.connection.open_session(self._request(cut))
        # Renew well within the server's idle limit, whatever it was configured to.
        self._idle_s = min(self._idle_s, info.idle_s)
        self.local_prefixes = tuple(info.local_prefixes)
        self.opened.append(info.session)
        return info.session

    def _keep_alive(self) -> None:
        assert self.keepalive_s is not None  # __enter__ starts this thread only then
        # Wake often and renew when due: a session opened later may come from a server
        # whose idle limit is shorter than the period this loop started with.
        sent = time.monotonic()
        while not self._stop.wait(min(self.keepalive_s, 1.0)):
            if time.monotonic() - sent < min(self.keepalive_s, self._idle_s / 3):
                continue
            sent = time.monotonic()
            with self._lock:
                held = list(self._ids.items())
            for cut, session in held:
                try:
                    self.connection.keepalive(session)
                except SessionNotFound:
                    # A restarted server, or one that closed it while this process was
                    # suspended: open it again now, not when the next chunk fails.
                    with contextlib.suppress(HapiError):
                        self.reopen(cut, session)
                except HapiError:
                    pass  # unreachable for now: the next keepalive or chunk retries

    def __enter__(self) -> Sessions:
        if self._request is not None and self.keepalive_s is not None:
            self._stop.clear()
            self._keeper = threading.Thread(
                target=self._keep_alive, name="hapi-keepalive", daemon=True
            )
            self._keeper.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._keeper is not None:
            self._keeper.join(timeout=10)
            self._keeper = None
        self.close()
