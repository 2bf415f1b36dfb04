"""Garbage collection: delete the blobs no manifest references.

The referenced set comes from the store's own manifests (one that cannot be read stops
the gc), and the gc runs only while it holds the gc lock and no live push lock exists
(`locks.py`). Unnamed manifests older than the lock TTL, the markers of deleted blobs and,
on a local directory store, staging files of writes cut short go too. Why this is safe:
docs/repository.md, "Garbage collection".
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from hapi.data.store import ObjectStore
from hapi.data.store.partial import sweep_partial
from hapi.errors import ObjectNotFound
from hapi.repo.index.sync import fetch_manifests
from hapi.repo.storage.layout import (
    DELTAS,
    LOCKS,
    MANIFESTS,
    REFS,
    TENSORS,
    delta_key,
    hash_of_tensor_key,
    id_of_manifest_key,
    manifest_key,
    parse_ref_key,
)
from hapi.repo.storage.locks import Locks
from hapi.repo.storage.manifest import VersionManifest
from hapi.repo.storage.markers import read_markers, with_bases

__all__ = ["GcReport", "collect_garbage"]


@dataclass(frozen=True, kw_only=True)
class GcReport:
    """What a gc found and did."""

    skipped: bool = False
    """True when pushes were running, so nothing was deleted."""
    reason: str = ""
    """Why it was skipped."""
    dry_run: bool = False
    """True when nothing was deleted on purpose."""
    manifests: int = 0
    """Manifests kept."""
    blobs: int = 0
    """Blobs found."""
    removed_blobs: int = 0
    """Blobs no manifest references (deleted unless dry run)."""
    removed_bytes: int = 0
    """Their size in bytes."""
    removed_manifests: int = 0
    """Unnamed manifests left by interrupted pushes."""
    removed_locks: int = 0
    """Stale locks of dead processes."""
    removed_partial: int = 0
    """Staging files of writes cut short (local directory stores only; no listing shows
    them)."""


def collect_garbage(
    store: ObjectStore,
    locks: Locks,
    *,
    dry_run: bool = False,
    partial_age_s: float | None = None,
) -> GcReport:
    """Delete unreferenced blobs, abandoned manifests and the staging files of killed
    writes, unless pushes are running.

    Args:
        store: the repository's store.
        locks: its locks.
        dry_run: count, delete nothing.
        partial_age_s: how long a staging file must have gone unwritten to be removed;
            None: the lock TTL.

    Raises:
        IntegrityError: a manifest cannot be read; nothing is deleted.
    """
    held, pushes = locks.try_acquire_gc()
    if held is None:
        owners = ", ".join(sorted({p.owner for p in pushes}))
        return GcReport(skipped=True, reason=f"{len(pushes)} push(es) running ({owners})")
    try:
        removed_locks = 0 if dry_run else locks.remove_stale(keep=held.key)
        kept, abandoned = _kept_and_abandoned(store, locks)
        markers = read_markers(store)
        referenced = with_bases(set().union(*(m.hashes for m in kept)), markers)
        blobs = [(k, h) for k in store.list(TENSORS) if (h := hash_of_tensor_key(k)) is not None]
        garbage = [k for k, h in blobs if h not in referenced]
        stored = {h for _, h in blobs} - {hash_of_tensor_key(k) for k in garbage}
        # Markers of deleted blobs, and of blobs a dead push never wrote.
        stale_markers = [
            delta_key(h, b) for h, bases in markers.items() if h not in stored for b in bases
        ]
        removed_bytes = _delete_blobs(store, garbage, dry_run=dry_run)
        if not dry_run:
            for key in stale_markers:
                store.delete(key)
            for m in abandoned:
                store.delete(manifest_key(m.id))
        removed_partial = _sweep_staging(store, locks, partial_age_s, dry_run=dry_run)
        return GcReport(
            dry_run=dry_run,
            manifests=len(kept),
            blobs=len(blobs),
            removed_blobs=len(garbage),
            removed_bytes=removed_bytes,
            removed_manifests=len(abandoned),
            removed_locks=removed_locks,
            removed_partial=removed_partial,
        )
    finally:
        held.release()


def _kept_and_abandoned(
    store: ObjectStore, locks: Locks
) -> tuple[list[VersionManifest], list[VersionManifest]]:
    """The store's manifests a ref names or that are younger than the lock TTL, and the
    rest: those left unnamed by pushes that died between the manifest and the ref."""
    ids = {i for k in store.list(MANIFESTS) if (i := id_of_manifest_key(k))}
    manifests = fetch_manifests(store, ids)
    named = _named_ids(store)
    now = locks.clock()
    abandoned = [
        m for m in manifests if m.id not in named and now - _timestamp(m.created) >= locks.ttl_s
    ]
    dropped = {m.id for m in abandoned}
    return [m for m in manifests if m.id not in dropped], abandoned


def _delete_blobs(store: ObjectStore, garbage: list[str], *, dry_run: bool) -> int:
    """Delete the blobs at `garbage` (unless `dry_run`); the bytes they held."""
    removed_bytes = 0
    for key in garbage:
        try:
            removed_bytes += store.size(key)
        except ObjectNotFound:
            continue
        if not dry_run:
            store.delete(key)
    return removed_bytes


def _sweep_staging(
    store: ObjectStore, locks: Locks, partial_age_s: float | None, *, dry_run: bool
) -> int:
    """Remove the staging files of writes cut short; how many there were."""
    # Aged by the lock TTL by default. Pushes that start now wait for this gc before
    # writing blobs, but their own lock may be being written, and a push whose lock
    # was ignored as older than the TTL may only be paused: a staging file written
    # within the TTL may yet be renamed into place. The TTL also exceeds the clock
    # skew of machines sharing a network directory (whose server stamps the mtime).
    age = locks.ttl_s if partial_age_s is None else partial_age_s
    return sum(
        sweep_partial(store, prefix, older_than_s=age, dry_run=dry_run)
        for prefix in (TENSORS, DELTAS, MANIFESTS, REFS, LOCKS)
    )


def _named_ids(store: ObjectStore) -> set[str]:
    keys = [k for k in store.list(REFS) if parse_ref_key(k)]
    named = set()
    for data in store.get_many(keys):
        if isinstance(data, BaseException):
            # Ref objects are never deleted, so any failure means the ids are unknown.
            raise data
        named.add(data.decode().strip())
    return named


def _timestamp(created: str) -> float:
    try:
        return datetime.fromisoformat(created).astimezone(UTC).timestamp()
    except ValueError:
        return 0.0
