"""Bringing the catalog up to date from the store, which is the source of truth.

Manifests and ref objects never change once written (a removed version loses its manifest,
never its ref object), so a sync fetches only what the catalog has not seen: one listing of
each prefix, plus a read per new object. That keeps several processes, each with its own
catalog, in step with each other's pushes at the cost of a listing.
"""

from __future__ import annotations

import logging

from hapi.data.store import ObjectStore
from hapi.errors import IntegrityError, ObjectNotFound
from hapi.repo.catalog import Catalog
from hapi.repo.layout import MANIFESTS, REFS, id_of_manifest_key, manifest_key, ref_key
from hapi.repo.manifest import VersionManifest

__all__ = ["fetch_manifests", "parse_ref_key", "sync_all", "sync_name"]

log = logging.getLogger("hapi.repo")


def parse_ref_key(key: str) -> tuple[str, int] | None:
    """`(name, version)` of a ref object's key, or None for any other key."""
    parts = key.split("/")
    if len(parts) != 3 or parts[0] != REFS or not parts[2].isdigit():
        return None
    return parts[1], int(parts[2])


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
    """Make the catalog match every manifest and ref object in the store."""
    in_store = {i for k in store.list(MANIFESTS) if (i := id_of_manifest_key(k))}
    known = catalog.manifest_ids()
    catalog.add_manifests(fetch_manifests(store, in_store - known, skip_corrupt=True))
    catalog.remove_manifests(known - in_store)
    refs = {r for k in store.list(REFS) if (r := parse_ref_key(k))}
    known_refs = catalog.ref_keys()
    catalog.set_refs(_read_refs(store, refs - known_refs), drop=known_refs - refs)


def sync_name(store: ObjectStore, catalog: Catalog, name: str) -> None:
    """Fetch the versions of `name` the catalog has not seen yet."""
    refs = {r for k in store.list(f"{REFS}/{name}") if (r := parse_ref_key(k)) and r[0] == name}
    rows = _read_refs(store, refs - catalog.ref_keys(name))
    missing = {mid for _, _, mid in rows} - catalog.manifest_ids()
    catalog.add_manifests(fetch_manifests(store, missing, skip_corrupt=True))
    catalog.set_refs(rows)


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
