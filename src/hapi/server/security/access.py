"""What a tenant may read of a server's store: keys under its prefixes, by name and by
where a local store's symlinks lead (a link in its own prefix to another tenant's objects)."""

from __future__ import annotations

import numpy as np

from hapi.data import DatasetManifest, ObjectStore, Store
from hapi.errors import Forbidden, shorten
from hapi.server.security.tenants import Tenant

__all__ = ["check_keys", "may_read", "readable_manifest"]


def readable_manifest(store: ObjectStore, tenant: Tenant, prefix: str) -> DatasetManifest:
    """The dataset under `prefix` in `store`, if `tenant` may read it.

    Raises:
        Forbidden: `prefix` is outside the tenant's prefixes.
    """
    manifest = DatasetManifest.from_store(store, tenant.check_prefix(prefix))
    # check_prefix allows whole segments only; keep a store whose listing matches by
    # characters (`a` listing `ab/...`) from showing keys beyond them.
    allowed = tenant.allows_all(manifest.keys.array)  # a tenant that reads every key
    if allowed is None:
        allowed = np.fromiter(
            (may_read(store, tenant, key) for key in manifest.keys), bool, len(manifest)
        )
    if not allowed.all():
        manifest = manifest.subset(np.flatnonzero(allowed))
    return manifest


def check_keys(store: ObjectStore, tenant: Tenant, keys: list[str]) -> None:
    """Refuse keys outside `tenant`'s prefixes, by name and by where a local store's
    symlinks lead.

    Raises:
        Forbidden: a key, or its link's target, outside the tenant's prefixes.
    """
    for key in keys:
        tenant.check_key(key)
    for key in keys:
        if not may_read(store, tenant, key):
            # The target is not named: it is another tenant's key.
            raise Forbidden(
                f"key {shorten(repr(key))} is refused: a symlink on its path leads "
                f"outside the prefixes of tenant {tenant.name!r}"
            )


def may_read(store: ObjectStore, tenant: Tenant, key: str) -> bool:
    """Whether `key`, and where a local store's symlinks lead it, are the tenant's."""
    if not tenant.allows(key):
        return False
    if tenant.reads_all or not isinstance(store, Store):
        return True
    real = store.real_key(key)
    return real == key or tenant.allows(real)
