"""Where a store's keys lead: its root (a directory, a bucket), a key's checks and its
containment under the root, and the client (obstore) that reaches it. `hapi.data.store`
is the facade over them."""

from __future__ import annotations

import os
import re
import threading
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from hapi.data._cloud import cloud_client, is_cloud
from hapi.errors import InvalidRequest, ObjectNotFound, StoreUnavailable, shorten

if TYPE_CHECKING:
    from hapi.data.store import StoreOptions

__all__ = [
    "_check_endpoint",
    "_check_key",
    "_check_not_forked",
    "_escapes",
    "_http_options",
    "_is_local",
    "_is_windows_drive",
    "_local_dir",
    "_local_path",
    "_make_client",
    "_resolves_under",
]


# Memory stores are process-wide by URI so two `open_store("memory://x")` calls see the same
# objects, as two handles on one bucket would.
_MEMORY: dict[str, Any] = {}
_MEMORY_LOCK = threading.Lock()


# The pid of the process whose stores started obstore's (Rust, tokio) runtime. fork()
# copies only the calling thread, so in a forked child that runtime has no threads and
# every request would hang forever; refusing is better than hanging.
_RUNTIME_PID: int | None = None


def _check_not_forked(uri: str) -> None:
    global _RUNTIME_PID
    pid = os.getpid()
    if _RUNTIME_PID is None:
        _RUNTIME_PID = pid
    elif pid != _RUNTIME_PID:
        raise StoreUnavailable(
            f"store {uri} cannot be used in this process: it was forked from process "
            f"{_RUNTIME_PID}, which had already used an object store, and obstore cannot run "
            "in a forked child. Start workers with the 'spawn' or 'forkserver' method (e.g. "
            "DataLoader(multiprocessing_context='spawn')), or fork before opening any store."
        )


def _resolves_under(root: str, key: str) -> bool:
    # realpath resolves every symlink on the way (a linked file or directory); a path that
    # does not exist yet resolves as far as it exists, which is what a write would follow.
    real = os.path.realpath(os.path.join(root, key))
    return (real + os.sep).startswith(root)


def _escapes(root: str, key: str, inside: dict[str, frozenset[str] | None]) -> bool:
    """Whether a listed key leaves `root`. Each directory is resolved and listed once
    (`inside`: its links' names, None where it leaves the root), so a plain file costs a
    set lookup, not a system call - a million keys are listed in seconds."""
    parent, _, name = key.rpartition("/")
    if parent not in inside:
        links: frozenset[str] | None = None
        if not parent or _resolves_under(root, parent):
            try:
                with os.scandir(os.path.join(root, parent)) as entries:
                    links = frozenset(e.name for e in entries if e.is_symlink())
            except OSError:
                links = frozenset()
        inside[parent] = links
    links = inside[parent]
    if links is None:
        return True
    # Most objects are plain files; realpath only for a link.
    return name in links and not _resolves_under(root, key)


def _check_key(key: str) -> str:
    # Checked before obstore sees the key: obstore reports a control character as a failed
    # request (StoreUnavailable), and a key with '..' must never leave a local store's root.
    if (
        not isinstance(key, str)
        or not key
        or key.startswith("/")
        or any(p in ("", ".", "..") for p in key.split("/"))
        or _CONTROL.search(key)
    ):
        raise InvalidRequest(
            f"invalid object key {shorten(repr(key))}: keys are relative '/'-separated paths "
            "without empty, '.' or '..' parts or control characters"
        )
    return key


# object_store refuses ASCII control characters (NUL, newline, DEL...) in a path.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _check_endpoint(endpoint: str, name: str) -> None:
    # obstore panics on an endpoint without a scheme, with a PanicException that is a
    # BaseException: `except Exception` would miss it.
    parsed = urlparse(endpoint)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise InvalidRequest(
            f"{name} {shorten(repr(endpoint))} is not an http(s) URL: write it as "
            "http://host:port or https://host"
        )


def _local_dir(uri: str, *, create: bool) -> Path:
    """The directory of a local store URI, made if missing when `create` is set.

    Raises:
        ObjectNotFound: it does not exist (and `create` is False), or is not a directory.
    """
    path = _local_path(uri)
    if create:
        path.mkdir(parents=True, exist_ok=True)
    elif not path.exists():
        raise ObjectNotFound(f"store directory {path} does not exist (nothing was created)")
    if not path.is_dir():
        raise ObjectNotFound(f"store {path} is not a directory")
    return path


def _local_path(uri: str) -> Path:
    parsed = urlparse(uri)
    return Path(parsed.path if parsed.scheme == "file" else uri).expanduser().resolve()


def _is_windows_drive(uri: str) -> bool:
    return len(uri) > 1 and uri[1] == ":"


def _is_local(uri: str) -> bool:
    return urlparse(uri).scheme in ("", "file") or _is_windows_drive(uri)


def _make_client(uri: str, options: StoreOptions, *, create: bool = True) -> Any:
    from obstore.store import LocalStore, MemoryStore, S3Store

    parsed = urlparse(uri)
    if parsed.scheme == "memory":
        with _MEMORY_LOCK:
            return _MEMORY.setdefault(uri, MemoryStore())
    if is_cloud(uri):
        return cloud_client(uri, options, *_http_options(options))
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise InvalidRequest(f"{uri!r} names no bucket: use s3://bucket/prefix")
        endpoint = options.endpoint or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint and not options.endpoint:
            _check_endpoint(endpoint, "AWS_ENDPOINT_URL")
        config: dict[str, str] = {
            "region": options.region or os.environ.get("AWS_REGION", "us-east-1"),
        }
        key_id = options.access_key_id or os.environ.get("AWS_ACCESS_KEY_ID")
        secret = options.secret_access_key or os.environ.get("AWS_SECRET_ACCESS_KEY")
        if key_id and secret:
            config["access_key_id"] = key_id
            config["secret_access_key"] = secret
        else:
            config["skip_signature"] = "true"
        if endpoint:
            config["endpoint"] = endpoint
        client_options, retry = _http_options(options)
        return S3Store(
            parsed.netloc,
            prefix=parsed.path.strip("/") or None,
            config=config,  # type: ignore[arg-type]
            client_options=client_options,  # type: ignore[arg-type]
            retry_config=retry,  # type: ignore[arg-type]
        )
    return LocalStore(_local_dir(uri, create=create))


def _http_options(options: StoreOptions) -> tuple[dict[str, Any], dict[str, Any]]:
    """obstore's client options and retry configuration, the same for every cloud."""
    client_options = {
        "allow_http": True,
        "timeout": f"{options.request_timeout}s",
        "connect_timeout": f"{options.connect_timeout}s",
    }
    retry = {
        "max_retries": options.max_retries,
        "backoff": {
            "init_backoff": timedelta(milliseconds=50),
            "max_backoff": timedelta(milliseconds=500),
            "base": 2,
        },
        "retry_timeout": timedelta(seconds=options.request_timeout),
    }
    return client_options, retry
