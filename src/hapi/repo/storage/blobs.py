"""Reading tensor blobs by content hash, following delta blobs to their bases.

A delta blob (see `codec.py`) decodes only with its base tensor, which may itself be a
delta. The blobs asked for are fetched in one batch, then each level of bases the batch
lacks in another, so a chain of depth N costs N + 1 round trips whatever the number of
tensors. Bases are decoded before the deltas on them, each once, and dropped once used;
a compressed base stays in byte planes (a delta is undone plane by plane). Only the
tensors asked for are re-hashed, since a delta whose base was wrong cannot hash right.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import cast

import torch

from hapi.data.store import ObjectStore
from hapi.errors import IntegrityError, ObjectNotFound, UnknownCodec
from hapi.repo.storage.codec import Base, BlobInfo, read_info
from hapi.repo.storage.layout import tensor_key
from hapi.repo.storage.tensors import decode_base, decode_blob

__all__ = ["MAX_CHAIN", "Decoded", "read_blobs"]

MAX_CHAIN = 64
"""Deltas followed before a chain is called corrupt; writers stop far below it
(`RepoConfig.max_delta_depth`), so only a corrupt or hostile store reaches it."""

# Below this many bytes in all, decoding inline beats starting a pool of threads.
_INLINE_BYTES = 1 << 20


@dataclass(frozen=True)
class Decoded:
    """A tensor read from the store."""

    tensor: torch.Tensor
    depth: int
    """Deltas between this blob and a blob that decodes alone (0: it decodes alone)."""


def read_blobs(
    store: ObjectStore,
    digests: Iterable[str],
    *,
    what: Callable[[str], str],
    verify: bool = True,
    concurrency: int = 16,
) -> dict[str, Decoded]:
    """The tensors with content hashes `digests`, each blob read once.

    Args:
        store: the repository's store.
        digests: the tensors' content hashes.
        what: names a tensor in errors, given its hash (`'fc.weight' of resnet50@3`).
        verify: re-hash each tensor asked for.
        concurrency: blobs decoded at once.

    Raises:
        IntegrityError: a blob, or the base of a delta, is missing or corrupt.
        UnknownCodec: a blob is compressed with a codec this hapi cannot read.
    """
    wanted = list(dict.fromkeys(digests))
    data: dict[str, bytes] = {}
    infos: dict[str, BlobInfo] = {}
    user: dict[str, str] = {}  # a base -> the delta that needs it, for messages
    frontier = wanted
    for _ in range(MAX_CHAIN + 1):
        if not frontier:
            break
        following: list[str] = []
        for digest, blob in zip(
            frontier, store.get_many(tensor_key(d) for d in frontier), strict=True
        ):
            if isinstance(blob, ObjectNotFound):
                raise IntegrityError(_missing(digest, user, what))
            if isinstance(blob, BaseException):
                raise blob
            data[digest] = blob
            try:
                infos[digest] = info = read_info(blob)
            except UnknownCodec as exc:
                name = _name(digest, user, what)
                raise UnknownCodec(f"tensor {name} (blob {digest[:12]}): {exc}") from None
            except IntegrityError:
                # decode_blob words the same problem with the tensor's name and the fix.
                decode_blob(blob, digest, _name(digest, user, what), verify=False)
                raise
            base = info.base
            if base is not None and base not in data and base not in following:
                user[base] = digest
                following.append(base)
        frontier = following
    else:
        raise IntegrityError(
            f"tensor {what(wanted[0])}: a chain of more than {MAX_CHAIN} deltas; the store "
            "is corrupt. Run `hapi repo fsck`"
        )
    return _decode(data, infos, set(wanted), user, what, verify, concurrency)


def _decode(
    data: dict[str, bytes],
    infos: dict[str, BlobInfo],
    wanted: set[str],
    user: dict[str, str],
    what: Callable[[str], str],
    verify: bool,
    concurrency: int,
) -> dict[str, Decoded]:
    done: dict[str, _Held] = {}
    uses = {d: 0 for d in data}
    for info in infos.values():
        if info.base is not None:
            uses[info.base] += 1
    total = sum(len(b) for b in data.values())
    workers = 1 if concurrency == 1 or total < _INLINE_BYTES else min(concurrency, len(data))
    pool = ThreadPoolExecutor(workers, "hapi-repo-decode") if workers > 1 else None

    def one(digest: str) -> _Held:
        info = infos[digest]
        base = done[info.base] if info.base is not None else None
        below = None if base is None else base.value
        depth = 0 if base is None else base.depth + 1
        name = _name(digest, user, what)
        blob = data[digest]
        if digest not in wanted:
            return _Held(decode_base(blob, digest, name, base=below, info=info), depth)
        return _Held(decode_blob(blob, digest, name, verify=verify, base=below, info=info), depth)

    finished: set[str] = set()
    pending = list(data)
    try:
        while pending:
            # Bases before the deltas on them: each round decodes what is ready.
            ready = [d for d in pending if infos[d].base is None or infos[d].base in finished]
            # Largest first, so the threads finish together instead of one decoding the
            # last big tensor while the others idle (a head's big tensors come last).
            ready.sort(key=lambda d: len(data[d]), reverse=True)
            if not ready:
                raise IntegrityError(
                    f"tensor {what(next(iter(wanted)))}: its deltas form a cycle; the store is "
                    "corrupt. Run `hapi repo fsck`"
                )
            results = pool.map(one, ready) if pool is not None else map(one, ready)
            for digest, decoded in zip(ready, results, strict=True):
                done[digest] = decoded
                finished.add(digest)
                data[digest] = b""  # decoded: drop the blob's bytes
            for digest in ready:
                base = infos[digest].base
                if base is not None:
                    uses[base] -= 1
                    if uses[base] == 0 and base not in wanted:
                        del done[base]  # every delta on it is decoded: free it
            pending = [d for d in pending if d not in finished]
    finally:
        if pool is not None:
            pool.shutdown()
    # A blob asked for is decoded by decode_blob, into a tensor.
    return {d: Decoded(cast(torch.Tensor, done[d].value), done[d].depth) for d in wanted}


@dataclass(frozen=True)
class _Held:
    """A blob decoded in this read: a tensor asked for, or a base's tensor or planes."""

    value: Base
    depth: int


def _name(digest: str, user: dict[str, str], what: Callable[[str], str]) -> str:
    chain = digest
    while chain in user:
        chain = user[chain]
    if chain == digest:
        return what(digest)
    return f"{what(chain)} (its delta base {digest[:12]})"


def _missing(digest: str, user: dict[str, str], what: Callable[[str], str]) -> str:
    return (
        f"tensor {_name(digest, user, what)} is missing from the store (blob {digest[:12]}): "
        "the repository lost it; push the model again to restore it"
    )
