"""The benchmark machine: pinning processes to cores, and naming the machine."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import sys
from pathlib import Path

__all__ = ["PinnedServer", "end", "machine", "pin", "serving", "taskset"]

_CORES = sorted(os.sched_getaffinity(0))
"""The cores the benchmark was started on, read once: after `pin(0)` this process may run
on core 0 alone, and numbering from its affinity then made `pin(1)` (and `taskset(1)`) a
no-op - the formats benchmark's trainer, proxy and server all shared core 0."""


def pin(core: int) -> None:
    """Pin this process - every thread it has and those it starts after - to the
    `core`-th core the benchmark was started on (a no-op on one core)."""
    if len(_CORES) > 1:
        # Affinity is a thread's: pinning only the caller left threads started before
        # (gRPC's, a store client's) on the core the process had then.
        tasks = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]
        for tid in tasks:
            with contextlib.suppress(ProcessLookupError):  # a thread that has ended
                os.sched_setaffinity(int(tid), {_CORES[core % len(_CORES)]})


def taskset(core: int) -> list[str]:
    """The command prefix that pins a child process as `pin` does."""
    return ["taskset", "-c", str(_CORES[core % len(_CORES)])] if len(_CORES) > 1 else []


def machine() -> str:
    """The machine in a few words, for a results table."""
    return f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}, CPU only"


def end(proc: subprocess.Popen[bytes] | subprocess.Popen[str]) -> None:
    """End a process this benchmark started: SIGTERM, then SIGKILL after 10 s."""
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def serving(proc: subprocess.Popen[bytes], address: str, timeout_s: float = 60.0) -> None:
    """Wait until `hapi serve` (`proc`) answers at `address`; end it and raise if it
    dies or does not answer within `timeout_s`."""
    import time

    from hapi.client import connect

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            connect(address, timeout=2).stats()
            return
        except Exception:
            if time.monotonic() > deadline or proc.poll() is not None:
                end(proc)
                raise RuntimeError(f"server on {address} did not start") from None
            time.sleep(0.2)


class PinnedServer:
    """`hapi serve --threads 1` on a store (a local one, or a bucket with `env`), pinned to
    core 0 with one OpenMP thread, waited for until it answers; end it with
    `end(server.proc)`."""

    def __init__(
        self, store: Path | str, env: dict[str, str] | None = None, args: tuple[str, ...] = ()
    ) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.seaweed import free_port

        port = free_port()
        self.address = f"grpc://127.0.0.1:{port}"
        cmd = [*taskset(0), sys.executable, "-m", "hapi.cli", "serve", "--store", str(store)]
        cmd += ["--port", str(port), "--threads", "1", *args]
        # `env`: a store's own (an S3 endpoint and its keys).
        env = {**os.environ, **(env or {}), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
        )
        serving(self.proc, self.address)

    def cpu_s(self) -> float:
        """The server process's CPU seconds so far, all its threads."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def peak_rss(self) -> int:
        """The server process's peak resident memory, in bytes."""
        return self._status("VmHWM:")

    def rss(self) -> int:
        """The server process's resident memory now, in bytes."""
        return self._status("VmRSS:")

    def _status(self, field: str) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024
        return 0
