"""Whether the process that wrote a lock is gone, where this machine can tell for sure.

A lock records where its process runs (`machine_id`) and which process it is (its pid and
start time). Another process may declare it gone only when it runs in the very same place:
same host name, same boot (`boot_id`) and same pid namespace (containers on one host share
a boot but not their pids). There, a pid that does not exist, a zombie, or a pid now held by
a process started at another time (the pid was reused) mean the writer is dead. Everywhere
else (another machine, not Linux) nothing is known, and the lock's TTL decides.
"""

from __future__ import annotations

import functools
import os
import socket

__all__ = ["holder_is_gone", "machine_id", "process_started"]


@functools.cache
def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def machine_id() -> str | None:
    """Names the place this process runs (host, boot and pid namespace), or None where
    that cannot be known (not Linux)."""
    boot = _boot_id()
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    if boot is None:
        return None
    return f"{socket.gethostname()}/{boot}/{namespace}"


def _stat(pid: int) -> tuple[str, int] | None:
    """`(state, start time)` of process `pid` from /proc, or None when it is not there."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = stat.rsplit(")", 1)[-1].split()
    try:
        return fields[0], int(fields[19])  # fields 3 (state) and 22 (starttime)
    except (IndexError, ValueError):
        return None


def process_started(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (None where unknown)."""
    stat = _stat(pid)
    return stat[1] if stat else None


def holder_is_gone(machine: object, pid: object, started: object) -> bool:
    """Whether the process a lock names is certainly not running.

    Args:
        machine: the lock's `machine_id()`; only one equal to this process's is judged.
        pid: the writer's pid.
        started: the writer's `process_started()`, to tell a reused pid; None skips that.
    """
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False  # 0 and negative pids name process groups, never one process
    if machine is None or machine != machine_id():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # it exists, under another user
    stat = _stat(pid)
    if stat is None:
        return False
    state, start = stat
    if state in ("Z", "X"):
        return True  # exited; only its parent has not collected it yet
    return isinstance(started, int) and start != started
