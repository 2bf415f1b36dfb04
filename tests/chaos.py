"""`Chaos`: kills servers and stops the store at seeded random moments, and revives them."""

from __future__ import annotations

import random
import threading
import time

from .seaweed import SeaweedS3
from .serve_process import ServeProcess

__all__ = ["Chaos"]


class Chaos:
    """A thread that does `events` at random moments while the job runs, and revives
    what it broke (a server whose store is away exits at start: it is started again)."""

    def __init__(
        self, servers: list[ServeProcess], store: SeaweedS3, seed: int, events: list[str]
    ) -> None:
        self.servers, self.store = servers, store
        self.rng = random.Random(seed)
        self.events = events
        self.done: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos", daemon=True)
        self._down_until: dict[int, float] = {}

    def _run(self) -> None:
        pending = list(self.events)
        next_at = time.monotonic() + self.rng.uniform(0.5, 1.5)
        while not self._stop.wait(0.1):
            self._revive()
            if pending and time.monotonic() >= next_at:
                event = pending.pop(0)
                if event == "kill":
                    index = self.rng.randrange(len(self.servers))
                    if self.servers[index].running:
                        self.servers[index].kill()
                    self._down_until[index] = time.monotonic() + self.rng.uniform(0.2, 3.0)
                    event = f"kill server {index}"
                else:
                    self.store.stop(grace=0.5)
                    self._stop.wait(self.rng.uniform(0.5, 3.0))
                    self.store.start()
                    event = "store outage"
                self.done.append(event)
                next_at = time.monotonic() + self.rng.uniform(0.5, 2.0)

    def _revive(self) -> None:
        for index, server in enumerate(self.servers):
            if not server.running and time.monotonic() >= self._down_until.get(index, 0.0):
                server.start()

    def __enter__(self) -> Chaos:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
