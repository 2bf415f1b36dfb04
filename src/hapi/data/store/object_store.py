"""`ObjectStore`: what hapi needs of an object store, the boundary every backend meets.

Kept apart from the facade (`hapi.data.store.store`) so that whatever only takes a store
(the repository, shard members, the server) names the protocol, not its implementation.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol, runtime_checkable

__all__ = ["ObjectStore"]


@runtime_checkable
class ObjectStore(Protocol):
    """What hapi needs of an object store.

    Keys are `/`-separated strings relative to the store's root (never a leading `/`), because
    the same key must name the same object on a local directory and in an S3 bucket. Values
    are whole `bytes`: hapi's objects (images, tensor blobs, manifests) are read whole.
    """

    uri: str

    def get(self, key: str) -> bytes:
        """Return the object's bytes; raise `ObjectNotFound` if there is none."""
        ...

    def get_many(self, keys: Iterable[str]) -> list[bytes | BaseException]:
        """Read many objects concurrently; a failed read gives its exception in place."""
        ...

    def put(self, key: str, data: bytes) -> None:
        """Write (or overwrite) an object atomically: readers see the old or the new bytes."""
        ...

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Write unless the key exists; return whether this call wrote it."""
        ...

    def exists(self, key: str) -> bool:
        """Whether an object is stored under `key`."""
        ...

    def size(self, key: str) -> int:
        """The object's size in bytes; raise `ObjectNotFound` if there is none."""
        ...

    def list(self, prefix: str = "") -> Iterator[str]:
        """Yield every key under `prefix` (recursively), in no particular order."""
        ...

    def list_versions(self, prefix: str = "") -> Iterator[tuple[str, str]]:
        """Yield `(key, version)` for every key under `prefix`: the version changes
        whenever the object does (its ETag, size and modification time, digested)."""
        ...

    def delete(self, key: str) -> None:
        """Remove an object; removing a missing object is not an error."""
        ...
