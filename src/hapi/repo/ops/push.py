"""Pushing a model: upload the blobs the store lacks, then the manifest, then the ref.

The order makes a push safe to interrupt: a push cut short leaves at most unreferenced
blobs and an unnamed manifest, which `gc` removes. `PushTransaction` runs the steps one
at a time so tests can interleave other operations; `ModelRepo.push` runs them back to
back. More: docs/repository.md, "Pushing a model".
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

import torch
from torch import nn

from hapi.data.store import ObjectStore
from hapi.errors import InvalidRequest
from hapi.repo.index.version import PushedVersion
from hapi.repo.storage._fields import check_tensor_key
from hapi.repo.storage.encoder import PLAIN_ENCODER, BlobEncoder
from hapi.repo.storage.epoch import mark_changed, mark_epoch
from hapi.repo.storage.layout import (
    REFS,
    delta_key,
    manifest_key,
    parse_ref_key,
    ref_key,
    tensor_key,
)
from hapi.repo.storage.locks import HeldLock, Locks
from hapi.repo.storage.manifest import TensorEntry, VersionManifest
from hapi.repo.storage.modules import describe_modules
from hapi.repo.storage.tensors import dtype_name, tensor_hash

__all__ = ["PushTransaction", "build_manifest"]


def build_manifest(
    model: nn.Module | Mapping[str, torch.Tensor],
    *,
    name: str,
    parent: str | None,
    tags: tuple[str, ...] = (),
    metrics: Mapping[str, float] | None = None,
    spec: dict[str, Any] | None = None,
) -> tuple[VersionManifest, dict[str, torch.Tensor]]:
    """The manifest of `model` and its distinct tensors by content hash.

    Raises:
        InvalidRequest: a state-dict value that is not a tensor, or has no data (meta).
    """
    if isinstance(model, nn.Module):
        state = model.state_dict()
        modules = describe_modules(model)
    elif isinstance(model, Mapping):
        state, modules = dict(model), ()
    else:
        raise InvalidRequest(f"push takes an nn.Module or a state dict, got {type(model).__name__}")
    tensors: dict[str, TensorEntry] = {}
    blobs: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        try:
            check_tensor_key(key)
        except ValueError as exc:
            # Refused here, or the manifest written would be one no reader accepts.
            raise InvalidRequest(str(exc)) from None
        if not isinstance(value, torch.Tensor):
            raise InvalidRequest(
                f"state-dict entry {key!r} is a {type(value).__name__}, not a tensor"
            )
        if value.is_meta:
            raise InvalidRequest(f"state-dict entry {key!r} is on the meta device: it has no data")
        digest = tensor_hash(value)
        blobs.setdefault(digest, value)
        tensors[key] = TensorEntry(
            hash=digest,
            dtype=dtype_name(value),
            shape=tuple(value.shape),
            nbytes=value.numel() * value.element_size(),
        )
    clean_metrics: dict[str, float] = {}
    for k, v in (metrics or {}).items():
        try:
            clean_metrics[str(k)] = float(v)
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(f"metric {k!r} must be a number, got {v!r}") from exc
    manifest = VersionManifest(
        name=name,
        parent=parent,
        created=datetime.now(UTC).isoformat(timespec="microseconds"),
        tags=tuple(sorted(set(tags))),
        metrics=clean_metrics,
        spec=spec,
        modules=modules,
        tensors=tensors,
    )
    return manifest, blobs


class PushTransaction:
    """One push, step by step: `begin`, `upload` (until it returns 0), `commit`."""

    def __init__(
        self,
        store: ObjectStore,
        locks: Locks,
        manifest: VersionManifest,
        blobs: dict[str, torch.Tensor],
        *,
        concurrency: int = 16,
        encoder: BlobEncoder = PLAIN_ENCODER,
    ) -> None:
        self.store = store
        self.encoder = encoder
        self.locks = locks
        self.manifest = manifest
        self.blobs = blobs
        self.concurrency = concurrency
        self.lock: HeldLock | None = None
        self.missing: list[str] = []
        self.uploaded_tensors = 0
        self.markers: list[str] = []
        self.uploaded_bytes = 0
        self.unique_bytes = sum(t.numel() * t.element_size() for t in blobs.values())
        self._started = time.perf_counter()

    def begin(self) -> None:
        """Take the push lock and find the blobs the store lacks."""
        self.lock = self.locks.acquire_push()
        mark_epoch(self.store)
        self.missing = self._find_missing(list(self.blobs))

    def upload(self, limit: int | None = None) -> int:
        """Upload up to `limit` missing blobs (all by default); return how many remain."""
        lock = self._held()
        batch = self.missing if limit is None else self.missing[:limit]
        with ThreadPoolExecutor(min(self.concurrency, max(len(batch), 1))) as pool:
            for wrote, size in pool.map(self._put_blob, batch):
                if wrote:
                    self.uploaded_tensors += 1
                    self.uploaded_bytes += size
                lock.refresh()
        self.missing = self.missing[len(batch) :]
        return len(self.missing)

    def commit(self) -> PushedVersion:
        """Write the manifest and allocate the next version number of its name."""
        lock = self._held()
        if self.missing:
            self.upload()
        if lock.lapsed or lock.expired:
            # Paused past the TTL: a gc may have run meanwhile. Wait for it, re-check.
            lock.release()
            self.lock = lock = self.locks.acquire_push()
            # A gc may have dropped our delta markers with the blobs; blobs it kept need
            # theirs back before the manifest makes them referenced.
            for key in self.markers:
                self.store.put(key, b"")
            self.missing = self._find_missing(list(self.blobs))
            self.upload()
        manifest = self.manifest
        self.store.put_if_absent(manifest_key(manifest.id), manifest.to_json())
        version = self._allocate_version()
        mark_changed(self.store)
        self.release()
        return PushedVersion(
            id=manifest.id,
            name=manifest.name,
            version=version,
            parent=manifest.parent,
            created=manifest.created,
            tags=manifest.tags,
            metrics=dict(manifest.metrics),
            tensors=len(manifest.tensors),
            nbytes=manifest.nbytes,
            uploaded_tensors=self.uploaded_tensors,
            uploaded_bytes=self.uploaded_bytes,
            unique_bytes=self.unique_bytes,
            seconds=time.perf_counter() - self._started,
        )

    def release(self) -> None:
        """Give up the lock (after a commit, or to abandon the push)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def _held(self) -> HeldLock:
        if self.lock is None:
            raise InvalidRequest("push step out of order: call begin() first")
        return self.lock

    def _find_missing(self, digests: list[str]) -> list[str]:
        with ThreadPoolExecutor(min(self.concurrency, max(len(digests), 1))) as pool:
            present = list(pool.map(lambda d: self.store.exists(tensor_key(d)), digests))
        return [d for d, p in zip(digests, present, strict=True) if not p]

    def _put_blob(self, digest: str) -> tuple[bool, int]:
        blob = self.encoder.encode(digest, self.blobs[digest])
        if blob.base is not None:
            # Before the blob: a push killed between the two leaves a marker gc drops.
            marker = delta_key(digest, blob.base)
            self.store.put(marker, b"")
            self.markers.append(marker)
        return self.store.put_if_absent(tensor_key(digest), blob.data), len(blob.data)

    def _allocate_version(self) -> int:
        name = self.manifest.name
        taken = [
            r[1]
            for k in self.store.list(f"{REFS}/{name}")
            if (r := parse_ref_key(k)) and r[0] == name
        ]
        version = max(taken, default=0) + 1
        # Create-only writes: of two concurrent pushes, each gets its own number.
        while not self.store.put_if_absent(ref_key(name, version), self.manifest.id.encode()):
            version += 1
        return version
