"""Heads that trainers uploaded: kept on the server's disk by digest, loaded on demand.

The artifacts stay out of the memory budget (a loaded head's tensors are in it, in the
head cache); the directory holds at most `keep_bytes`, least recently used first out, and
a client whose head went asks `has_head` and uploads it again. Nothing here runs the user's
Python or unpickles anything. More: docs/server.md, "Heads that trainers uploaded".
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import torch
from torch import fx, nn

from hapi.errors import InvalidRequest, UnknownModel
from hapi.graph import ModelGraph
from hapi.graph.cut_point import CutPoint
from hapi.graph.export import HeadArtifact
from hapi.wire.heads import HeadReceiver

__all__ = ["MAX_HEAD_BYTES", "HeadUploads", "head_graph", "on_device"]

MAX_HEAD_BYTES = 2 << 30
"""The largest artifact a server accepts by default: a ViT-L/16 head in fp32 fits."""
KEEP_FACTOR = 4
"""The directory keeps up to this many largest artifacts' bytes by default."""
RECEIVING = 2
"""Uploads assembled at once: each holds up to `max_bytes` in memory until its digest is
checked, so this bounds what uploads take outside the memory budget."""
PREFIX = "hapi-heads-"
"""A temporary directory's name: this, the owning process's pid (for a person reading
/tmp; `LOCK` tells whether the owner lives), a dash, random letters."""
LOCK = ".owner.lock"
"""A file in a temporary directory that its owner holds locked while it lives: the kernel
releases the lock when the process ends, however it ends, so a free lock means the
directory is an orphan - in any pid namespace, and whatever process now has the pid."""


@dataclass(frozen=True)
class _Stored:
    path: Path
    nbytes: int


class HeadUploads:
    """The uploaded heads a server holds, by digest.

    Args:
        max_bytes: the largest artifact accepted; a larger upload is refused as it arrives.
        keep_bytes: bytes of artifacts kept on disk; None: `KEEP_FACTOR * max_bytes`.
        root: where to keep them; None: a temporary directory removed by `close`, or at
            the process's exit, or by the next server on this machine when the process
            was killed.
    """

    def __init__(
        self,
        max_bytes: int = MAX_HEAD_BYTES,
        *,
        keep_bytes: int | None = None,
        root: str | Path | None = None,
    ) -> None:
        if max_bytes < 1:
            raise InvalidRequest(f"the head upload limit must be >= 1 byte, got {max_bytes}")
        self.max_bytes = max_bytes
        self.keep_bytes = keep_bytes if keep_bytes is not None else KEEP_FACTOR * max_bytes
        # Removes a temporary directory of this object's: at `close`, or at the
        # interpreter's end for a server whose shutdown did not finish (a stream held it
        # past the CLI's wait).
        self._remove: weakref.finalize | None = None
        if root is None:
            _remove_orphans(Path(tempfile.gettempdir()))
            self.root = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-"))
            owner = os.open(self.root / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(owner, fcntl.LOCK_EX)
            self._remove = weakref.finalize(self, _remove, self.root, owner)
        else:
            self.root = Path(root)
            self.root.mkdir(parents=True, exist_ok=True)
        self._stored: OrderedDict[str, _Stored] = OrderedDict()
        self._lock = threading.Lock()
        self._receiving = threading.BoundedSemaphore(RECEIVING)

    def has(self, digest: str) -> bool:
        """Whether the head with `digest` is here (a later upload of it is not needed)."""
        with self._lock:
            if digest in self._stored:
                self._stored.move_to_end(digest)
                return True
            return False

    def size(self, digest: str) -> int:
        """Bytes of the artifact with `digest` (program and weights); 0 when it is not here."""
        with self._lock:
            stored = self._stored.get(digest)
            return stored.nbytes if stored is not None else 0

    def receive(self, digest: str, schema: pa.Schema, batches: Iterable[pa.RecordBatch]) -> bool:
        """Take an upload of the head with `digest`; False when it was here already.

        Raises:
            InvalidRequest: not a head upload, or larger than `max_bytes`.
            IntegrityError: the content does not match `digest`.
        """
        receiver = HeadReceiver(digest, schema, self.max_bytes)
        with self._receiving:
            for batch in batches:
                receiver.add(batch)
            artifact = receiver.artifact()  # checks the digest
        if self.has(digest):
            return False
        self._write(artifact)
        return True

    def get(self, digest: str) -> HeadArtifact:
        """The artifact with `digest`, read from disk and checked against its digest.

        Raises:
            UnknownModel: no such head here (never uploaded, or dropped to make room).
        """
        with self._lock:
            stored = self._stored.get(digest)
            if stored is not None:
                self._stored.move_to_end(digest)
        if stored is None:
            raise UnknownModel(
                f"no uploaded head {digest[:12]}... on this server (never uploaded, dropped to "
                "make room, or the server restarted): upload it again (TransferJob does)"
            )
        meta = json.loads((stored.path / "meta.json").read_text())
        return HeadArtifact(
            program=(stored.path / "program.json").read_bytes(),
            weights=(stored.path / "weights.safetensors").read_bytes(),
            input_shape=tuple(meta["input_shape"]),
            digest=digest,
        )

    @property
    def nbytes(self) -> int:
        """Bytes of the artifacts kept."""
        with self._lock:
            return sum(s.nbytes for s in self._stored.values())

    def close(self) -> None:
        """Remove the directory, when it is a temporary one of this object's."""
        with self._lock:
            self._stored.clear()
        if self._remove is not None:
            self._remove()

    def _write(self, artifact: HeadArtifact) -> None:
        # Written under a temporary name and renamed, so a reader never sees half of it.
        tmp = Path(tempfile.mkdtemp(prefix=".incoming-", dir=self.root))
        (tmp / "program.json").write_bytes(artifact.program)
        (tmp / "weights.safetensors").write_bytes(artifact.weights)
        (tmp / "meta.json").write_text(json.dumps({"input_shape": list(artifact.input_shape)}))
        path = self.root / artifact.digest
        nbytes = len(artifact.program) + len(artifact.weights)
        with self._lock:
            if artifact.digest in self._stored:  # another upload of it finished first
                shutil.rmtree(tmp, ignore_errors=True)
                return
            shutil.rmtree(path, ignore_errors=True)
            tmp.rename(path)
            self._stored[artifact.digest] = _Stored(path, nbytes)
            dropped = self._trim()
        for old in dropped:
            shutil.rmtree(old, ignore_errors=True)

    def _trim(self) -> list[Path]:
        """Forget the oldest artifacts beyond `keep_bytes` (the lock held); the newest stays."""
        total = sum(s.nbytes for s in self._stored.values())
        dropped: list[Path] = []
        while total > self.keep_bytes and len(self._stored) > 1:
            _, old = self._stored.popitem(last=False)
            total -= old.nbytes
            dropped.append(old.path)
        return dropped


def _remove(root: Path, owner: int) -> None:
    shutil.rmtree(root, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.close(owner)  # releases the lock, after the directory went


def _remove_orphans(tmp: Path) -> None:
    """Remove the temporary directories whose owner has ended: one killed (SIGKILL, or
    the machine's out-of-memory killer) runs no cleanup of its own. A directory without
    the lock file (made before it existed) is left alone."""
    for path in tmp.glob(f"{PREFIX}*"):
        try:
            fd = os.open(path / LOCK, os.O_RDWR)
        except OSError:
            continue  # no lock file, not ours to read, or gone meanwhile
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # held: its owner lives
        finally:
            os.close(fd)
        shutil.rmtree(path, ignore_errors=True)


def head_graph(head: nn.Module, input_shape: tuple[int, ...], shape: tuple[int, ...]) -> ModelGraph:
    """An uploaded head as a model whose one cut point is its output (the server knows no
    other), for what sizes a session's memory from a graph. Without an output `shape` it
    has no cut point: what a session at RAW or INPUT runs (`head` is then an identity)."""
    params = sum(p.numel() for p in head.parameters())
    points = (CutPoint(1, "head", shape, params_before=params),) if shape else ()
    return ModelGraph(
        head,
        tuple(input_shape),
        points,
        traced=False,
        fallback_reason="an uploaded head: the server runs its program, and its output is "
        "the only cut point it knows",
    )


def on_device(head: fx.GraphModule, device: torch.device) -> fx.GraphModule:
    """`head` running on `device`: its tensors moved, and the device its operators were
    exported with (`aten.arange(..., device=cpu)` on a trainer's CPU) replaced by this
    server's, so a head exported on one device runs on another."""
    changed = False
    for node in head.graph.nodes:
        if node.op == "call_function" and isinstance(node.kwargs.get("device"), torch.device):
            node.kwargs = {**node.kwargs, "device": device}
            changed = True
    if changed:
        head.recompile()
    return head.to(device)
