"""The object store facade: one small interface over a local directory, S3 and memory.

Everything hapi keeps (datasets, the model repository's tensors and manifests) lives behind
`ObjectStore`. The implementation is obstore (Rust's object_store): one well-kept library for
local directories, memory, S3-compatible stores, GCS and Azure, with retries built in.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable
from urllib.parse import urlparse

from hapi.data._cloud import endpoint_hint, is_cloud, is_remote
from hapi.data._store_errors import connect_failure, is_not_implemented, translate
from hapi.data._store_location import (
    _check_endpoint,
    _check_key,
    _check_not_forked,
    _escapes,
    _is_local,
    _is_windows_drive,
    _local_dir,
    _local_path,
    _make_client,
    _resolves_under,
)
from hapi.errors import Forbidden, InvalidRequest, ObjectNotFound, StoreUnavailable, shorten

if TYPE_CHECKING:
    from hapi.data.members import MemberStore

__all__ = ["ObjectStore", "Store", "StoreOptions", "object_version", "open_store"]

log = logging.getLogger("hapi.data")


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


@dataclass(frozen=True, kw_only=True)
class StoreOptions:
    """How to reach an S3, GCS or Azure store. Unset fields fall back to each cloud's usual
    environment variables (AWS_*, GOOGLE_*, AZURE_STORAGE_*)."""

    endpoint: str | None = None
    """Endpoint URL: S3's (default `AWS_ENDPOINT_URL`), GCS's base URL, or Azure's blob
    endpoint (`http://127.0.0.1:10000/devstoreaccount1` for Azurite)."""
    access_key_id: str | None = None
    """Access key; default `AWS_ACCESS_KEY_ID`."""
    secret_access_key: str | None = None
    """Secret key; default `AWS_SECRET_ACCESS_KEY`."""
    region: str | None = None
    """Region; default `AWS_REGION`, else `us-east-1`."""
    service_account: str | None = None
    """GCS: path of a service account JSON key; default `GOOGLE_SERVICE_ACCOUNT`."""
    account_name: str | None = None
    """Azure: storage account; default `AZURE_STORAGE_ACCOUNT_NAME`."""
    account_key: str | None = None
    """Azure: the account's key; default `AZURE_STORAGE_ACCOUNT_KEY` (or a SAS token)."""
    concurrency: int = 16
    """Reads in flight at once in `get_many`."""
    connect_timeout: float = 5.0
    """Seconds to wait for a connection to a remote store."""
    request_timeout: float = 120.0
    """Seconds one request may take, body included: room for large tensor blobs."""
    max_retries: int = 2
    """Retries of a failed request. Few and fast, so a store that is down is reported
    in well under a second instead of after minutes of backoff."""

    def __post_init__(self) -> None:
        if self.endpoint is not None:
            _check_endpoint(self.endpoint, "endpoint")
        if self.concurrency < 1:
            raise InvalidRequest(f"concurrency must be >= 1, got {self.concurrency}")
        if not (self.connect_timeout > 0 and self.request_timeout > 0):
            raise InvalidRequest(
                f"timeouts must be positive seconds, got connect_timeout={self.connect_timeout}"
                f", request_timeout={self.request_timeout}"
            )
        if self.max_retries < 0:
            raise InvalidRequest(f"max_retries must be >= 0, got {self.max_retries}")


def open_store(
    uri: str | os.PathLike[str], options: StoreOptions | None = None, *, create: bool = True
) -> Store:
    """Open the store named by `uri`. Nothing is connected until the first request.

    Args:
        uri: `memory://`, `file:///abs/dir`, a plain directory path, `s3://bucket/prefix`,
            `gs://bucket/prefix` or `az://container/prefix` (and obstore's other Azure forms).
        options: endpoint and credentials; each cloud's environment variables otherwise.
        create: make a missing local directory (as an empty bucket) on first use. Readers
            pass False, so a mistyped path is reported instead of created.

    Raises:
        InvalidRequest: the scheme is not one hapi knows.
        ObjectNotFound: `create` is False and the local directory does not exist.
    """
    store = Store(str(uri), options or StoreOptions(), create=create)
    if not create and _is_local(store.uri):
        _local_dir(store.uri, create=False)  # report a missing directory now, not on first use
    return store


@dataclass(eq=False)
class Store:
    """An `ObjectStore` on obstore. Create it with `open_store`.

    The obstore client is made lazily on first use, so a `Store` pickles into DataLoader
    workers or subprocesses and each process opens its own connection pool. Start such
    workers with 'spawn' or 'forkserver': obstore cannot run in a child forked from a
    process that has used it, so there every request raises `StoreUnavailable` (instead
    of hanging).

    A local directory store keeps every read and write inside its root: a key whose path
    resolves outside it (through a symlink to a file or a directory) is `Forbidden`, and
    `list` leaves such keys out.
    """

    uri: str
    options: StoreOptions = field(default_factory=StoreOptions)
    create: bool = True
    """Whether a missing local directory is made on first use (see `open_store`)."""

    def __post_init__(self) -> None:
        self._client: Any = None
        self._lock = threading.Lock()
        self._root: str | None = None
        """A local store's real root path, ending in a separator; None until needed."""
        self._members: MemberStore | None = None
        scheme = urlparse(self.uri).scheme
        known = scheme in ("", "file", "memory", "s3") or is_cloud(self.uri)
        if not known and not _is_windows_drive(self.uri):
            raise InvalidRequest(
                f"unknown store URI scheme {shorten(repr(scheme))} in {shorten(repr(self.uri))}: "
                "use a directory path, file:///dir, s3://bucket/prefix, gs://bucket/prefix, "
                "az://container/prefix or memory://"
            )

    def __getstate__(self) -> dict[str, Any]:
        return {"uri": self.uri, "options": self.options, "create": self.create}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.uri = state["uri"]
        self.options = state["options"]
        self.create = state.get("create", True)
        self.__post_init__()

    def __repr__(self) -> str:
        return f"Store({self.uri!r})"

    @property
    def client(self) -> Any:
        """The obstore store, made on first use.

        Raises:
            StoreUnavailable: this process was forked from one that had used a store.
        """
        _check_not_forked(self.uri)
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._client = _make_client(self.uri, self.options, create=self.create)
        return self._client

    def check(self, timeout: float = 5.0) -> None:
        """Make one cheap request, so that a store that cannot be reached is reported now
        (at a server's start) rather than at the first read.

        A local directory must exist (or is made, when the store creates); an S3 store
        lists at most one key under its prefix, with no retry and at most `timeout`
        seconds to connect and answer.

        Raises:
            StoreUnavailable: the endpoint cannot be reached, or refused the credentials.
            ObjectNotFound: the bucket or the local directory does not exist.
        """
        import obstore

        _check_not_forked(self.uri)
        if _is_local(self.uri):
            _local_dir(self.uri, create=self.create)
            return
        if not is_remote(self.uri):
            return  # memory: always there
        quick = replace(
            self.options,
            connect_timeout=min(self.options.connect_timeout, timeout),
            request_timeout=min(self.options.request_timeout, timeout),
            max_retries=0,
        )
        try:
            next(iter(obstore.list(_make_client(self.uri, quick), chunk_size=1)), None)
        except Exception as exc:
            reason = connect_failure(exc)
            if reason is None:
                raise translate(exc, self.uri, "") from exc
            raise StoreUnavailable(
                f"cannot reach store {self.uri} at {endpoint_hint(self.uri, self.options)} "
                f"({reason}): check that the store is running, the endpoint and the network"
            ) from None

    def get(self, key: str) -> bytes:
        import obstore

        if _names_member(key):
            return self.members.get(key)
        key = self._inside(key)
        try:
            return bytes(obstore.get(self.client, key).bytes())
        except Exception as exc:
            raise translate(exc, self.uri, key) from exc

    def get_versioned(self, key: str) -> tuple[bytes, str]:
        """The object's bytes and the version of exactly those bytes (`object_version` of
        the read's own metadata, as a listing gives it): a feature cache stores what it
        computed from them under this version, never under one listed before a rewrite.

        Raises:
            ObjectNotFound: there is no such object.
        """
        import obstore

        if _names_member(key):
            return self.members.get_versioned(key)
        key = self._inside(key)
        try:
            result = obstore.get(self.client, key)
            return bytes(result.bytes()), object_version(result.meta)
        except Exception as exc:
            raise translate(exc, self.uri, key) from exc

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes `start` to `end` (exclusive; clamped to the object's end) of the object, in
        one ranged request: a shard's members are read without reading the shard.

        Raises:
            ObjectNotFound: there is no such object.
        """
        return bytes(self.get_range_versioned(key, start, end)[0])

    def get_range_versioned(self, key: str, start: int, end: int) -> tuple[memoryview, str, int]:
        """`get_range`, with the version and the size of the object those bytes are of
        (as a listing gives them), from the same request: an index of a shard's members
        built for another version must not be trusted with them.

        The bytes are a view of the response's own buffer, not a copy: a chunk's span is
        megabytes, and copying it whole cost the server's core more than slicing its
        members out of it (fresh pages each time).

        (`obstore.get` with a range rather than `obstore.get_range`: the same one request,
        and it returns the object's metadata.)
        """
        import obstore

        key = self._inside(key)
        try:
            result = obstore.get(self.client, key, options={"range": (start, end)})
            data = memoryview(result.bytes())
            return data, object_version(result.meta), int(result.meta["size"])
        except Exception as exc:
            raise translate(exc, self.uri, key) from exc

    @property
    def members(self) -> MemberStore:
        """This store reading shard members (`hapi.data.members`): `get`, `get_versioned`
        and `get_many` of a member key (`shards/a.tar#KEY`) go through it, so every
        reader of samples (a server's chunks and profiles, its feature cache, a trainer's
        fallback) reads a shard's members as it reads objects."""
        from hapi.data.members import MemberStore

        if self._members is None:
            with self._lock:
                if self._members is None:
                    self._members = MemberStore(self)
        return self._members

    def get_many(self, keys: Iterable[str]) -> list[bytes | BaseException]:
        keys = list(keys)
        if any(_names_member(k) for k in keys):
            return self.members.get_many(keys)  # members close together: one request
        if len(keys) <= 1:
            return [self._get_or_error(k) for k in keys]
        workers = min(self.options.concurrency, len(keys))
        with ThreadPoolExecutor(workers, thread_name_prefix="hapi-get") as pool:
            return list(pool.map(self._get_or_error, keys))

    def _get_or_error(self, key: str) -> bytes | BaseException:
        try:
            return self.get(key)
        except Exception as exc:
            return exc

    def put(self, key: str, data: bytes) -> None:
        import obstore

        key = self._inside(key)
        try:
            obstore.put(self.client, key, data)
        except Exception as exc:
            raise translate(exc, self.uri, key) from exc

    def put_if_absent(self, key: str, data: bytes) -> bool:
        import obstore
        from obstore.exceptions import AlreadyExistsError

        key = self._inside(key)
        try:
            obstore.put(self.client, key, data, mode="create")
            return True
        except AlreadyExistsError:
            return False
        except Exception as exc:
            # Some S3-compatible stores do not implement conditional puts; there the check
            # and the write are two requests, which is safe for content-addressed keys.
            if is_not_implemented(exc):
                if self.exists(key):
                    return False
                self.put(key, data)
                return True
            raise translate(exc, self.uri, key) from exc

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
            return True
        except ObjectNotFound:
            return False

    def size(self, key: str) -> int:
        import obstore

        key = self._inside(key)
        try:
            return int(obstore.head(self.client, key)["size"])
        except Exception as exc:
            raise translate(exc, self.uri, key) from exc

    def list(self, prefix: str = "") -> Iterator[str]:
        for key, _ in self.list_versions(prefix):
            yield key

    def list_versions(self, prefix: str = "") -> Iterator[tuple[str, str]]:
        import obstore

        prefix = prefix.strip("/")
        if prefix:
            _check_key(prefix)
        root = self._real_root()
        # Whether each directory listed stays inside the root, resolved once per directory.
        inside: dict[str, frozenset[str] | None] = {}
        escaped: list[str] = []
        try:
            for page in obstore.list(self.client, prefix or None):
                for meta in page:
                    key = str(meta["path"])
                    if root is not None and _escapes(root, key, inside):
                        escaped.append(key)
                        continue
                    yield key, object_version(meta)
        except Exception as exc:
            raise translate(exc, self.uri, prefix) from exc
        if escaped:
            # Left out, not refused: one stray link must not hide a whole dataset, and
            # reading such a key is refused anyway (with the reason).
            log.warning(
                "store %s: left out %d key(s) whose symlinks leave the store's root, e.g. %r",
                self.uri,
                len(escaped),
                escaped[0],
            )

    def delete(self, key: str) -> None:
        import obstore

        key = self._inside(key)
        try:
            obstore.delete(self.client, key)
        except Exception as exc:
            err = translate(exc, self.uri, key)
            if not isinstance(err, ObjectNotFound):
                raise err from exc

    def real_key(self, key: str) -> str:
        """The key a local store's symlinks lead `key` to (the key itself elsewhere).

        A link inside the root that points into another folder of the root reads that
        folder's object: whoever may read only some prefixes must be checked against
        where the link leads too, not just its name.

        Raises:
            InvalidRequest: the key is malformed.
            Forbidden: the key's path leads outside the store's root.
        """
        if _names_member(key):
            return self.members.real_key(key)  # the shard's links are what the read follows
        self._inside(key)
        root = self._real_root()
        if root is None:
            return key
        real = os.path.realpath(os.path.join(root, key))
        return os.path.relpath(real, root).replace(os.sep, "/")

    def _real_root(self) -> str | None:
        """A local store's root as `os.path.realpath` gives it, with a trailing separator;
        None for other stores."""
        if self._root is None and _is_local(self.uri):
            root = os.path.realpath(_local_path(self.uri))
            self._root = root.rstrip(os.sep) + os.sep
        return self._root

    def _inside(self, key: str) -> str:
        """`key` if it is well formed and, in a local store, its path stays in the root.

        Raises:
            InvalidRequest: the key is malformed.
            Forbidden: the key's path leads outside the store's root through a symlink.
        """
        _check_key(key)
        root = self._real_root()
        if root is not None and not _resolves_under(root, key):
            # The target is not named: it would tell a client about the server's files.
            raise Forbidden(
                f"object key {shorten(repr(key))} of store {self.uri} is refused: symlink "
                "leaves the store's root (a link on its path points outside it), and hapi "
                "reads and writes only inside the root; copy the object into the store "
                "instead of linking to it"
            )
        return key


def _names_member(key: str) -> bool:
    from hapi.data.members import split_member

    return "#" in key and split_member(key) is not None


def object_version(meta: Any) -> str:
    """An object's version from its listing: a digest of its ETag, size and modification
    time, so a store without ETags (or one that reuses them) still tells a rewrite."""
    stamp = meta.get("last_modified")
    text = f"{meta.get('e_tag')}|{meta.get('size')}|{stamp.isoformat() if stamp else ''}"
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
