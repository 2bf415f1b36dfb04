"""`FeatureCache`: computed features in a directory, bounded in size, shared by processes.

One file per sample, under the space it belongs to (`<root>/v1/<space id>/<ab>/<name>`):
a header (dtype, shape), the tensor's bytes and a checksum of both. A file is written to a
temporary name and renamed into place, so a writer killed mid-write leaves no entry, and
two writers of one entry leave one of their (equal) files. A read checks the checksum: a
corrupt entry is a miss, and is removed. A hit touches its file, so eviction - oldest
first, when the directory passes its bound - removes what was used least recently; an
entry evicted under a running epoch is a miss, never an error. Recent entries are also
kept decoded in memory, up to `memory_bytes`.

A cache is an optimization: a write that fails (a full disk, a read-only one, no
permission, a quota) turns writing off for this cache, with one warning and a count, and
it goes on serving what it holds; a job never fails for its cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import struct
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hapi.cache.space import FeatureSpace
from hapi.errors import InvalidRequest

__all__ = ["CacheStats", "FeatureCache", "SpaceUsage", "default_cache_root"]

log = logging.getLogger(__name__)

_MAGIC = b"HFC1"
_DIGEST = 16
_VERSION_DIR = "v1"
_TMP = "tmp"
_STALE_TMP_S = 3600.0
"""A temporary file this old was left by a writer that died (a live one renames in ms)."""

_DTYPES = {
    "float32": (torch.float32, np.float32),
    "float16": (torch.float16, np.float16),
    # bf16 has no numpy dtype: its bytes travel as int16's.
    "bfloat16": (torch.bfloat16, np.int16),
    "float64": (torch.float64, np.float64),
}


def default_cache_root() -> Path:
    """`$HAPI_CACHE_DIR/features`, or `~/.cache/hapi/features`."""
    base = os.environ.get("HAPI_CACHE_DIR") or Path.home() / ".cache" / "hapi"
    return Path(base) / "features"


@dataclass
class CacheStats:
    """What a cache did since it was opened (this process's view)."""

    hits: int = 0
    memory_hits: int = 0
    """Hits served from memory, without reading the file (included in `hits`)."""
    misses: int = 0
    writes: int = 0
    evictions: int = 0
    corrupt: int = 0
    """Entries that failed their checksum: counted as misses and removed."""
    bytes_held: int = 0
    """Bytes on disk, as this process last counted them."""
    write_failures: int = 0
    """Entries not written because the directory refused them (full, read-only, no
    permission): the first turned writing off (`FeatureCache.write_error`)."""


@dataclass(frozen=True)
class SpaceUsage:
    """One space of a cache directory, for `hapi cache ls`."""

    id: str
    entries: int
    bytes: int
    described: dict[str, Any]


class FeatureCache:
    """Features by (space, sample) in a directory bounded to `max_bytes`.

    Args:
        root: the directory (created); None: `default_cache_root()`.
        max_bytes: the bound on the entries' bytes: the least recently used go beyond it.
        memory_bytes: decoded entries kept in this process's memory, most recent first.

    Raises:
        InvalidRequest: a bound below 1 byte, or a root that is not a directory.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        max_bytes: int = 10 << 30,
        memory_bytes: int = 256 << 20,
    ) -> None:
        if max_bytes < 1 or memory_bytes < 0:
            raise InvalidRequest(
                f"cache_size must be >= 1 byte and memory >= 0, got {max_bytes} and {memory_bytes}"
            )
        self.root = Path(root) if root is not None else default_cache_root()
        if self.root.exists() and not self.root.is_dir():
            raise InvalidRequest(f"cache directory {self.root} is a file: pass a directory")
        self.max_bytes, self.memory_bytes = max_bytes, memory_bytes
        self.stats = CacheStats()
        self._lock = threading.Lock()
        self._memory: OrderedDict[tuple[str, str], torch.Tensor] = OrderedDict()
        self._memory_held = 0
        self._counted = False
        self._described: set[str] = set()
        self.write_error: str | None = None
        """Why writing is off (the first write the directory refused), or None."""
        try:
            (self.root / _VERSION_DIR / _TMP).mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a read-only directory still serves what it holds
            self._refused(exc)
        self._sweep_tmp()

    def __repr__(self) -> str:
        return f"FeatureCache({str(self.root)!r}, max_bytes={self.max_bytes})"

    @property
    def writing(self) -> bool:
        """Whether new entries are written (False once the directory refused one)."""
        return self.write_error is None

    def describe(self, space: FeatureSpace) -> None:
        """Write what the space is, once, for `hapi cache ls`."""
        if space.id in self._described or not self.writing:
            return
        path = self._space_dir(space.id) / "space.json"
        try:
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                self._atomic_write(path, json.dumps(space.describe(), indent=1).encode())
        except OSError as exc:
            self._refused(exc)
            return
        self._described.add(space.id)

    def get_many(self, space: FeatureSpace, names: Sequence[str]) -> list[torch.Tensor | None]:
        """Each entry's tensor, or None for a miss (absent, evicted, or corrupt)."""
        return [self.get(space, name) for name in names]

    def get(self, space: FeatureSpace, name: str) -> torch.Tensor | None:
        """The entry's tensor, or None for a miss."""
        sid = space.id
        with self._lock:
            tensor = self._memory.get((sid, name))
            if tensor is not None:
                self._memory.move_to_end((sid, name))
                self.stats.hits += 1
                self.stats.memory_hits += 1
                return tensor
        path = self._path(sid, name)
        try:
            data = path.read_bytes()
        except OSError:
            with self._lock:
                self.stats.misses += 1
            return None
        tensor = _decode(data)
        if tensor is None:
            with contextlib.suppress(OSError):
                path.unlink()
            with self._lock:
                self.stats.corrupt += 1
                self.stats.misses += 1
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used: the last to be evicted
        with self._lock:
            self.stats.hits += 1
            self._remember(sid, name, tensor)
        return tensor

    def put_many(
        self, space: FeatureSpace, names: Sequence[str], tensors: Sequence[torch.Tensor]
    ) -> None:
        """Store each tensor under its name (replacing an equal entry is harmless).

        Once the directory refused a write, entries are kept in memory only (within
        `memory_bytes`) and counted in `stats.write_failures`.
        """
        self.describe(space)
        added = 0
        for done, (name, tensor) in enumerate(zip(names, tensors, strict=True)):
            if not self.writing:
                self._keep_in_memory(space.id, names[done:], tensors[done:])
                break
            try:
                added += self._put(space.id, name, tensor)
            except OSError as exc:
                self._refused(exc)
                self._keep_in_memory(space.id, names[done:], tensors[done:])
                break
        if added:
            self._bound(added)

    def _keep_in_memory(
        self, sid: str, names: Sequence[str], tensors: Sequence[torch.Tensor]
    ) -> None:
        """What could not be written: counted, and kept in memory (it may yet hit)."""
        with self._lock:
            self.stats.write_failures += len(names)
            for name, tensor in zip(names, tensors, strict=True):
                self._remember(sid, name, tensor.detach().to("cpu"))

    def _refused(self, exc: OSError) -> None:
        """The directory refused a write: writing stops, with one warning."""
        with self._lock:
            if self.write_error is not None:
                return
            self.write_error = f"{type(exc).__name__}: {exc.strerror or exc}"
        log.warning(
            "feature cache %s refused a write (%s): it serves what it holds and writes "
            "nothing more; free space or pass a writable cache_dir",
            self.root,
            self.write_error,
        )

    def contains(self, space: FeatureSpace, name: str) -> bool:
        """Whether an entry exists (not checked: `get` checks)."""
        return (space.id, name) in self._memory or self._path(space.id, name).exists()

    def usage(self) -> list[SpaceUsage]:
        """Each space's entries and bytes."""
        spaces = []
        base = self.root / _VERSION_DIR
        if not base.is_dir():  # never created: a read-only place
            return []
        for directory in sorted(p for p in base.iterdir() if p.is_dir() and p.name != _TMP):
            files = [f for f in directory.glob("??/*") if f.is_file()]
            described: dict[str, Any] = {}
            with contextlib.suppress(OSError, ValueError):
                described = json.loads((directory / "space.json").read_text())
            spaces.append(
                SpaceUsage(
                    directory.name, len(files), sum(f.stat().st_size for f in files), described
                )
            )
        return spaces

    def clear(self, space_id: str | None = None) -> int:
        """Remove every entry (of one space); return the bytes freed."""
        freed = 0
        for usage in self.usage():
            if space_id is not None and usage.id != space_id:
                continue
            freed += usage.bytes
            directory = self._space_dir(usage.id)
            for f in directory.glob("??/*"):
                with contextlib.suppress(OSError):
                    f.unlink()
            for sub in directory.glob("??"):
                with contextlib.suppress(OSError):
                    sub.rmdir()
            with contextlib.suppress(OSError):
                (directory / "space.json").unlink()
                directory.rmdir()
        with self._lock:
            self._memory.clear()
            self._memory_held = 0
            self._counted = False
        return freed

    def _put(self, sid: str, name: str, tensor: torch.Tensor) -> int:
        tensor = tensor.detach().to("cpu").contiguous()
        path = self._path(sid, name)
        if path.exists():
            with self._lock:
                self._remember(sid, name, tensor)
            return 0
        data = _encode(tensor)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._atomic_write(path, data)
        with self._lock:
            self.stats.writes += 1
            self._remember(sid, name, tensor)
        return len(data)

    def _atomic_write(self, path: Path, data: bytes) -> None:
        tmp = self.root / _VERSION_DIR / _TMP / f"{uuid.uuid4().hex}.part"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise

    def _bound(self, added: int) -> None:
        """Evict the least recently used entries once the directory passes its bound,
        down to 90% of it (so eviction's scan runs once per tenth of the bound)."""
        with self._lock:
            if not self._counted:
                self.stats.bytes_held = sum(size for _, size, _ in self._entries())
                self._counted = True
            else:
                self.stats.bytes_held += added
            if self.stats.bytes_held <= self.max_bytes:
                return
            entries = sorted(self._entries(), key=lambda e: e[2])
            held = sum(size for _, size, _ in entries)
            target = int(0.9 * self.max_bytes)
            for path, size, _ in entries:
                if held <= target:
                    break
                with contextlib.suppress(OSError):
                    path.unlink()
                    held -= size
                    self.stats.evictions += 1
                    sid, name = path.parent.parent.name, path.name
                    dropped = self._memory.pop((sid, name), None)
                    if dropped is not None:
                        self._memory_held -= _nbytes(dropped)
            self.stats.bytes_held = held

    def _entries(self) -> list[tuple[Path, int, float]]:
        found = []
        for path in (self.root / _VERSION_DIR).glob("*/??/*"):
            with contextlib.suppress(OSError):
                st = path.stat()
                found.append((path, st.st_size, st.st_mtime))
        return found

    def _remember(self, sid: str, name: str, tensor: torch.Tensor) -> None:
        """Keep a decoded entry in memory (under the lock)."""
        size = _nbytes(tensor)
        if size > self.memory_bytes or (sid, name) in self._memory:
            return
        # A copy: the row may be a view of its whole batch, which it would keep alive.
        self._memory[(sid, name)] = tensor.clone()
        self._memory_held += size
        while self._memory_held > self.memory_bytes:
            _, old = self._memory.popitem(last=False)
            self._memory_held -= _nbytes(old)

    def _sweep_tmp(self) -> None:
        """Remove what writers that died left (a live writer renames within moments)."""
        now = time.time()
        for tmp in (self.root / _VERSION_DIR / _TMP).glob("*.part"):
            with contextlib.suppress(OSError):
                if now - tmp.stat().st_mtime > _STALE_TMP_S:
                    tmp.unlink()

    def _space_dir(self, sid: str) -> Path:
        return self.root / _VERSION_DIR / sid

    def _path(self, sid: str, name: str) -> Path:
        return self._space_dir(sid) / name[:2] / name


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _encode(tensor: torch.Tensor) -> bytes:
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise InvalidRequest(f"a cached feature must be floating point, got {tensor.dtype}")
    header = json.dumps({"dtype": dtype, "shape": list(tensor.shape)}).encode()
    view = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
    payload = view.numpy().tobytes()
    body = _MAGIC + struct.pack("<I", len(header)) + header + payload
    return body + hashlib.blake2b(body, digest_size=_DIGEST).digest()


def _decode(data: bytes) -> torch.Tensor | None:
    """The entry's tensor, or None if it is not a whole, intact entry."""
    if len(data) < len(_MAGIC) + 4 + _DIGEST or not data.startswith(_MAGIC):
        return None
    body, digest = data[:-_DIGEST], data[-_DIGEST:]
    if hashlib.blake2b(body, digest_size=_DIGEST).digest() != digest:
        return None
    try:
        (length,) = struct.unpack_from("<I", body, len(_MAGIC))
        start = len(_MAGIC) + 4
        header = json.loads(body[start : start + length])
        dtype, np_dtype = _DTYPES[header["dtype"]]
        shape = tuple(int(n) for n in header["shape"])
        payload = body[start + length :]
        array = np.frombuffer(bytearray(payload), dtype=np_dtype).reshape(shape)
    except (ValueError, KeyError, TypeError, struct.error):
        return None
    tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if dtype == torch.bfloat16 else tensor
