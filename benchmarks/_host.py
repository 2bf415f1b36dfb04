"""The benchmark machine: pinning processes to cores, and naming the machine."""

from __future__ import annotations

import os
import platform
import subprocess

__all__ = ["end", "machine", "pin", "taskset"]


def pin(core: int) -> None:
    """Pin this process to the `core`-th core it may run on (a no-op on one core)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) > 1:
        os.sched_setaffinity(0, {cores[core % len(cores)]})


def taskset(core: int) -> list[str]:
    """The command prefix that pins a child process as `pin` does."""
    cores = sorted(os.sched_getaffinity(0))
    return ["taskset", "-c", str(cores[core % len(cores)])] if len(cores) > 1 else []


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
