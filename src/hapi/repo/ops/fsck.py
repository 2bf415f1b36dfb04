"""`fsck`: check every manifest and every stored tensor, and drop the corrupt tensors.

Everything is checked and reported, unreferenced blobs included; a delta is checked by
decoding it over its base; a blob of an unknown codec is reported apart and never
deleted. `fsck(repair=True)` deletes corrupt blobs, and the next push of a model holding
that tensor writes it again. More: docs/repository.md, "Checking a repository (fsck)".
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from hapi.data.store import ObjectStore
from hapi.errors import HapiError, IntegrityError, ObjectNotFound, StoreUnavailable, UnknownCodec
from hapi.repo.storage.blobs import read_blobs
from hapi.repo.storage.codec import read_info
from hapi.repo.storage.layout import (
    MANIFESTS,
    TENSORS,
    hash_of_tensor_key,
    id_of_manifest_key,
    manifest_key,
    tensor_key,
)
from hapi.repo.storage.manifest import VersionManifest
from hapi.repo.storage.markers import read_markers, with_bases
from hapi.repo.storage.tensors import decode_blob

__all__ = ["FsckReport", "check_repository"]


@dataclass(frozen=True, kw_only=True)
class FsckReport:
    """What `fsck` found. `ok` is False when any version cannot be loaded intact."""

    manifests: int = 0
    """Manifests read and checked against their digest."""
    checked: int = 0
    """Distinct blobs read and re-hashed (referenced or not)."""
    bad_manifests: dict[str, str] = field(default_factory=dict)
    """Manifest key -> why it cannot be read. Its version cannot be loaded, its tensors are
    unknown (so they may be among `unreferenced`), and `gc` refuses to run until it is
    restored or deleted."""
    corrupt: dict[str, str] = field(default_factory=dict)
    """Blob key -> what is wrong with it (referenced or not)."""
    unknown_codec: dict[str, str] = field(default_factory=dict)
    """Blob key -> the codec this hapi cannot decode it with (checked by a newer hapi)."""
    missing: dict[str, list[str]] = field(default_factory=dict)
    """Blob key -> `name:key` of the versions' tensors that need it."""
    unreferenced: list[str] = field(default_factory=list)
    """Blob keys no readable manifest references: left by removed versions or by pushes
    that are running or died; `gc` deletes them. Not an error."""
    unreferenced_bytes: int = 0
    """Their total size in bytes."""
    repaired: bool = False
    """Whether corrupt blobs were deleted."""

    @property
    def ok(self) -> bool:
        """Whether every version's manifest and tensors are intact."""
        return not (self.bad_manifests or self.corrupt or self.missing or self.unknown_codec)


def check_repository(
    store: ObjectStore, *, repair: bool = False, concurrency: int = 16
) -> FsckReport:
    """Read every manifest and every blob in the store and check them.

    Args:
        store: the repository's store.
        repair: delete corrupt blobs.
        concurrency: blobs read and hashed at once (and so held in memory at once).

    Raises:
        StoreUnavailable: the store cannot be reached.
    """
    manifests, bad_manifests = _read_manifests(store)
    users = _users(store, manifests)
    stored = {k: h for k in store.list(TENSORS) if (h := hash_of_tensor_key(k)) is not None}
    # Referenced blobs absent from the listing are read too: one may have been written
    # since the listing, and a read is what tells "missing" for sure.
    digests = {**stored, **{k: h for k in users if (h := hash_of_tensor_key(k)) is not None}}
    corrupt: dict[str, str] = {}
    unknown: dict[str, str] = {}
    missing: dict[str, list[str]] = {}
    unreferenced: list[str] = []
    unreferenced_bytes = 0
    checked = 0
    keys = sorted(digests)
    with ThreadPoolExecutor(max(1, min(concurrency, len(keys)))) as pool:
        results = pool.map(lambda k: _check_blob(store, k, digests[k], users.get(k)), keys)
        for key, (size, problem) in zip(keys, results, strict=True):
            if size is None:
                if key in users:
                    missing[key] = users[key]
                continue  # an unreferenced blob that gc removed since the listing
            checked += 1
            if isinstance(problem, UnknownCodec):
                unknown[key] = str(problem)
            elif problem is not None:
                corrupt[key] = str(problem)
                if repair:
                    store.delete(key)
            if key not in users:
                unreferenced.append(key)
                unreferenced_bytes += size
    return FsckReport(
        manifests=len(manifests),
        checked=checked,
        bad_manifests=bad_manifests,
        corrupt=corrupt,
        unknown_codec=unknown,
        missing=missing,
        unreferenced=unreferenced,
        unreferenced_bytes=unreferenced_bytes,
        repaired=repair,
    )


def _users(store: ObjectStore, manifests: list[VersionManifest]) -> dict[str, list[str]]:
    """Each referenced blob's key, with the tensors (`name:key`) that use it; the bases of
    delta blobs count as used."""
    users: dict[str, list[str]] = {}
    for m in manifests:
        for key, entry in m.tensors.items():
            users.setdefault(tensor_key(entry.hash), []).append(f"{m.name}:{key}")
    markers = read_markers(store)
    direct = {h for k in users if (h := hash_of_tensor_key(k)) is not None}
    for digest in sorted(with_bases(direct, markers) - direct):
        users[tensor_key(digest)] = ["(the base of a delta)"]
    return users


def _read_manifests(store: ObjectStore) -> tuple[list[VersionManifest], dict[str, str]]:
    ids = sorted({i for k in store.list(MANIFESTS) if (i := id_of_manifest_key(k))})
    keys = [manifest_key(i) for i in ids]
    found: list[VersionManifest] = []
    bad: dict[str, str] = {}
    for mid, key, data in zip(ids, keys, store.get_many(keys), strict=True):
        if isinstance(data, ObjectNotFound):
            continue  # removed since the listing
        if isinstance(data, StoreUnavailable):
            raise data
        try:
            if isinstance(data, BaseException):
                raise data
            found.append(VersionManifest.from_json(data, mid))
        except HapiError as exc:
            bad[key] = str(exc)
    return found, bad


def _check_blob(
    store: ObjectStore, key: str, digest: str, needed_by: list[str] | None
) -> tuple[int | None, HapiError | None]:
    """`(size, what is wrong or None)`; size None when there is no such blob."""
    try:
        data = store.get(key)
    except ObjectNotFound:
        return None, None
    except StoreUnavailable:
        raise
    except HapiError as exc:
        # A key the store refuses to read is a finding about that blob, not the end of
        # the check; manifests are checked for such keys, so this is the second guard.
        return 0, exc
    what = repr(needed_by[0]) if needed_by else "(unreferenced)"
    try:
        base = None
        try:
            info = read_info(data)
        except IntegrityError:
            info = None  # decode_blob says what is wrong, naming the tensor
        if info is not None and info.base is not None:
            found = read_blobs(
                store, [info.base], what=lambda d: f"{what}'s delta base", verify=False
            )
            base = found[info.base].tensor
        decode_blob(data, digest, what, base=base)
    except (IntegrityError, UnknownCodec) as exc:
        return len(data), exc
    return len(data), None
