"""A chunk's samples, from object bytes to model inputs: the one pipeline both tiers run.

A chunk gives the same inputs wherever it is computed: on a server next to the data, or in
the trainer from raw bytes (the local baseline, a fallback). Both run `load_samples`, so
there is one copy of read -> decode -> seed -> transform -> skip-or-raise to keep right.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Generator, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, cast

import torch

from hapi.data.images import load_sample
from hapi.data.shards.blob import Blob
from hapi.data.shards.members import MemberStore, split_member
from hapi.data.store import ObjectStore
from hapi.data.transforms import Transforms
from hapi.errors import HapiError

__all__ = [
    "Sample",
    "Skipped",
    "load_one",
    "load_samples",
    "read_objects",
    "skip_or_raise",
]


@dataclass(frozen=True)
class Sample:
    """One key's model input, a float32 CHW tensor."""

    key: str
    label: int
    tensor: torch.Tensor


@dataclass(frozen=True)
class Skipped:
    """A key left out, and the error that made it so."""

    key: str
    error: HapiError


def skip_or_raise(key: str, exc: BaseException, *, skip: bool) -> Skipped:
    """What to do with a key whose object failed: leave it out (`skip`) or fail with `exc`.

    Only hapi's own errors (a missing or corrupt object, ...) are skipped: anything else
    is a fault of the program, not of the data, and is raised whatever `skip` says.
    """
    if skip and isinstance(exc, HapiError):
        return Skipped(key, exc)
    raise exc


def read_objects(
    store: ObjectStore, keys: Sequence[str], *, ahead: int = 16, max_bytes: int | None = None
) -> Generator[Blob | BaseException, None, None]:
    """Each key's bytes, in order, or the exception its read raised (a shard's member is
    a view of the response it came in, `Blob`).

    Reads run `ahead` at a time in threads, so decoding overlaps reading and a chunk holds
    about `ahead` objects in memory, not all of them; with `max_bytes`, no new read starts
    while the objects read and not yet taken pass that many bytes (large objects). Reads
    start at the first `next`, and closing the iterator early cancels those not started.
    """
    if not keys:
        return
    members = _members(store, keys)
    if members is not None:
        # A shard's members close together are read with one request (`MemberStore`).
        yield from members.read(keys, ahead=ahead, max_bytes=max_bytes)
        return
    # A task reads a run of keys: a future and a thread hand-off per object cost more than
    # reading a small object from a local disk (8-9% of a server's GIL samples on 1 KB
    # JPEGs, docs/server-profile.md). Up to 4 runs are read at once, `ahead` objects in
    # all; under `max_bytes`, a run is as long as 4 of them stay within it at the objects'
    # mean size so far.
    most = max(1, ahead // 4)
    tasks = max(1, ahead // most)
    limit = max_bytes if max_bytes is not None else float("inf")
    queue = iter(keys)
    read_bytes = read_objects_count = 0

    def next_run() -> list[str]:
        size = most
        if max_bytes is not None:
            mean = read_bytes / read_objects_count if read_objects_count else float("inf")
            size = int(max(1, min(most, max_bytes // max(4 * mean, 1))))
        return list(itertools.islice(queue, size))

    with ThreadPoolExecutor(min(tasks, len(keys)), thread_name_prefix="hapi-read") as pool:
        pending: deque[Future[list[bytes | BaseException]]] = deque()
        try:
            while True:
                while len(pending) < tasks and _buffered(pending) < limit:
                    run = next_run()
                    if not run:
                        break
                    pending.append(pool.submit(_read_run, store, run))
                if not pending:
                    break
                results = pending.popleft().result()
                for result in results:
                    if isinstance(result, bytes):
                        read_bytes += len(result)
                        read_objects_count += 1
                yield from results
        finally:
            for future in pending:
                future.cancel()


def load_one(
    key: str,
    label: int,
    data: Blob | BaseException,
    transforms: Transforms,
    *,
    seed: int,
    epoch: int,
    skip: bool,
    finish: bool = True,
) -> Sample | Skipped:
    """Decode and transform one key's object (or the exception reading it raised); see
    `load_samples`, which runs this for each key. `finish=False`: its tensor as
    `Transforms.prepare` gives it, for `Transforms.finish` with its batch.

    Raises:
        HapiError: a missing or corrupt object when not `skip`, naming the key.
    """
    try:
        if isinstance(data, BaseException):
            raise data
        drawn = transforms.seed(seed, epoch, key)
        tensor = load_sample(data, key, transforms, drawn, finish=finish)
    except Exception as exc:
        return skip_or_raise(key, exc, skip=skip)
    return Sample(key, label, tensor)


def load_samples(
    keys: Sequence[str],
    labels: Sequence[int],
    objects: Iterable[Blob | BaseException],
    transforms: Transforms,
    *,
    seed: int,
    epoch: int,
    skip: bool,
    finish: bool = True,
) -> Iterator[Sample | Skipped]:
    """Decode and transform each key's object into its model input, in order.

    Args:
        keys: the chunk's keys.
        labels: their labels.
        objects: each key's bytes, or the exception reading it raised (`read_objects`).
        transforms: the pipeline; random ops draw from `sample_seed(seed, epoch, key)`.
        seed: the job seed.
        epoch: the epoch, so augmentations differ between epochs.
        skip: leave out keys whose object is missing or corrupt (yielding `Skipped`)
            instead of raising.
        finish: False: each tensor as `Transforms.prepare` gives it, for
            `Transforms.finish` to convert with the others (`load_one`).

    Raises:
        HapiError: a missing or corrupt object when not `skip`, naming the key.
    """
    for key, label, data in zip(keys, labels, objects, strict=True):
        yield load_one(
            key, label, data, transforms, seed=seed, epoch=epoch, skip=skip, finish=finish
        )


class MemberReader(Protocol):
    """Reads shard members, those close together in one request (`MemberStore.read`)."""

    def read(
        self, keys: Sequence[str], *, ahead: int = 16, max_bytes: int | None = None
    ) -> Iterator[Blob | BaseException]: ...


def _members(store: ObjectStore, keys: Sequence[str]) -> MemberReader | None:
    if not any(split_member(k) is not None for k in keys):
        return None
    if isinstance(store, MemberStore):
        return store
    # A `Store`, or a wrapper that reads members as one does (the server's feature cache
    # reads them noting their versions).
    members = getattr(store, "members", None)
    return cast(MemberReader, members) if members is not None else None


def _read(store: ObjectStore, key: str) -> bytes | BaseException:
    try:
        return store.get(key)
    except Exception as exc:
        return exc


def _read_run(store: ObjectStore, keys: Sequence[str]) -> list[bytes | BaseException]:
    return [_read(store, key) for key in keys]


def _buffered(pending: deque[Future[list[bytes | BaseException]]]) -> int:
    return sum(len(r) for f in pending if f.done() for r in f.result() if isinstance(r, bytes))
