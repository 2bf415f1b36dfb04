"""A process a test starts on 127.0.0.1, waits for, and stops by its pid.

The shared part of the store emulators (`SeaweedS3`, `Azurite`, `FakeGCS`): free loopback
ports, a log file in the emulator's data directory, a readiness probe with a deadline that
notices an early exit, and a stop that terminates, then kills, only the process it started.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, ClassVar, Self

__all__ = ["Launched", "free_port"]

_GRPC_OFFSET = 10000  # SeaweedFS serves gRPC on each HTTP port + 10000


def free_port(taken: set[int] | None = None) -> int:
    """A TCP port free on loopback whose gRPC twin (port + 10000) is free too.

    The twin costs nothing to the emulators that do not use it, and one function serves
    all of them.

    Args:
        taken: ports already handed out (added to), so one start never gets a port twice.
    """
    taken = set() if taken is None else taken
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        twin = port + _GRPC_OFFSET
        if twin >= 65535 or {port, twin} & taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", twin))
            except OSError:
                continue
        taken.update((port, twin))
        return port
    raise RuntimeError("no free port pair on 127.0.0.1")


@dataclass
class Launched:
    """One emulator process and its log. Subclasses name it and define `start()`,
    which builds the command and calls `_launch`. A context manager."""

    data_dir: Path
    proc: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = None

    name: ClassVar[str] = "emulator"
    log_name: ClassVar[str] = "emulator.log"

    @property
    def log_path(self) -> Path:
        """Where the process's output goes: look here when a test fails."""
        return self.data_dir / self.log_name

    def start(self, timeout: float = 60.0) -> Self:
        raise NotImplementedError

    def _launch(
        self,
        cmd: Sequence[str],
        ready: Callable[[], object],
        timeout: float,
        *,
        env: Mapping[str, str] | None = None,
        interval: float = 0.2,
    ) -> Self:
        """Start `cmd` and return once `ready()` stops raising.

        Raises:
            RuntimeError: the process exited, or was not ready in `timeout`; it is stopped.
        """
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            list(cmd),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=None if env is None else {**os.environ, **env},
        )
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited early; see {self.log_path}")
                try:
                    ready()
                    return self
                except Exception as exc:  # not up yet: connection refused, 5xx, ...
                    last = exc
                time.sleep(interval)
            raise RuntimeError(f"{self.name} not ready in {timeout}s ({last}); see {self.log_path}")
        except BaseException:
            self.stop()
            raise

    def stop(self, grace: float = 3.0) -> None:
        """Stop the process this object started, by its pid; then close its log.

        Args:
            grace: seconds it gets to exit after SIGTERM before SIGKILL. A graceful stop
                can wait long on open client connections, and a test's data is thrown
                away anyway.
        """
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
