"""The trainer's profile, measured once per model, batch and machine and then kept.

Timing every cut's head and the training step took a job 1-4 s of its first seconds, on
every run of the same script. The times depend on what runs - the traced graph, its
parameters' shapes, the freeze point, the input and batch size - and where - the device,
torch's version and threads, the CPU model and how many cores the process may use - not
on the weights' values or the data. So they are kept under `$HAPI_CACHE_DIR/profiles`
(default `~/.cache/hapi/profiles`), one small JSON file per key. A cached profile can be
stale (a machine busier than when it was measured): the re-planner corrects the plan
from the chunks' own times, as for any drift. The per-job parts - decoding this job's
objects, receiving its bytes - are measured every time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from hapi.graph import ModelGraph
from hapi.plan import TrainerProfile

__all__ = ["TrainerProfiles"]

_VERSION = 1
"""Bumped when what a profile holds, or how it is measured, changes."""


class TrainerProfiles:
    """Trainer profiles on disk, by what they depend on.

    Args:
        root: the directory; None: `$HAPI_CACHE_DIR/profiles` (or `~/.cache/hapi/profiles`).
    """

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        if root is None:
            base = os.environ.get("HAPI_CACHE_DIR") or Path.home() / ".cache" / "hapi"
            root = Path(base) / "profiles"
        self.root = Path(root)

    def get_or_measure(
        self,
        graph: ModelGraph,
        freeze: int,
        batch_size: int,
        measure: Callable[[], TrainerProfile],
    ) -> tuple[TrainerProfile, bool]:
        """The cached profile for this job's model and machine, else `measure()`'s (kept).

        Returns:
            The profile (its `decode_s` and `receive_s` are the job's to set), and whether
            it came from the cache.
        """
        path = self.root / f"trainer-{_key(graph, freeze, batch_size)}.json"
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
            # A file that cannot be read (another version's, a torn write) is measured again.
            return TrainerProfile.from_dict(json.loads(path.read_text())), True
        profile = measure()
        with contextlib.suppress(OSError):  # a read-only home: measured every time
            _write_atomic(path, json.dumps(profile.to_dict()))
        return profile, False


def _key(graph: ModelGraph, freeze: int, batch_size: int) -> str:
    model = graph.model
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    parts = [
        f"v{_VERSION}",
        torch.__version__,
        str(device),
        f"threads={torch.get_num_threads()}",
        f"cores={len(os.sched_getaffinity(0))}",
        _cpu_model(),
        graph.method,
        str(getattr(model, "code", type(model).__qualname__)),
        *(f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in model.state_dict().items()),
        f"input={graph.input_shape}",
        f"freeze={freeze}",
        f"batch={batch_size}",
    ]
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=16).hexdigest()


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _write_atomic(path: Path, text: str) -> None:
    # Written aside and renamed: two jobs starting at once never read half a file.
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".trainer-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
