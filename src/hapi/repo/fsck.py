"""`fsck`: check every stored tensor against its hash, and drop the corrupt ones.

A corrupt blob keeps its name, so a push of the same model would find it present and not
replace it; `fsck(repair=True)` deletes it, and the next push of any model holding that
tensor writes it again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hapi.data.store import ObjectStore
from hapi.errors import IntegrityError, ObjectNotFound
from hapi.repo.layout import MANIFESTS, id_of_manifest_key, tensor_key
from hapi.repo.sync import fetch_manifests
from hapi.repo.tensors import decode_blob

__all__ = ["FsckReport", "check_blobs"]


@dataclass(frozen=True, kw_only=True)
class FsckReport:
    """What `fsck` found."""

    checked: int = 0
    """Distinct blobs read and re-hashed."""
    corrupt: dict[str, str] = field(default_factory=dict)
    """Blob key -> what is wrong with it."""
    missing: dict[str, list[str]] = field(default_factory=dict)
    """Blob key -> `name:key` of the versions' tensors that need it."""
    repaired: bool = False
    """Whether corrupt blobs were deleted."""

    @property
    def ok(self) -> bool:
        return not (self.corrupt or self.missing)


def check_blobs(store: ObjectStore, *, repair: bool = False) -> FsckReport:
    """Read every blob any manifest references and check it (one blob in memory at a time)."""
    ids = {i for k in store.list(MANIFESTS) if (i := id_of_manifest_key(k))}
    users: dict[str, list[str]] = {}
    for m in fetch_manifests(store, ids):
        for key, entry in m.tensors.items():
            users.setdefault(entry.hash, []).append(f"{m.name}:{key}")
    corrupt: dict[str, str] = {}
    missing: dict[str, list[str]] = {}
    for digest, needed_by in sorted(users.items()):
        key = tensor_key(digest)
        try:
            decode_blob(store.get(key), digest, repr(needed_by[0]))
        except ObjectNotFound:
            missing[key] = needed_by
        except IntegrityError as exc:
            corrupt[key] = str(exc)
            if repair:
                store.delete(key)
    return FsckReport(checked=len(users), corrupt=corrupt, missing=missing, repaired=repair)
