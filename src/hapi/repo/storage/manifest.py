"""`VersionManifest`: one immutable model version, named by its own digest.

The JSON written to the store is the source of truth for everything the catalog knows.
Its id is the SHA-256 of the canonical JSON (sorted keys, no spaces, ASCII) of every field
but the id, so a manifest cannot be altered without changing its name, and a reader can
check any manifest it fetches.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from hapi.errors import IntegrityError
from hapi.repo.storage._fields import check_tensor_key, digest, mapping, optional, required, strings
from hapi.repo.storage.modules import ModuleEntry
from hapi.repo.storage.refs import check_name

__all__ = ["FORMAT", "TensorEntry", "VersionManifest"]

FORMAT = "hapi.repo.manifest/1"


@dataclass(frozen=True, kw_only=True)
class TensorEntry:
    """One state-dict entry: which blob holds it, and what it is."""

    hash: str
    """Content hash of the tensor (see `tensors.tensor_hash`)."""
    dtype: str
    """`float32`, `int64`, ..."""
    shape: tuple[int, ...]
    """The tensor's shape."""
    nbytes: int
    """Raw size in bytes."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "hash": self.hash,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": self.nbytes,
        }

    @classmethod
    def from_dict(cls, data: Any, what: str = "a tensor entry") -> TensorEntry:
        """Read a stored entry, checking every field (see `_fields`).

        Raises:
            ValueError: a field is missing or of the wrong type or form.
        """
        data = mapping(data, what)
        shape = required(data, "shape", list, what)
        nbytes = required(data, "nbytes", int, what)
        if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape):
            raise ValueError(
                f"the shape of {what} must be non-negative integers, got {shape!r:.60}"
            )
        if nbytes < 0:
            raise ValueError(f"the nbytes of {what} must not be negative, got {nbytes}")
        return cls(
            hash=digest(data.get("hash"), f"the hash of {what}"),
            dtype=required(data, "dtype", str, what),
            shape=tuple(shape),
            nbytes=nbytes,
        )


@dataclass(frozen=True, kw_only=True)
class VersionManifest:
    """A model version: its tensors, its module tree, its provenance."""

    name: str
    """The model name it was pushed under."""
    parent: str | None
    """The id of the version it was derived from."""
    created: str
    """ISO-8601 UTC time of the push."""
    tags: tuple[str, ...] = ()
    """Free-form labels (sorted)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Numbers the pusher reports (accuracy, loss)."""
    spec: dict[str, Any] | None = None
    """A `hapi.graph.ModelSpec` dict that builds the architecture, when the pusher gave one."""
    modules: tuple[ModuleEntry, ...] = ()
    """The module tree; empty when a bare state dict was pushed."""
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    """Every state-dict entry, by key."""

    @cached_property
    def id(self) -> str:
        """The manifest's digest: its name in the store."""
        return _digest(self.body())

    @property
    def nbytes(self) -> int:
        """Raw bytes of the model's state dict (shared entries counted once per key)."""
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def hashes(self) -> set[str]:
        """The content hashes of every tensor this version references."""
        return {t.hash for t in self.tensors.values()}

    @property
    def layers(self) -> tuple[ModuleEntry, ...]:
        """The modules that are layers, in order."""
        return tuple(m for m in self.modules if m.layer is not None)

    def body(self) -> dict[str, Any]:
        """Every field but the id, as JSON values."""
        return {
            "format": FORMAT,
            "name": self.name,
            "parent": self.parent,
            "created": self.created,
            "tags": sorted(self.tags),
            "metrics": dict(self.metrics),
            "spec": self.spec,
            "modules": [m.to_dict() for m in self.modules],
            # A list, not an object: it keeps the state dict's order through sorted JSON.
            "tensors": [{"key": k, **t.to_dict()} for k, t in self.tensors.items()],
        }

    def to_json(self) -> bytes:
        """The stored form: the body plus its id, sorted and indented for people to read."""
        return json.dumps({**self.body(), "id": self.id}, sort_keys=True, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes | str, expect_id: str | None = None) -> VersionManifest:
        """Parse a stored manifest and check its digest.

        Args:
            data: the stored JSON.
            expect_id: the id it is stored under, when known.

        Raises:
            IntegrityError: the JSON is malformed, of an unknown format, or its digest differs
                from its recorded id (or from `expect_id`).
        """
        label = expect_id[:12] if expect_id else "?"
        try:
            raw = mapping(json.loads(data), "the manifest")
            if raw.get("format") != FORMAT:
                raise ValueError(f"unknown format {raw.get('format')!r:.60}, expected {FORMAT!r}")
            manifest = cls._from_raw(raw)
        # RecursionError: JSON nested deeper than the parser's stack.
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise IntegrityError(f"manifest {label} is malformed: {exc}") from exc
        actual = manifest.id
        for claimed in (raw.get("id"), expect_id):
            if claimed is not None and claimed != actual:
                raise IntegrityError(
                    f"manifest {label} is corrupt: its content hashes to {actual[:12]}, "
                    f"not {claimed[:12]}"
                )
        return manifest

    @classmethod
    def _from_raw(cls, raw: Mapping[str, Any]) -> VersionManifest:
        """The manifest a parsed JSON object holds, every field checked (see `_fields`)."""
        what = "the manifest"
        parent = raw.get("parent")
        metrics = optional(raw, "metrics", dict, what, default={})
        for k, v in metrics.items():
            if not isinstance(v, int | float) or isinstance(v, bool):
                raise ValueError(f"metric {k!r:.60} must be a number, got {v!r:.60}")
        tensors: dict[str, TensorEntry] = {}
        for i, t in enumerate(required(raw, "tensors", list, what)):
            entry = mapping(t, f"tensor entry {i}")
            key = check_tensor_key(entry.get("key"))
            if key in tensors:
                raise ValueError(f"tensor key {key!r:.60} appears twice")
            tensors[key] = TensorEntry.from_dict(entry, f"tensor {key!r:.60}")
        return cls(
            name=check_name(required(raw, "name", str, what)),
            parent=None if parent is None else digest(parent, "the manifest's parent"),
            created=required(raw, "created", str, what),
            tags=strings(optional(raw, "tags", list, what, default=[]), "the manifest's tags"),
            metrics=dict(metrics),
            spec=optional(raw, "spec", dict, what),
            modules=tuple(
                ModuleEntry.from_dict(mapping(m, f"module entry {i}"))
                for i, m in enumerate(optional(raw, "modules", list, what, default=[]))
            ),
            tensors=tensors,
        )


def _digest(body: dict[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()
