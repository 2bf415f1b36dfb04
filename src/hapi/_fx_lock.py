"""One process-wide lock between tracing a model and running one.

`torch.fx` traces by patching `nn.Module.__call__` and `nn.Module.__getattr__` on the class
itself for the duration of a trace. Every module call in every thread then goes through
that trace's tracer: a head running in another thread fails with "module is not installed
as a submodule", and two traces at once restore each other's patches in the wrong order,
which can leave the class patched for good. So tracing takes the lock `exclusive`ly and
code that runs modules while a trace may happen elsewhere (the server's chunks) takes it
`shared`: many heads run at once, a trace waits for them to finish a batch, and heads
wait for the trace (tenths of a second, once per model).

It lives at the top level so that `hapi.graph` (which traces) and `hapi.server` (which
runs heads) can both use it without depending on each other.
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
    trace is not starved by a stream of chunks.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._owner: int | None = None
        self._depth = 0
        self._waiting = 0

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the lock alone (tracing)."""
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
            else:
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

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        """Hold the lock with others (running modules)."""
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                nested = True
            else:
                nested = False
                while self._owner is not None or self._waiting:
                    self._cond.wait()
                self._shared += 1
        try:
            yield
        finally:
            if not nested:
                with self._cond:
                    self._shared -= 1
                    if not self._shared:
                        self._cond.notify_all()


TRACING = TracingLock()
"""The process's lock: `TRACING.exclusive()` around tracing, `TRACING.shared()` around
running modules that another thread's trace must not see."""
