"""One process-wide lock between tracing a model and running one.

`torch.fx` traces by patching `nn.Module` on the class itself, for every thread, while a
trace runs. So tracing takes the lock `exclusive`ly and code that runs modules while a
trace may happen elsewhere (the server's chunks) takes it `shared`: many heads run at
once, a trace waits for them to finish a batch. It lives at the top level so that
`hapi.graph` (which traces) and `hapi.server` (which runs heads) can both use it without
depending on each other. Why: `docs/heads.md`, "Tracing and running".
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["TRACING", "TracingLock"]


class TracingLock:
    """A shared/exclusive lock, writer-preferring, re-entrant for its exclusive holder.

    A thread holding it exclusively may take it again either way (tracing code that runs
    a module to propagate shapes); a waiting exclusive taker blocks new shared ones, so a
    trace is not starved by a stream of chunks. A thread holding it shared may take it
    exclusively too: a head or tail that meets a train/eval mode for the first time exports
    it there (`hapi.graph._modal`), and torch.export is no more thread-safe than a trace.
    Its shares are let go while it waits and taken back after, so two such threads do not
    wait on each other.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._shares: dict[int, int] = {}
        """Each holding thread's shares (nested `shared` calls)."""
        self._owner: int | None = None
        self._depth = 0
        self._waiting = 0

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the lock alone (tracing)."""
        me = threading.get_ident()
        with self._cond:
            held = 0
            if self._owner == me:
                self._depth += 1
            else:
                held = self._shares.pop(me, 0)
                self._shared -= held
                self._waiting += 1
                try:
                    while self._owner is not None or self._shared:
                        self._cond.wait()
                finally:
                    self._waiting -= 1
                self._owner, self._depth = me, 1
        try:
            yield
        finally:
            with self._cond:
                self._depth -= 1
                if not self._depth:
                    self._owner = None
                    self._cond.notify_all()
                    if held:
                        self._take_shares(me, held)

    def _take_shares(self, me: int, count: int) -> None:
        """Take `count` shares for thread `me` (the condition held)."""
        while self._owner is not None or self._waiting:
            self._cond.wait()
        self._shared += count
        self._shares[me] = self._shares.get(me, 0) + count

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        """Hold the lock with others (running modules)."""
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                nested = True
            elif me in self._shares:
                # Nested: taken again at once, or a waiting tracer would wait on us.
                nested = False
                self._shared += 1
                self._shares[me] += 1
            else:
                nested = False
                self._take_shares(me, 1)
        try:
            yield
        finally:
            if not nested:
                with self._cond:
                    self._shared -= 1
                    self._shares[me] -= 1
                    if not self._shares[me]:
                        del self._shares[me]
                    if not self._shared:
                        self._cond.notify_all()


TRACING = TracingLock()
"""The process's lock: `TRACING.exclusive()` around tracing, `TRACING.shared()` around
running modules that another thread's trace must not see."""
