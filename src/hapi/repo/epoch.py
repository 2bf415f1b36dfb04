"""The repository's epoch: how a catalog notices that its store was wiped and re-created.

A catalog trusts that ref objects never change, so it reads each one once. That holds for
one repository, but not across a wipe: a repository re-created at the same place hands out
`net@1` again, for another model, and a catalog that kept the old `net@1` would answer from
it. So the first push of a repository writes a random token (`refs/_epoch`, create-only,
so concurrent first pushes agree on one), each sync reads it (one small GET), and a catalog
built under another token, or under none, is thrown away and rebuilt.
"""

from __future__ import annotations

import uuid

from hapi.data.store import ObjectStore
from hapi.errors import ObjectNotFound
from hapi.repo.layout import EPOCH

__all__ = ["mark_epoch", "read_epoch"]


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
