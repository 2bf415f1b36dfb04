"""`CpuCap`: a CPU cgroup that holds a process to a share of a core, made and removed.

Three storage nodes' servers on one core of this machine take the core from each other:
one runs faster while the others wait, and a router that balances servers by their
measured pace sees a slow node where there is none. Each node's server in its own group,
capped at a fixed share (`cpu.cfs_quota_us`, cgroup v1's `cpu` controller, or v2's
`cpu.max`), runs at its own pace like a machine of its own. Needs root.
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path
from types import TracebackType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.memory_cgroup import remove_cgroup  # the tests remove their groups alike

__all__ = ["CpuCap"]

V1 = Path("/sys/fs/cgroup/cpu")
V2 = Path("/sys/fs/cgroup")
PERIOD_US = 100_000


class CpuCap:
    """A CPU cgroup capped at `cores` (0.3: 30 ms of every 100 ms), removed on exit.

    Args:
        cores: the share of one core its processes may use together.
        name: a prefix of the group's name.
    """

    def __init__(self, cores: float, name: str = "hapi-bench-cpu") -> None:
        self.cores = cores
        quota = str(int(cores * PERIOD_US))
        if (V1 / "cgroup.procs").exists():
            self.top = V1
            self._settings = {"cpu.cfs_period_us": str(PERIOD_US), "cpu.cfs_quota_us": quota}
        else:
            self.top = V2
            self._settings = {"cpu.max": f"{quota} {PERIOD_US}"}
        self.path = self.top / f"{name}-{os.getpid()}-{secrets.token_hex(3)}"

    def __enter__(self) -> CpuCap:
        self.path.mkdir()
        for name, value in self._settings.items():
            (self.path / name).write_text(value)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        remove_cgroup(self.path, self.top)

    def preexec(self) -> None:
        """Join the group: `subprocess.Popen(..., preexec_fn=cap.preexec)`."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))
