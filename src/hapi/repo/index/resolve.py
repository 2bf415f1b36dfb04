"""Resolving references to versions through the catalog, syncing from the store on a miss.

The catalog may lag the store (another process pushed or removed a version since): a
lookup that finds nothing brings the catalog up to date for that name and looks again.
"""

from __future__ import annotations

import difflib

from hapi.data.store import ObjectStore
from hapi.errors import RefNotFound
from hapi.repo.index.catalog import Catalog
from hapi.repo.index.sync import sync_all, sync_name
from hapi.repo.index.version import ModelVersion
from hapi.repo.storage.refs import parse_ref

__all__ = ["lookup", "not_found"]


def lookup(store: ObjectStore, catalog: Catalog, ref: str | ModelVersion) -> ModelVersion:
    """The version `ref` names, per the catalog (see `hapi.repo.storage.refs` for the forms).

    Raises:
        RefNotFound: it names nothing, even after syncing; the message lists close names.
    """
    if isinstance(ref, ModelVersion):
        ref = ref.id
    parsed = parse_ref(ref)
    name = parsed.name
    if name is not None and parsed.version is not None:
        found = _by_version(store, catalog, name, parsed.version)
        if found is None and parsed.id_prefix:
            found = _by_prefix(store, catalog, parsed.id_prefix, name)
    elif name is not None and "@" in parsed.text:
        found = _by_prefix(store, catalog, parsed.id_prefix or "", name)
    else:
        found = _newest(store, catalog, name) if name else None
        if found is None and parsed.id_prefix:
            found = _by_prefix(store, catalog, parsed.id_prefix, None)
    if found is None:
        raise RefNotFound(not_found(store, catalog, ref, name))
    return found


def _newest(store: ObjectStore, catalog: Catalog, name: str) -> ModelVersion | None:
    sync_name(store, catalog, name)
    found = catalog.versions("m.name = ?", (name,), "r.version DESC")
    return found[0] if found else None


def _by_version(
    store: ObjectStore, catalog: Catalog, name: str, number: int
) -> ModelVersion | None:
    for attempt in range(2):
        found = catalog.versions("m.name = ? AND r.version = ?", (name, number))
        if found or attempt:
            return found[0] if found else None
        sync_name(store, catalog, name)
    return None


def _by_prefix(
    store: ObjectStore, catalog: Catalog, prefix: str, name: str | None
) -> ModelVersion | None:
    for attempt in range(2):
        found = catalog.versions(
            "m.id LIKE ? || '%'" + (" AND m.name = ?" if name else ""),
            (prefix, name) if name else (prefix,),
        )
        if len(found) > 1:
            options = ", ".join(f"{v.ref} ({v.short_id})" for v in found[:6])
            raise RefNotFound(f"{prefix!r} is ambiguous: it could be {options}")
        if found or attempt:
            return found[0] if found else None
        if name:
            sync_name(store, catalog, name)
        else:
            sync_all(store, catalog)
    return None


def not_found(
    store: ObjectStore, catalog: Catalog, ref: str | ModelVersion, name: str | None
) -> str:
    """Why `ref` names nothing, with the versions or names the user may have meant."""
    names = catalog.names()
    visible = {v.name for v in catalog.versions()}
    if name and name in visible:
        versions = [v.version for v in catalog.versions("m.name = ?", (name,))]
        return (
            f"{ref} is not in the repository {store.uri}: {name} has versions "
            f"{', '.join(map(str, versions))}"
        )
    close = difflib.get_close_matches(name or str(ref), sorted(visible), n=5, cutoff=0.5)
    if close:
        hint = f"did you mean {', '.join(close)}?"
    elif visible:
        hint = f"it holds {', '.join(sorted(visible)[:8])}"
    else:
        hint = "it holds no models yet" if not names else "all its models were removed"
    return f"no model {ref!r} in the repository {store.uri}: {hint}"
