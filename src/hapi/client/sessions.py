"""`Sessions`: a job's sessions on its server, one per cut, re-opened when lost."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

from hapi.client.connection import Connection
from hapi.errors import HapiError, SessionNotFound
from hapi.wire import SessionRequest

__all__ = ["Sessions"]

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
    """

    def __init__(
        self,
        connection: Connection,
        request: Callable[[int], SessionRequest] | None,
        *,
        on_reopen: OnReopen | None = None,
    ) -> None:
        self.connection = connection
        self._request = request
        self._on_reopen = on_reopen
        self._ids: dict[int, str] = {}
        self._lock = threading.Lock()
        self.opened: list[str] = []
        """Every session id this object opened, re-opened ones included."""

    @classmethod
    def fixed(cls, connection: Connection, session: str, cut: int) -> Sessions:
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
        session = self.connection.open_session(self._request(cut)).session
        self.opened.append(session)
        return session

    def __enter__(self) -> Sessions:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
