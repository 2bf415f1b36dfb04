"""`hapi serve` as a process of its own, so that a test can kill it as servers die."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from hapi.client import connect
from hapi.errors import HapiError

__all__ = ["ServeProcess"]


class ServeProcess:
    """One `hapi serve` on 127.0.0.1:`port`, started, killed and restarted by its pid.

    Args:
        store: the store it serves (a directory, or `s3://...` with `env`'s credentials).
        port: its port; a restart binds the same one.
        env: extra environment (the S3 endpoint and keys).
        wrap: a command it runs under (`taskset -c 1` in benchmarks).
    """

    def __init__(
        self,
        store: Path | str,
        port: int,
        env: Mapping[str, str] | None = None,
        wrap: Sequence[str] = (),
    ) -> None:
        self.store, self.port, self.wrap = str(store), port, list(wrap)
        self.env = {**os.environ, **(env or {})}
        self.address = f"grpc://127.0.0.1:{port}"
        self.options: tuple[str, ...] = ()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, *options: str) -> None:
        """Start it (with `options`, or those of the last start)."""
        self.options = options or self.options
        cmd = [*self.wrap, sys.executable, "-m", "hapi.cli", "serve", "--store", self.store]
        cmd += ["--port", str(self.port), "--threads", "1", *self.options]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=self.env
        )

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Wait until it answers `stats`."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                connect(self.address, timeout=2).stats()
                return
            except HapiError:
                assert self.proc is not None and self.proc.poll() is None, "server died"
                assert time.monotonic() < deadline, "server did not start"
                time.sleep(0.1)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """kill -9: streams in flight are cut, its sessions are gone."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        """End it if it runs (SIGTERM, then SIGKILL)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
