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
from typing import Any

from hapi.data.shards.members import MemberStore, split_member
from hapi.data.store._errors import connect_failure, is_not_implemented, translate
from hapi.data.store._location import (
    check_key,
    check_not_forked,
    escapes,
    local_dir,
    local_path,
    read_plain,
    resolves_under,
)
from hapi.data.store.options import StoreOptions
from hapi.data.store.schemes import scheme_of
from hapi.errors import Forbidden, ObjectNotFound, StoreUnavailable, shorten

__all__ = ["Store", "object_version", "open_store"]

log = logging.getLogger("hapi.data")


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
    if not create and store.scheme.local:
        local_dir(store.uri, create=False)  # report a missing directory now, not on first use
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
        self.scheme = scheme_of(self.uri)
        """The kind of store the URI names (`hapi.data.store.schemes`)."""

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
        check_not_forked(self.uri)
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._client = self.scheme.client(self.uri, self.options, self.create)
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

        check_not_forked(self.uri)
        if self.scheme.local:
            local_dir(self.uri, create=self.create)
            return
        if not self.scheme.remote:
            return  # memory: always there
        quick = replace(
            self.options,
            connect_timeout=min(self.options.connect_timeout, timeout),
            request_timeout=min(self.options.request_timeout, timeout),
            max_retries=0,
        )
        try:
            client = self.scheme.client(self.uri, quick, True)
            next(iter(obstore.list(client, chunk_size=1)), None)
        except Exception as exc:
            reason = connect_failure(exc)
            if reason is None:
                raise self._error(exc, "") from exc
            raise StoreUnavailable(
                f"cannot reach store {self.uri} at {self.scheme.endpoint(self.options)} "
                f"({reason}): check that the store is running, the endpoint and the network"
            ) from None

    def get(self, key: str) -> bytes:
        import obstore

        if _names_member(key):
            return self.members.get(key)
        root = self._real_root()
        if root is not None:
            # Without obstore, but as refused as its reads in a forked child: a read that
            # met a link would take obstore's path and be refused anyway.
            check_not_forked(self.uri)
            check_key(key)
            plain = read_plain(root, key)
            if plain is not None:
                return plain
        key = self._inside(key)
        try:
            return bytes(obstore.get(self.client, key).bytes())
        except Exception as exc:
            raise self._error(exc, key) from exc

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
            raise self._error(exc, key) from exc

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
            raise self._error(exc, key) from exc

    @property
    def members(self) -> MemberStore:
        """This store reading shard members (`hapi.data.shards.members`): `get`,
        `get_versioned` and `get_many` of a member key (`shards/a.tar#KEY`) go through it,
        so every reader of samples (a server's chunks and profiles, its feature cache, a
        trainer's fallback) reads a shard's members as it reads objects."""
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
            raise self._error(exc, key) from exc

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
            raise self._error(exc, key) from exc

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
            raise self._error(exc, key) from exc

    def list(self, prefix: str = "") -> Iterator[str]:
        for key, _ in self.list_versions(prefix):
            yield key

    def list_versions(self, prefix: str = "") -> Iterator[tuple[str, str]]:
        import obstore

        prefix = prefix.strip("/")
        if prefix:
            check_key(prefix)
        root = self._real_root()
        # Whether each directory listed stays inside the root, resolved once per directory.
        inside: dict[str, frozenset[str] | None] = {}
        escaped: list[str] = []
        try:
            for page in obstore.list(self.client, prefix or None):
                for meta in page:
                    key = str(meta["path"])
                    if root is not None and escapes(root, key, inside):
                        escaped.append(key)
                        continue
                    yield key, object_version(meta)
        except Exception as exc:
            raise self._error(exc, prefix) from exc
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
            err = self._error(exc, key)
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
        if self._root is None and self.scheme.local:
            root = os.path.realpath(local_path(self.uri))
            self._root = root.rstrip(os.sep) + os.sep
        return self._root

    def _error(self, exc: Exception, key: str) -> Exception:
        """obstore's exception `exc` on `key` as hapi's error (`translate`)."""
        return translate(exc, self.uri, key, self.scheme.credentials)

    def _inside(self, key: str) -> str:
        """`key` if it is well formed and, in a local store, its path stays in the root.

        Raises:
            InvalidRequest: the key is malformed.
            Forbidden: the key's path leads outside the store's root through a symlink.
        """
        check_key(key)
        root = self._real_root()
        if root is not None and not resolves_under(root, key):
            # The target is not named: it would tell a client about the server's files.
            raise Forbidden(
                f"object key {shorten(repr(key))} of store {self.uri} is refused: symlink "
                "leaves the store's root (a link on its path points outside it), and hapi "
                "reads and writes only inside the root; copy the object into the store "
                "instead of linking to it"
            )
        return key


def _names_member(key: str) -> bool:
    return "#" in key and split_member(key) is not None


def object_version(meta: Any) -> str:
    """An object's version from its listing: a digest of its ETag, size and modification
    time, so a store without ETags (or one that reuses them) still tells a rewrite."""
    stamp = meta.get("last_modified")
    text = f"{meta.get('e_tag')}|{meta.get('size')}|{stamp.isoformat() if stamp else ''}"
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
