"""`serve`: a `HapiServer` run in a background thread for a `with` block - the library's
way to run one, and `hapi serve`'s."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from hapi.server.security.tenants import reload_on_sighup
from hapi.server.server import HapiServer
from hapi.server.server_config import ServerConfig

__all__ = ["serve"]


@contextlib.contextmanager
def serve(
    config: ServerConfig | None = None,
    *,
    clock: Callable[[], float] = time.monotonic,
    **options: Any,
) -> Iterator[HapiServer]:
    """Run a server in a background thread for the duration of a `with` block.

    Args:
        config: the server's settings; or give them as keyword arguments (`store=...`).
        clock: monotonic seconds, for session idle times (tests pass a fake clock).
    """
    server = HapiServer(config or ServerConfig(**options), clock=clock)
    # Python lets only the main thread install signal handlers; elsewhere, call
    # `server.tenants.reload()` to re-read the tenants file.
    reloads = (
        server.tenants.path is not None and threading.current_thread() is threading.main_thread()
    )
    restore = reload_on_sighup(server.tenants) if reloads else None
    thread = threading.Thread(target=server.serve, name="hapi-serve", daemon=True)
    thread.start()
    try:
        yield server
    finally:
        if restore is not None:
            restore()
        # Streams cut off by a vanished client can hold shutdown: wait 10 s, not forever.
        stopper = threading.Thread(target=server.shutdown, name="hapi-stop", daemon=True)
        stopper.start()
        stopper.join(timeout=10)
        thread.join(timeout=10)
