"""Profiles kept between jobs, so a job measures what no earlier job has.

Under `$HAPI_CACHE_DIR/profiles` (default `~/.cache/hapi/profiles`), one small JSON file
each: the trainer's head and training-step times (`ProfileCache.trainer`), keyed by what
runs and where, and a job's three profiles by everything its measurements depend on
(`job_key`). Every job probes its link again and replaces a kept one 2x off; the
re-planner corrects the rest. Why and what the keys hold: `docs/cost-model.md`,
"Profiles kept between jobs".
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from hapi._cache_home import cache_home
from hapi.graph import ModelGraph
from hapi.plan import CodecProfile, LinkProfile, ServerProfile, TrainerProfile

__all__ = ["ProfileCache", "job_key", "trainer_key"]

_VERSION = 2
"""Bumped when what a profile holds, or how it is measured, changes."""


class ProfileCache:
    """Profiles on disk, by what they depend on.

    Args:
        root: the directory; None: `$HAPI_CACHE_DIR/profiles` (or `~/.cache/hapi/profiles`).
    """

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root) if root is not None else cache_home("profiles")

    def trainer(
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
        path = self.root / f"trainer-{trainer_key(graph, freeze, batch_size)}.json"
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
            # A file that cannot be read (another version's, a torn write) is measured again.
            return TrainerProfile.from_dict(json.loads(path.read_text())), True
        profile = measure()
        with contextlib.suppress(OSError):  # a read-only home: measured every time
            _write_atomic(path, json.dumps(profile.to_dict()))
        return profile, False

    def job(
        self, key: str
    ) -> tuple[ServerProfile, TrainerProfile, LinkProfile, tuple[CodecProfile, ...]] | None:
        """The profiles (and wire codecs) an earlier job with this `job_key` measured."""
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
            data = json.loads((self.root / f"job-{key}.json").read_text())
            return (
                ServerProfile.from_dict(data["server"]),
                TrainerProfile.from_dict(data["trainer"]),
                LinkProfile.from_dict(data["link"]),
                tuple(CodecProfile.from_dict(c) for c in data.get("codecs", ())),
            )
        return None

    def keep(
        self,
        key: str,
        server: ServerProfile,
        trainer: TrainerProfile,
        link: LinkProfile,
        codecs: Sequence[CodecProfile] = (),
    ) -> None:
        """Keep a job's measured profiles for the next job with this `job_key`."""
        data = {"server": server.to_dict(), "trainer": trainer.to_dict(), "link": link.to_dict(),
                "codecs": [c.to_dict() for c in codecs]}  # fmt: skip
        with contextlib.suppress(OSError):
            _write_atomic(self.root / f"job-{key}.json", json.dumps(data))


def job_key(
    graph: ModelGraph, freeze: int, batch_size: int, *, server: str, job: Mapping[str, Any]
) -> str:
    """What a job's measurements depend on: the trainer's (`trainer_key`), the server's
    address, and `job` - the dataset, the session request at RAW (model, transforms,
    input size, wire dtype), the chunk size and the probe's size."""
    canonical = json.dumps(job, sort_keys=True, separators=(",", ":"), default=str)
    text = f"{trainer_key(graph, freeze, batch_size)}\n{server}\n{canonical}"
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def trainer_key(graph: ModelGraph, freeze: int, batch_size: int) -> str:
    """What the trainer's head and step times depend on: the model's structure, the freeze
    point, the input and batch size, and the machine."""
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
