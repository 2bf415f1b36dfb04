"""The repository's epoch: how a catalog notices that its store was wiped and re-created.

The first push writes a random token (`refs/_epoch`, create-only); each sync reads it, and
a catalog built under another token, or none, is rebuilt. The change token
(`refs/_changes`), rewritten by every push and rm, spares a query the listing of every
ref. Why: docs/repository.md, "The epoch and the change token".
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
