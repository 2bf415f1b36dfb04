"""The limits on a server's memory: its memory cgroups', the host's, and a GPU's.

Every cgroup (v1 or v2) from the process's own up to the hierarchy's mount point that sets
a limit is one `MemoryLimit`, counted less what its group already uses (without the page
cache). All paths are read under `root`, so tests lay out a `/proc` and a cgroup mount in a
directory; torch is imported only for a GPU's limit. How the groups are found:
docs/server.md, "The limits on a server's memory".
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hapi._sizes import format_bytes

__all__ = [
    "MemoryLimit",
    "cgroup_limits",
    "host_limit",
    "memory_limits",
    "tightest_limit",
    "tightest_room",
]

HOST_SHARE = 0.5
"""Share of the room a host or cgroup limit leaves that the default budget takes: the
process's own memory outside the budget (gRPC's buffers, Python objects, threads' stacks)
grows into the rest as jobs come."""
DEVICE_SHARE = 0.9
"""Share of a GPU's free memory the default budget takes: the CUDA context and the
allocator's slack sit outside what torch reports."""

_NO_LIMIT = 2**62  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1
_V1 = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
_V2 = ("memory.max", "memory.current", "inactive_file")


@dataclass(frozen=True, kw_only=True)
class MemoryLimit:
    """One limit on the memory the server may take, and what is in use against it."""

    what: str
    """The limit in words: `cgroup memory.limit_in_bytes`, `host memory`, `cuda:0`."""
    where: str = ""
    """The cgroup's path in its hierarchy; empty for the host and a device."""
    limit: int
    """Bytes the limit allows in all."""
    used: int
    """Bytes in use against it now, this process's included (for a cgroup, less the
    inactive page cache the kernel reclaims first)."""
    share: float = HOST_SHARE
    """Share of the room left that the default budget takes."""

    @property
    def room(self) -> int:
        """Bytes left before the limit."""
        return max(self.limit - self.used, 0)

    @property
    def budget(self) -> int:
        """The default budget this limit allows: `share` of the room left."""
        return int(self.room * self.share)

    def __str__(self) -> str:
        share = {0.5: "half"}.get(self.share, f"{self.share:.0%}")
        where = f" of {self.where}" if self.where else ""
        return (
            f"{share} of {self.what}{where} {format_bytes(self.limit)} less "
            f"{format_bytes(self.used)} in use"
        )


def memory_limits(device: str = "cpu", *, root: Path = Path("/")) -> list[MemoryLimit]:
    """Every limit on this process's memory: the host's, its cgroups', and on a GPU the
    device's (its inputs are decoded in host memory, so the host's limits bind it too)."""
    limits = [host_limit(root=root), *cgroup_limits(root=root)]
    if device.startswith("cuda"):
        import torch

        free, total = torch.cuda.mem_get_info(torch.device(device))
        limits.append(MemoryLimit(what=device, limit=total, used=total - free, share=DEVICE_SHARE))
    return limits


def tightest_limit(device: str = "cpu", *, root: Path = Path("/")) -> MemoryLimit:
    """The limit that allows the smallest default budget."""
    return min(memory_limits(device, root=root), key=lambda limit: limit.budget)


def tightest_room(device: str = "cpu", *, root: Path = Path("/")) -> MemoryLimit:
    """The limit with the least room left: what a configured budget must fit in."""
    return min(memory_limits(device, root=root), key=lambda limit: limit.room)


def host_limit(*, root: Path = Path("/")) -> MemoryLimit:
    """The host's memory, with what the kernel counts available (free, and the page cache
    it can drop) as the room left."""
    info: dict[str, int] = {}
    try:
        for line in (root / "proc/meminfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if value.split() and value.split()[0].isdigit():
                info[name] = int(value.split()[0]) * 1024
    except OSError:
        pass
    total = info.get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    available = info.get("MemAvailable", info.get("MemFree", total))
    return MemoryLimit(what="host memory", limit=total, used=max(total - available, 0))


def cgroup_limits(*, root: Path = Path("/")) -> list[MemoryLimit]:
    """The limits of this process's memory cgroups (v1 and v2), from its own group up to
    the top of the hierarchy it can see; none where no group sets one."""
    limits = []
    for version, top, mount_root, below in _own_groups(root):
        limit_file, usage_file, inactive = _V1 if version == 1 else _V2
        # Ancestors bind too: a pod's limit holds its containers' groups together.
        for depth in range(len(below), -1, -1):
            directory = top.joinpath(*below[:depth])
            limit = _read_int(directory / limit_file)
            if limit is None or limit >= _NO_LIMIT:
                continue  # "max", no such file (the root group), or no limit
            usage = _read_int(directory / usage_file) or 0
            cache = _stat(directory / "memory.stat").get(inactive, 0)
            limits.append(
                MemoryLimit(
                    what=f"cgroup {limit_file}",
                    where="/" + "/".join([*mount_root, *below[:depth]]),
                    limit=limit,
                    used=max(usage - cache, 0),
                )
            )
    return limits


def _own_groups(root: Path) -> Iterator[tuple[int, Path, list[str], list[str]]]:
    """For the memory controller's v1 hierarchy and the v2 one, where mounted: (version,
    the mount point's directory, the hierarchy's path at the mount's root, and the
    process's group below it), paths as lists of names."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return
    paths: dict[int, list[str]] = {}
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        if fields[1] == "":
            paths[2] = _parts(fields[2])
        elif "memory" in fields[1].split(","):
            paths[1] = _parts(fields[2])
    for version, mount_root, mount_point in _mounts(root):
        group = paths.get(version)
        if group is None:
            continue
        # A container without a cgroup namespace mounts its own group (or an ancestor) as
        # the hierarchy's root: the group lies below the mount point by the rest of its
        # path. A group outside the mount (a namespace's "/.." paths) is read at the top.
        if group[: len(mount_root)] == mount_root and ".." not in group:
            below = group[len(mount_root) :]
        else:
            below = []
        yield version, root / mount_point.lstrip("/"), mount_root, below


def _mounts(root: Path) -> list[tuple[int, list[str], str]]:
    """(version, the hierarchy's path at the mount's root, mount point) of the memory
    cgroup mounts; the usual ones where mountinfo cannot be read."""
    try:
        lines = (root / "proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return [(1, [], "/sys/fs/cgroup/memory"), (2, [], "/sys/fs/cgroup")]
    mounts = []
    seen: set[int] = set()
    for line in lines:
        fields, _, tail = line.partition(" - ")
        before, after = fields.split(), tail.split()
        if len(before) < 5 or len(after) < 3:
            continue
        fstype, options = after[0], after[2].split(",")
        version = 2 if fstype == "cgroup2" else 1 if fstype == "cgroup" else 0
        if version == 0 or version in seen or (version == 1 and "memory" not in options):
            continue
        seen.add(version)
        mounts.append((version, _parts(_unescape(before[3])), _unescape(before[4])))
    return mounts


def _parts(path: str) -> list[str]:
    return [p for p in path.strip().split("/") if p not in ("", ".")]


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(path: Path) -> dict[str, int]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    return {k: int(v) for k, _, v in (line.partition(" ") for line in lines) if v.isdigit()}


def _unescape(text: str) -> str:
    """A mountinfo path: spaces, tabs and backslashes are written as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)
