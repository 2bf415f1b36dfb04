"""Where a store's keys lead: a key's checks, its containment under a local store's root
(symlinks), the root directory itself, and the one process that may use obstore.
`hapi.data.store.store` is the facade over them."""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import urlparse

from hapi.errors import InvalidRequest, ObjectNotFound, StoreUnavailable, shorten

__all__ = [
    "check_key",
    "check_not_forked",
    "escapes",
    "is_windows_drive",
    "local_dir",
    "local_path",
    "read_plain",
    "resolves_under",
]


# The pid of the process whose stores started obstore's (Rust, tokio) runtime. fork()
# copies only the calling thread, so in a forked child that runtime has no threads and
# every request would hang forever; refusing is better than hanging.
_RUNTIME_PID: int | None = None


def check_not_forked(uri: str) -> None:
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


def resolves_under(root: str, key: str) -> bool:
    # realpath resolves every symlink on the way (a linked file or directory); a path that
    # does not exist yet resolves as far as it exists, which is what a write would follow.
    real = os.path.realpath(os.path.join(root, key))
    return (real + os.sep).startswith(root)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def read_plain(root: str, key: str) -> bytes | None:
    """A local object's bytes, read without following any link: each directory of the
    key opened in the one before it (`O_NOFOLLOW`), so the path cannot leave `root`,
    in a third of the time `resolves_under` and obstore take (10 us against 34 on a
    1 KB file). None where the path holds a link, or the read fails: the caller takes
    the checked path, which follows links inside the root and names the error."""
    *dirs, name = key.split("/")
    try:
        fd = os.open(root, _DIR_FLAGS)
    except OSError:
        return None
    try:
        for part in dirs:
            inner = os.open(part, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = inner
        file = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        size = max(os.fstat(file).st_size, 1 << 16)
        parts = []
        while block := os.read(file, size):
            parts.append(block)
        return parts[0] if len(parts) == 1 else b"".join(parts)
    except OSError:
        return None
    finally:
        os.close(file)


def escapes(root: str, key: str, inside: dict[str, frozenset[str] | None]) -> bool:
    """Whether a listed key leaves `root`. Each directory is resolved and listed once
    (`inside`: its links' names, None where it leaves the root), so a plain file costs a
    set lookup, not a system call - a million keys are listed in seconds."""
    parent, _, name = key.rpartition("/")
    if parent not in inside:
        links: frozenset[str] | None = None
        if not parent or resolves_under(root, parent):
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
    return name in links and not resolves_under(root, key)


def check_key(key: str) -> str:
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


def local_dir(uri: str, *, create: bool) -> Path:
    """The directory of a local store URI, made if missing when `create` is set.

    Raises:
        ObjectNotFound: it does not exist (and `create` is False), or is not a directory.
    """
    path = local_path(uri)
    if create:
        path.mkdir(parents=True, exist_ok=True)
    elif not path.exists():
        raise ObjectNotFound(f"store directory {path} does not exist (nothing was created)")
    if not path.is_dir():
        raise ObjectNotFound(f"store {path} is not a directory")
    return path


def local_path(uri: str) -> Path:
    parsed = urlparse(uri)
    return Path(parsed.path if parsed.scheme == "file" else uri).expanduser().resolve()


def is_windows_drive(uri: str) -> bool:
    return len(uri) > 1 and uri[1] == ":"
