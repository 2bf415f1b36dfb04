"""The repository's epoch: how a catalog notices that its store was wiped and re-created.

A catalog trusts that ref objects never change, so it reads each one once. That holds for
one repository, but not across a wipe: a repository re-created at the same place hands out
`net@1` again, for another model, and a catalog that kept the old `net@1` would answer from
it. So the first push of a repository writes a random token (`refs/_epoch`, create-only,
so concurrent first pushes agree on one), each sync reads it (one small GET), and a catalog
built under another token, or under none, is thrown away and rebuilt.

The change token (`refs/_changes`) is rewritten by every push and rm once its change is in
the store: a catalog that listed the store after reading token T is current while the
token still reads T, which spares a query the listing of every ref.
"""

from __future__ import annotations

import uuid

from hapi.data.store import ObjectStore
from hapi.errors import ObjectNotFound
from hapi.repo.storage.layout import CHANGES, EPOCH

__all__ = ["mark_changed", "mark_epoch", "read_changes", "read_epoch"]


def read_epoch(store: ObjectStore) -> str | None:
    """The store's epoch token, or None for a repository no push has written to yet (or one
    older than epochs)."""
    try:
        return store.get(EPOCH).decode().strip()
    except ObjectNotFound:
        return None


def mark_epoch(store: ObjectStore) -> None:
    """Give the repository an epoch unless it has one (before a push writes any ref)."""
    store.put_if_absent(EPOCH, uuid.uuid4().hex.encode())


def read_changes(store: ObjectStore) -> str | None:
    """The store's change token, or None when no push of this hapi has written one."""
    try:
        return store.get(CHANGES).decode().strip()
    except ObjectNotFound:
        return None


def mark_changed(store: ObjectStore) -> None:
    """Tell catalogs that the versions changed (after the change is in the store)."""
    store.put(CHANGES, uuid.uuid4().hex.encode())
