"""Leftovers of writes to a local directory store that were cut short, and their removal.

obstore writes an object to a local directory as `<path>#<n>` beside it (`n` counts up
from 1 to the first free name) and renames that file into place, so no reader ever sees
half an object. A process killed mid-write (SIGKILL, power loss) leaves the staging file
behind. obstore's listing skips every file whose name is `<name>#<digits>`, so no reader
sees it, and neither does `gc`, which finds what to delete by listing: without
`sweep_partial` its space would never be freed. Stores that take an object in one
request (S3, GCS, Azure, memory) leave nothing of the kind.
"""

from __future__ import annotations

import logging
import os
import stat
import time

from hapi.data.store._location import check_key, local_path, resolves_under
from hapi.data.store.object_store import ObjectStore
from hapi.data.store.store import Store
from hapi.errors import InvalidRequest

__all__ = ["is_partial_name", "sweep_partial"]

log = logging.getLogger("hapi.data")


def is_partial_name(name: str) -> bool:
    """Whether a file name is one obstore's listing of a local directory leaves out: a
    `#` whose remainder is digits only. It splits at the first `#`, as obstore does, so
    `a.tar#k1` (a visible object named like a shard member) and `a#b#1` are not."""
    _, sep, suffix = name.partition("#")
    return bool(sep) and suffix.isascii() and suffix.isdigit()


def sweep_partial(
    store: ObjectStore, prefix: str, *, older_than_s: float, dry_run: bool = False
) -> int:
    """Remove the staging files of interrupted writes under `prefix` whose last write is
    at least `older_than_s` seconds old; return how many (found, with `dry_run`).

    Only a local directory store has such files; for any other store this is a no-op
    that returns 0. Only regular files on disk are candidates (never a symlink, never a
    shard member key such as `shards/a.tar#KEY`, which names no file), and nothing
    outside the store's root is touched.

    Args:
        store: the store.
        prefix: the folder to sweep, recursively (`""`: the whole store).
        older_than_s: the age below which a staging file may still be being written:
            it must exceed the longest pause of a live writer (see `gc.py`).
        dry_run: count, delete nothing.
    """
    if older_than_s < 0:
        raise InvalidRequest(f"older_than_s must be >= 0 seconds, got {older_than_s}")
    if not isinstance(store, Store) or not store.scheme.local:
        return 0
    prefix = prefix.strip("/")
    root = os.path.realpath(local_path(store.uri)).rstrip(os.sep) + os.sep
    if prefix:
        check_key(prefix)
        # A prefix linked out of the root is refused to every reader; never sweep there.
        if not resolves_under(root, prefix):
            return 0
    top = os.path.join(root, *prefix.split("/")) if prefix else root
    cutoff = time.time() - older_than_s
    count = 0
    # followlinks=False: a linked folder may lead out of the root.
    for folder, _, names in os.walk(top, followlinks=False):
        for name in names:
            if is_partial_name(name) and _remove_if_old(
                os.path.join(folder, name), cutoff, dry_run
            ):
                count += 1
    return count


def _remove_if_old(path: str, cutoff: float, dry_run: bool) -> bool:
    try:
        info = os.lstat(path)
        if not stat.S_ISREG(info.st_mode) or info.st_mtime > cutoff:
            return False
        if not dry_run:
            os.unlink(path)
        return True
    except FileNotFoundError:
        return False  # its writer renamed it into place, or another sweep removed it
    except OSError as exc:
        # Housekeeping: one file that cannot be removed must not fail the gc around it.
        log.warning("cannot remove the partial write %s: %s", path, exc)
        return False
