"""`FeatureLoader`: the trainer's side of the pipeline.

It owns the epoch order (a seeded permutation) and keeps K chunks in flight per server,
each pushed down at the plan's cut or computed locally, handing batches on in epoch order
as they arrive; every key once per epoch, through retries, failover and re-plans. Why it
works the way it does - windows, reading in order, epochs back to back, the feature cache
- is in `docs/loader.md`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hapi.client.pipeline.distributed import Shard
from hapi.client.pipeline.epoch import EpochRun, LoaderStats, RunContext
from hapi.client.pipeline.fetch import FetchContext
from hapi.client.pipeline.history import Event, ignore_event
from hapi.client.pipeline.keys import Chunks, EpochKeys
from hapi.client.pipeline.rebatch import Batch, Convert
from hapi.client.pipeline.routing import Router
from hapi.client.pipeline.trainer_cache import TrainerCache
from hapi.client.servers.local import LocalCompute
from hapi.client.servers.pool import Servers
from hapi.client.servers.retry import RetryPolicy
from hapi.client.servers.sessions import Sessions
from hapi.client.servers.source import Server, recall_all
from hapi.data import DatasetManifest, ObjectStore
from hapi.data.columns import Versions
from hapi.errors import InvalidRequest
from hapi.graph import INPUT
from hapi.plan import HYBRID_LOCAL_WINDOW

__all__ = ["HYBRID_LOCAL_WINDOW", "FeatureLoader", "LoaderStats"]

# Called in the fetching thread after each part of a chunk is handed on: (chunk, keys).
OnPart = Callable[[int, list[str]], None]


@dataclass(frozen=True)
class LoaderPosition:
    """Where a loader's batches stand: places of `epoch`'s order handed on."""

    epoch: int = 0
    position: int = 0


class FeatureLoader:
    """Iterates an epoch's features in training batches.

    Args:
        connection: the server (with a session id; otherwise each `Sessions` names its own).
        session: the session id, the job's `Sessions` (one per cut, re-opened when lost),
            or one `Sessions` per server to spread the chunks over.
        manifest: the dataset's keys and labels.
        batch_size: the training batch size (the server picks its own batch size).
        chunk_size: keys per chunk request.
        prefetch: chunks in flight at once per server (K), local and pushed-down ones
            apart (a hybrid has up to 2K in flight).
        seed: the job seed; the epoch order is a permutation seeded by (seed, epoch).
        shuffle: permute the keys each epoch (off for evaluation).
        retries: at most this many retries per chunk (None: as the budget allows).
        retry_budget_s: seconds a failing chunk is retried before the epoch fails.
        cut: the session's cut, with a session id (it only labels the features).
        router: routes each chunk (pushed down or local), built with these servers'
            `recall_all` as its `recall`; default: all pushed down at `cut`.
        local: computes local chunks from raw bytes; needed by a router with local chunks.
        convert: carries features to a later cut (`ModelGraph.segment`), for plans whose
            cut changes mid-epoch.
        record: receives an `Event` for each retry.
        on_part: called in the fetching thread after each part of a chunk is handed on.
        shard: with several data-parallel ranks, this rank's part of every epoch: the
            loader fetches and yields only it (`batch_size` is then per rank).
        fallback: the store, as this trainer reaches it: while no server answers, chunks
            are read from it and computed here by `local`. None: they wait for a server.
        cache: the trainer's feature cache for this loop: cached samples come from it,
            the others are kept in it as they arrive. None: no cache.
        relist: lists the dataset again, for its objects' versions at the start of each
            epoch (tickets carry them, and the cache keys entries by them).
        fresh_until: until when (`time.monotonic`) the first epoch takes `manifest`'s
            versions instead of listing again; None: it lists.
        listing_s: how long a listing takes, where known: the next epoch's listing
            begins that much before this one ends (`EpochKeys.list_ahead`).
        homes: each manifest key's home server as an earlier loop of the job found them
            (`homes()`): its shuffled epochs are grouped by these, not found again.

    Raises:
        InvalidRequest: a size below 1, negative retries or budget.
    """

    def __init__(
        self,
        connection: Server,
        session: str | Sessions | Sequence[Sessions],
        manifest: DatasetManifest,
        *,
        batch_size: int,
        chunk_size: int = 64,
        prefetch: int = 4,
        seed: int = 0,
        shuffle: bool = True,
        retries: int | None = None,
        retry_budget_s: float = 60.0,
        cut: int = INPUT,
        router: Router | None = None,
        local: LocalCompute | None = None,
        convert: Convert | None = None,
        record: Callable[[Event], None] | None = None,
        on_part: OnPart | None = None,
        shard: Shard | None = None,
        fallback: ObjectStore | None = None,
        cache: TrainerCache | None = None,
        relist: Callable[[], DatasetManifest] | None = None,
        fresh_until: float | None = None,
        listing_s: float = 0.0,
        homes: np.ndarray | None = None,
    ) -> None:
        _check_sizes(batch_size=batch_size, chunk_size=chunk_size, prefetch=prefetch)
        self.retry = RetryPolicy(budget_s=retry_budget_s, retries=retries)
        self.connection = connection
        self.servers = _servers(connection, session, cut)
        self.manifest = manifest
        self.batch_size = batch_size
        self.chunk_size = chunk_size
        self.prefetch = prefetch
        self.seed = seed
        self.shuffle = shuffle
        self.router = router if router is not None else self._pushdown_router(cut, record)
        self.local = local
        self.convert = convert
        self.record = record
        self.on_part = on_part
        self.shard = shard
        self.fallback = fallback
        self.cache = cache
        self.relist = relist
        self._given_homes = homes if homes is not None and len(homes) == len(manifest) else None
        self.stats = LoaderStats()
        self.context = self._fetch_context()
        """What fetching needs of this loader, fixed for its life."""
        self.keys = self._epoch_keys(fresh_until=fresh_until, listing_s=listing_s)
        """Each epoch's order, chunks and objects' versions."""
        self._runs = RunContext(
            fetch=self.context, keys=self.keys, batch_size=batch_size, prefetch=prefetch
        )
        self._run: EpochRun | None = None
        """The last epoch asked for: it may have started the next one (`ahead`)."""
        self._at = LoaderPosition()
        """Where the batches handed on stand (`state_dict`)."""

    def _pushdown_router(self, cut: int, record: Callable[[Event], None] | None) -> Router:
        """The default router: every chunk pushed down at `cut`, recalled on all servers."""
        return Router(
            cut,
            record=record if record is not None else ignore_event,
            recall=functools.partial(recall_all, [m.connection for m in self.servers]),
        )

    def _fetch_context(self) -> FetchContext:
        """What fetching needs of this loader, from its servers, router and settings."""
        return FetchContext(
            servers=self.servers,
            retry=self.retry,
            router=self.router,
            local=self.local,
            convert=self.convert,
            cache=self.cache,
            fallback=self.fallback,
            record=self.record if self.record is not None else ignore_event,
            on_part=self.on_part,
        )

    def _epoch_keys(self, *, fresh_until: float | None, listing_s: float) -> EpochKeys:
        """Each epoch's order, chunks and versions of this loader's manifest (and shard)."""
        return EpochKeys(
            self.manifest,
            seed=self.seed,
            shuffle=self.shuffle,
            chunk_size=self.chunk_size,
            batch_size=self.batch_size,
            shard=self.shard,
            relist=self.relist,
            fresh_until=fresh_until,
            listing_s=listing_s,
            homes=self.homes,
        )

    def homes(self) -> np.ndarray | None:
        """Each manifest key's home server, by which shuffled epochs are grouped: those
        an earlier loop of the job found (`homes=`), else where the servers say now
        (found once); None where they cannot. A job keeps them, so that an epoch resumed
        later - servers down, volumes moved - has the order it was interrupted in."""
        placement = self.servers.place(self.manifest.keys)  # for routing, either way
        if self._given_homes is not None:
            return self._given_homes
        return placement.homes if placement is not None else None

    @property
    def sessions(self) -> Sessions:
        """The first server's sessions (the only one's, with one server)."""
        return self.servers.members[0].sessions

    def __len__(self) -> int:
        """Training batches per epoch (the last one may be smaller); with a shard, the
        steps every rank takes (a rank whose shard ran out has fewer batches)."""
        if self.shard is not None:
            return self.shard.steps(len(self.manifest), self.batch_size)
        return -(-len(self.manifest) // self.batch_size)

    def order(self, epoch: int) -> np.ndarray:
        """The epoch's order of manifest indices (with a shard, this rank's part of it):
        `EpochKeys.order`."""
        return self.keys.order(epoch)

    def chunks(self, epoch: int, *, start: int = 0) -> Chunks:
        """The epoch's chunks in order, each as (keys, labels), from place `start` of its
        order on: `EpochKeys.chunks`."""
        return self.keys.chunks(epoch, start=start)

    @property
    def ahead(self) -> EpochRun | None:
        """The next epoch, started while the last one asked for drained (None: none)."""
        return self._run.ahead if self._run is not None else None

    def epoch(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield `(features, labels)` training batches of one epoch (see `batches`)."""
        for batch in self.batches(epoch):
            yield batch.features, batch.labels

    def state_dict(self) -> dict[str, int]:
        """Where the batches handed on stand, as torchdata's `Loader.state_dict`: the
        epoch, and the places of its order handed on so far (after an epoch's last
        batch: the next epoch, at 0). `load_state_dict` of it makes `batches` of that
        epoch go on from there, as if never stopped."""
        return {"epoch": self._at.epoch, "position": self._at.position}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Go on from a `state_dict()`: the next `batches` of its epoch, given no
        `start`, leaves out the places it had handed on.

        Raises:
            InvalidRequest: not a loader's state.
        """
        try:
            at = LoaderPosition(int(state["epoch"]), int(state["position"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequest(
                f"not a FeatureLoader state ({exc!r}): pass what loader.state_dict() returned"
            ) from None
        if at.epoch < 0 or at.position < 0:
            raise InvalidRequest(f"a loader state's epoch and position are >= 0, got {state}")
        self._at = at

    def batches(
        self, epoch: int, *, start: int | None = None, then: int | None = None
    ) -> Iterator[Batch]:
        """Yield the epoch's training batches, each at one cut, in epoch order.

        `start` resumes an epoch: its order's first `start` places are left out (they
        were trained before an interruption). At a multiple of `batch_size` the batches
        are those the whole epoch would have had from there on. None: where
        `state_dict` stands, if that is in this epoch, else 0.

        `then` is the epoch the caller asks for next: its first chunks are fetched while
        this one drains (see the module's note). Asked for anything else next, they are
        dropped, and `close` drops them when no next epoch comes.

        The time the caller spends between batches is the trainer's time on them (the
        tail, the optimizer step), measured here for the plan's stage times.

        Raises:
            HapiError: a chunk failed for good, as the server's error (`CorruptObject`
                naming the key, `ServerUnavailable` after the retry budget, ...).
            DuplicateDelivery: a key arrived twice.
            IncompleteEpoch: keys went missing.
            NotDecoded: raw bytes arrived for a chunk routed as pushed down.
        """
        samples = len(self.order(epoch))
        if start is None:
            start = self._at.position if self._at.epoch == epoch else 0
        if not 0 <= start <= samples:
            raise InvalidRequest(f"start must be 0..{samples} (the epoch's samples), got {start}")
        run = self._run.take_ahead() if self._run is not None else None
        if run is not None and (run.epoch != epoch or start):
            run.shutdown()
            run = None
        if run is None:
            chunks = self.keys.chunks(epoch, start=start)
            versions = self.keys.versions()
            self.router.start(epoch, len(chunks))
            run = EpochRun(self._runs, epoch, chunks, versions=versions)
        self._run = run
        run.then = then
        self.stats = run.stats
        self._at = LoaderPosition(epoch, start)
        return self._handed_on(epoch, run.run())

    def _handed_on(self, epoch: int, batches: Generator[Batch, None, None]) -> Iterator[Batch]:
        """`batches`, moving `state_dict`'s position past each batch as it is handed on.

        Batches hold consecutive places of the order (chunks are consecutive, and every
        key arrives once or the epoch fails), so a count of keys is the position."""
        with contextlib.closing(batches):
            for batch in batches:
                self._at = LoaderPosition(epoch, self._at.position + len(batch.keys))
                yield batch
        self._at = LoaderPosition(epoch + 1, 0)

    def recall(self) -> None:
        """Cut every server's chunk streams in flight (`Router.recall`): each chunk asks
        again for the keys it has not delivered."""
        self.router.recall()

    def close(self) -> None:
        """Stop fetching a next epoch that was started ahead and will not be asked for."""
        if self._run is not None:
            self._run.drop_ahead()

    def versions(self) -> Versions | None:
        """The objects' versions, listed now: `EpochKeys.versions`."""
        return self.keys.versions()


def _check_sizes(**sizes: int) -> None:
    """Refuse a size below 1 (InvalidRequest), naming it."""
    for name, value in sizes.items():
        if value < 1:
            raise InvalidRequest(f"{name} must be >= 1, got {value}")


def _servers(connection: Server, session: str | Sessions | Sequence[Sessions], cut: int) -> Servers:
    """The servers chunks go to: one session id on `connection`, one `Sessions` or several."""
    if isinstance(session, str):
        session = Sessions.fixed(connection, session, cut)
    return Servers([session] if isinstance(session, Sessions) else session)
