"""`EpochKeys`: which keys an epoch has, in which order and chunks, at which versions.

The loader's epoch order and its listing, apart from the loader, so that an epoch's run
can start the next epoch itself (`EpochRun`) without calling back into the loader.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from functools import cached_property
from typing import overload

import numpy as np

from hapi.client.pipeline._home_order import home_order
from hapi.client.pipeline.distributed import Shard
from hapi.data import DatasetManifest
from hapi.data.columns import Versions
from hapi.data.shards.order import shard_order, shard_runs
from hapi.errors import HapiError, shorten
from hapi.wire import SkippedKey

__all__ = ["Chunks", "EpochKeys"]

log = logging.getLogger("hapi.client")


class Chunks(Sequence[tuple[list[str], list[int]]]):
    """An epoch's chunks in order, each as (keys, labels), made as each is asked for:
    a million keys as Python strings take about 90 MB, and the epoch needs only the few
    chunks in flight at once.

    Args:
        manifest: the dataset's keys and labels.
        order: the epoch's order of manifest indices.
        bounds: where each chunk begins in `order`, and the end.
    """

    def __init__(self, manifest: DatasetManifest, order: np.ndarray, bounds: list[int]) -> None:
        self.manifest, self.order, self.bounds = manifest, order, bounds

    def __len__(self) -> int:
        return len(self.bounds) - 1

    @overload
    def __getitem__(self, j: int) -> tuple[list[str], list[int]]: ...
    @overload
    def __getitem__(self, j: slice) -> list[tuple[list[str], list[int]]]: ...
    def __getitem__(
        self, j: int | slice
    ) -> tuple[list[str], list[int]] | list[tuple[list[str], list[int]]]:
        if isinstance(j, slice):
            return [self[i] for i in range(len(self))[j]]
        if not -len(self) <= j < len(self):
            raise IndexError(f"chunk {j} of {len(self)}")
        j %= len(self)
        at = self.order[self.bounds[j] : self.bounds[j + 1]]
        return self.manifest.keys.take(at), self.manifest.labels.take(at)

    def indices(self, j: int) -> np.ndarray:
        """Chunk `j`'s places in the manifest."""
        j %= len(self)
        return self.order[self.bounds[j] : self.bounds[j + 1]]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(other) == len(self) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]


class EpochKeys:
    """An epoch's keys: the order (a permutation seeded by the job seed and the epoch),
    its chunks, and the objects' versions.

    Args:
        manifest: the dataset's keys and labels.
        seed: the job seed.
        shuffle: permute the keys each epoch (off for evaluation).
        chunk_size: keys per chunk.
        batch_size: the training batch size (a rank's, with a shard).
        shard: this rank's part of every epoch, with several data-parallel ranks.
        relist: lists the dataset again, for its objects' versions at each epoch's start
            (or just before: `list_ahead`).
        fresh_until: until when (`time.monotonic`) `manifest`'s versions stand for the
            first epoch's, without listing again (`CacheConfig.listing_fresh_s`); None:
            the first epoch lists.
        listing_s: how long a listing takes, where known (else guessed from the size).
        homes: each manifest key's home server, where servers say where keys lie
            (`Servers.place`; None: they cannot): a shuffled epoch's chunks are then each
            one server's keys where the shuffle allows (`home_order`).
    """

    def __init__(
        self,
        manifest: DatasetManifest,
        *,
        seed: int,
        shuffle: bool,
        chunk_size: int,
        batch_size: int,
        shard: Shard | None = None,
        relist: Callable[[], DatasetManifest] | None = None,
        fresh_until: float | None = None,
        listing_s: float = 0.0,
        homes: Callable[[], np.ndarray | None] | None = None,
    ) -> None:
        self.manifest, self.seed, self.shuffle = manifest, seed, shuffle
        self.homes = homes
        self.chunk_size, self.batch_size = chunk_size, batch_size
        self.shard, self.relist = shard, relist
        self._lock = threading.Lock()
        self._ahead: threading.Thread | None = None
        self._listed: Versions | None = None
        self._listing_s = listing_s
        self._orders: dict[int, np.ndarray] = {}
        """Orders computed, by epoch (a million keys take a second to order)."""
        self._listed_at = 0.0
        self._fresh_until = fresh_until if fresh_until is not None else -1.0

    @cached_property
    def _shards(self) -> np.ndarray | None:
        # Found once, not every epoch: a million keys take a second to split.
        return shard_runs(self.manifest.keys)

    def lost(self) -> list[SkippedKey]:
        """The samples damaged shards lost (`DatasetManifest.damaged`): skipped in every
        epoch, reported by one rank only."""
        if self.shard is not None and self.shard.rank != 0:
            return []
        return [
            SkippedKey(key=key, error="CorruptObject", message=damage.describe())
            for damage in self.manifest.damaged
            for key in damage.lost_keys()
        ]

    def order(self, epoch: int) -> np.ndarray:
        """The epoch's order of manifest indices (with a shard, this rank's part of it).

        A dataset of shards' members is ordered as WebDataset users expect (`shard_order`:
        shards shuffled, then samples a few shards at a time), in runs a chunk reads with
        one request."""
        with self._lock:
            known = self._orders.get(epoch)
        if known is not None:
            return known
        order = self._order(epoch)
        order.flags.writeable = False  # shared by every caller
        with self._lock:
            # The epoch running and the one started ahead: each asked for a few times.
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
            self._orders[epoch] = order
        return order

    def _order(self, epoch: int) -> np.ndarray:
        n = len(self.manifest)
        # Found for every order: chunks go to the servers they lie beside in any order.
        homes = self.homes() if self.homes is not None else None
        if not self.shuffle:
            order = np.arange(n)
        else:
            sharded = shard_order(
                self._shards,
                seed=self.seed,
                epoch=epoch,
                block=self.chunk_size,
                ranks=self.shard.world if self.shard is not None else 1,
                batch=self.batch_size,
            )
            if sharded is not None:
                order = sharded  # a shard's members lie together already
            else:
                order = np.random.default_rng([self.seed, epoch]).permutation(n)
                if homes is not None:
                    order = home_order(
                        order, homes, block=self.chunk_size, seed=self.seed, epoch=epoch
                    )
        return order if self.shard is None else self.shard.take(order, self.batch_size)

    def chunks(self, epoch: int, *, start: int = 0) -> Chunks:
        """The epoch's chunks in order from place `start` of its order on. Chunks keep the
        epoch's boundaries (multiples of `chunk_size`): a resumed epoch's first chunk is
        the rest of the one it stopped in, so a sharded dataset's chunks stay one block of
        one shard each (`hapi.data.shards.order`)."""
        order = self.order(epoch)
        size = self.chunk_size
        bounds = [start, *range(-(-start // size) * size, len(order), size), len(order)]
        kept = [a for a, b in itertools.pairwise(bounds) if b > a]
        return Chunks(self.manifest, order, [*kept, len(order)] if kept else [start])

    def versions(self) -> Versions | None:
        """The objects' versions for the epoch starting now: the listing `list_ahead`
        began (waited for if still running), else listed now. None: not listed - no
        `relist`, or the listing failed, and the epoch is then neither looked up in the
        cache nor kept."""
        if self.relist is None:
            return self.manifest.version_map()
        with self._lock:
            fresh, self._fresh_until = time.monotonic() < self._fresh_until, -1.0
            ahead, self._ahead = self._ahead, None
        if fresh and ahead is None:
            return self.manifest.version_map()  # the job's own listing, just made
        if ahead is None:
            return self._list()
        ahead.join()
        # A listing begun for an epoch that came later than expected (a job paused between
        # its fits) is too old to stand for this one's start: listed again.
        if time.monotonic() - self._listed_at > 3 * self._listing_s + 1.0:
            return self._list()
        return self._listed

    def list_ahead(self) -> None:
        """Begin listing the next epoch's versions in the background (once until
        `versions` takes it): called when the epoch before is about to end, so that its
        end does not wait for a listing of a million keys."""
        if self.relist is None:
            return
        with self._lock:
            if self._ahead is not None:
                return
            self._ahead = threading.Thread(target=self._list_into, name="hapi-list", daemon=True)
            self._ahead.start()

    @property
    def listing_s(self) -> float:
        """How long the last listing took (guessed from the dataset's size before the
        first: about 30 us a key through a server)."""
        return self._listing_s or 30e-6 * len(self.manifest)

    def _list_into(self) -> None:
        self._listed = self._list()
        self._listed_at = time.monotonic()

    def _list(self) -> Versions | None:
        assert self.relist is not None
        t0 = time.monotonic()
        try:
            listed = self.relist()
        except HapiError as exc:
            log.warning(
                "listing the dataset's versions failed (%s): this epoch does not use the "
                "feature cache",
                shorten(str(exc)),
            )
            return None
        finally:
            self._listing_s = time.monotonic() - t0
        versions = listed.version_map()
        if versions is None:
            return None
        known = self.manifest.version_map()
        if known is not None and listed.keys == self.manifest.keys:
            # The same keys (an Arrow compare, milliseconds): the job's index finds them.
            return Versions(self.manifest.keys, listed.versions, known.index)
        versions.index.ready()  # made here, ahead of the epoch, not on its path
        return versions
