"""Bringing the catalog up to date from the store, which is the source of truth.

Manifests and ref objects never change once written (a removed version loses its manifest,
never its ref object), so a sync fetches only what the catalog has not seen: one listing of
each prefix, plus a read per new object. Only a wipe of the store breaks that promise; the
store's epoch (`epoch.py`, one more read) and a ref the catalog knows but the store lacks
tell such a catalog, which is then rebuilt. That keeps several processes, each with its own
catalog, in step with each other's pushes at the cost of a listing.
"""

from __future__ import annotations

import logging
import time

from hapi.data.store import ObjectStore
from hapi.errors import IntegrityError, ObjectNotFound
from hapi.repo.index.catalog import Catalog
from hapi.repo.storage.epoch import read_changes, read_epoch
from hapi.repo.storage.layout import (
    MANIFESTS,
    REFS,
    id_of_manifest_key,
    manifest_key,
    parse_ref_key,
    ref_key,
)
from hapi.repo.storage.manifest import VersionManifest

__all__ = [
    "fetch_manifests",
    "forget_manifest",
    "sync_all",
    "sync_changed",
    "sync_name",
]

log = logging.getLogger("hapi.repo")


def fetch_manifests(
    store: ObjectStore, ids: set[str] | list[str], *, skip_corrupt: bool = False
) -> list[VersionManifest]:
    """Read and check manifests; skip the ones gone since they were listed.

    Args:
        store: where they are.
        ids: their ids.
        skip_corrupt: log and skip a corrupt manifest instead of raising.

    Raises:
        IntegrityError: a manifest is corrupt (unless `skip_corrupt`).
    """
    ids = sorted(ids)
    found: list[VersionManifest] = []
    for mid, data in zip(ids, store.get_many(manifest_key(i) for i in ids), strict=True):
        if isinstance(data, ObjectNotFound):
            continue
        if isinstance(data, BaseException):
            raise data
        try:
            found.append(VersionManifest.from_json(data, mid))
        except IntegrityError as exc:
            if not skip_corrupt:
                raise
            # A listing must not fail for one bad manifest; `gc` and `pull` refuse it loudly.
            log.warning("skipping manifest %s: %s", mid[:12], exc)
    return found


def sync_all(store: ObjectStore, catalog: Catalog) -> None:
    """Make the catalog match every manifest and ref object in the store, rebuilding it when
    it was built from another incarnation of the repository."""
    # The token before the listing: a change after this read rewrites it, so the next
    # sync_changed sees a token other than the one recorded and lists again.
    changes = read_changes(store)
    _sync_all(store, catalog, read_epoch(store))
    if changes is not None:
        catalog.set_mark(changes, time.time())


def sync_changed(store: ObjectStore, catalog: Catalog, relist_s: float) -> None:
    """`sync_all`, unless the store's change token is the one read before the catalog's
    last listing and that listing is younger than `relist_s` (one read instead of a
    listing of every ref)."""
    changes, synced = catalog.mark()
    if changes is not None and time.time() - synced < relist_s and read_changes(store) == changes:
        return
    sync_all(store, catalog)


def sync_name(store: ObjectStore, catalog: Catalog, name: str) -> None:
    """Fetch the versions of `name` the catalog has not seen yet (or sync everything, when
    the catalog turns out to be of another incarnation of the repository)."""
    epoch = read_epoch(store)
    refs = {r for k in store.list(f"{REFS}/{name}") if (r := parse_ref_key(k)) and r[0] == name}
    if epoch != catalog.epoch() or not catalog.ref_keys(name) <= refs:
        _sync_all(store, catalog, epoch)
        return
    rows = _read_refs(store, refs - catalog.ref_keys(name))
    if not rows:
        return  # nothing new: spare the catalog's list of every manifest id
    missing = {mid for _, _, mid in rows} - catalog.manifest_ids()
    catalog.add_manifests(fetch_manifests(store, missing, skip_corrupt=True))
    catalog.set_refs(rows)


def forget_manifest(store: ObjectStore, catalog: Catalog, manifest_id: str) -> None:
    """Drop a manifest the catalog has and the store lacks: removed by another process, or
    the catalog is of an earlier repository at the same place (then it is rebuilt)."""
    if _refs_moved(store, catalog, {manifest_id}):
        _rebuild(store, catalog, read_epoch(store))
    else:
        catalog.remove_manifests([manifest_id])


def _sync_all(store: ObjectStore, catalog: Catalog, epoch: str | None) -> None:
    # Refs before manifests: a push writes its manifest before its ref, so the manifest of
    # every ref listed here is in the manifest listing that follows (unless removed).
    refs = {r for k in store.list(REFS) if (r := parse_ref_key(k))}
    in_store = {i for k in store.list(MANIFESTS) if (i := id_of_manifest_key(k))}
    known_refs = catalog.ref_keys()
    known = catalog.manifest_ids()
    # Ref objects are never deleted nor rewritten, so a ref the catalog knows and the store
    # lacks, or one that now names another manifest, means the store was wiped (or restored
    # from elsewhere), as a changed epoch does.
    if (
        epoch != catalog.epoch()
        or not known_refs <= refs
        or _refs_moved(store, catalog, known - in_store)
    ):
        if known_refs or known:
            _log_rebuild(store, catalog)
        catalog.clear(epoch=epoch)
        known_refs, known = set(), set()
    catalog.add_manifests(fetch_manifests(store, in_store - known, skip_corrupt=True))
    catalog.remove_manifests(known - in_store)
    catalog.set_refs(_read_refs(store, refs - known_refs))


def _rebuild(store: ObjectStore, catalog: Catalog, epoch: str | None) -> None:
    _log_rebuild(store, catalog)
    catalog.clear(epoch=epoch)
    _sync_all(store, catalog, epoch)


def _log_rebuild(store: ObjectStore, catalog: Catalog) -> None:
    log.info("catalog %s is of an earlier repository at %s: rebuilding it", catalog.path, store.uri)


def _refs_moved(store: ObjectStore, catalog: Catalog, ids: set[str]) -> bool:
    """Whether a ref the catalog has to one of `ids` is gone or names another manifest."""
    rows = catalog.refs_to(ids) if ids else []
    current = {(n, v): i for n, v, i in _read_refs(store, {(n, v) for n, v, _ in rows})}
    return any(current.get((n, v)) != i for n, v, i in rows)


def _read_refs(store: ObjectStore, refs: set[tuple[str, int]]) -> list[tuple[str, int, str]]:
    ordered = sorted(refs)
    rows = []
    for (name, version), data in zip(
        ordered, store.get_many(ref_key(n, v) for n, v in ordered), strict=True
    ):
        if isinstance(data, ObjectNotFound):
            continue
        if isinstance(data, BaseException):
            raise data
        rows.append((name, version, data.decode().strip()))
    return rows
