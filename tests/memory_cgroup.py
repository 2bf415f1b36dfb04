"""A real memory cgroup for a process under test: made, capped, read and removed.

cgroup v1 (`memory.limit_in_bytes`, these machines) or v2 (`memory.max`), whichever holds
the memory controller; made at the top of its hierarchy, which needs root. Processes
join it before they exec (`preexec`), so everything they allocate is charged to it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from pathlib import Path
from types import TracebackType

__all__ = ["CgroupUnavailable", "MemoryCgroup", "remove_cgroup"]

V1 = Path("/sys/fs/cgroup/memory")
V2 = Path("/sys/fs/cgroup")


class CgroupUnavailable(RuntimeError):
    """No memory cgroup can be made here (not root, or no memory controller)."""


class MemoryCgroup:
    """A memory cgroup capped at `limit` bytes (None: no cap), removed on exit.

    Args:
        limit: the cap.
        name: a prefix of the group's name.
    """

    def __init__(self, limit: int | None, name: str = "hapi-test") -> None:
        if (V1 / "cgroup.procs").exists():
            self.version, top = 1, V1
            self._limit, self._usage, self._peak = (
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
                "memory.max_usage_in_bytes",
            )
        elif "memory" in _read(V2 / "cgroup.subtree_control").split():
            self.version, top = 2, V2
            self._limit, self._usage, self._peak = "memory.max", "memory.current", "memory.peak"
        else:
            raise CgroupUnavailable(
                "no memory controller: neither cgroup v1's /sys/fs/cgroup/memory nor a v2 "
                "hierarchy with memory in its cgroup.subtree_control"
            )
        self.top = top
        self.path = top / f"{name}-{os.getpid()}-{secrets.token_hex(3)}"
        self.limit = limit
        self.name = "/" + self.path.name
        """The group's path in its hierarchy, as /proc/<pid>/cgroup names it."""

    def __enter__(self) -> MemoryCgroup:
        try:
            self.path.mkdir()
        except OSError as exc:
            raise CgroupUnavailable(f"cannot make a memory cgroup at {self.path}: {exc}") from exc
        if self.limit is not None:
            self.set_limit(self.limit)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.remove()

    def set_limit(self, limit: int) -> None:
        """Cap the group at `limit` bytes from now on."""
        (self.path / self._limit).write_text(str(limit))
        self.limit = limit

    def preexec(self) -> None:
        """Join the group: `subprocess.Popen(..., preexec_fn=group.preexec)`."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def pids(self) -> list[int]:
        return [int(p) for p in _read(self.path / "cgroup.procs").split()]

    def usage(self) -> int:
        """Bytes the kernel charges the group now."""
        return int(_read(self.path / self._usage) or 0)

    def peak(self) -> int:
        """The most bytes charged to the group so far."""
        return int(_read(self.path / self._peak) or 0)

    def reset_peak(self) -> None:
        """Start `peak` again from the usage now (v1; v2's `memory.peak` cannot be reset
        for every reader, so there it stays the peak since the group was made)."""
        if self.version == 1:
            (self.path / self._peak).write_text("0")

    def stat(self) -> dict[str, int]:
        """The group's `memory.stat`: what its charge is made of (anon, file cache, ...)."""
        lines = _read(self.path / "memory.stat").splitlines()
        return {k: int(v) for k, _, v in (line.partition(" ") for line in lines) if v.isdigit()}

    def oom_kills(self) -> int:
        """Processes the kernel killed at the group's limit."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        for line in _read(self.path / name).splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def remove(self) -> None:
        """Remove the group (`remove_cgroup`)."""
        remove_cgroup(self.path, self.top)


def remove_cgroup(path: Path, top: Path) -> None:
    """Move what is left in the group at `path` to the top of its hierarchy, `top`, then
    remove it (a group with processes, or one the kernel is still freeing, cannot be
    removed at once). Any controller's group: `benchmarks/_cpu_cap.py` uses it too."""
    if not path.exists():
        return
    for pid in _read(path / "cgroup.procs").split():
        with contextlib.suppress(OSError):
            (top / "cgroup.procs").write_text(pid)
    for _ in range(100):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)
    path.rmdir()


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
