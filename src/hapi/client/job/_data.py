"""The job's data side: its servers, the datasets they list, the trainer's feature cache,
and the loader of one loop over a dataset."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from hapi.cache import Cacheability, FeatureCache, cacheability
from hapi.client.config.job import JobConfig
from hapi.client.job._model import JobModel
from hapi.client.job.session_requests import SessionRequests
from hapi.client.pipeline.distributed import Shard
from hapi.client.pipeline.history import Event
from hapi.client.pipeline.loader import FeatureLoader
from hapi.client.pipeline.routing import Router
from hapi.client.pipeline.trainer_cache import TrainerCache, head_content_digest, loop_space
from hapi.client.planning.codec_choice import Codec, loop_codec
from hapi.client.servers.connection import Connection, connect
from hapi.client.servers.decode import RawDecoder
from hapi.client.servers.local import LocalCompute
from hapi.client.servers.retry import RETRYABLE, RetryPolicy
from hapi.client.servers.sessions import Sessions
from hapi.client.servers.source import Server, recall_all
from hapi.data import DatasetManifest, Transforms, open_store
from hapi.errors import ServerUnavailable
from hapi.wire import WireDtype

__all__ = ["JobData", "connect_all"]


def connect_all(config: JobConfig, given: str | Connection | Sequence[str]) -> list[Connection]:
    """One connection per server of `config`, in its order: `given` itself when the user
    passed a `Connection`."""
    if isinstance(given, Connection):
        return [given]
    auth = config.connect
    return [
        connect(
            address,
            token=auth.token,
            tls_ca=auth.tls_ca,
            tls_cert=auth.tls_cert,
            tls_key=auth.tls_key,
        )
        for address in config.servers
    ]


class JobData:
    """Where a job's data comes from.

    Args:
        config: the job's options.
        connections: one per server, in the order given.
        model: the job's model side (sessions name its head; local chunks run it).
        record: receives the loops' events (a lost session opened again among them).
    """

    def __init__(
        self,
        config: JobConfig,
        connections: list[Connection],
        model: JobModel,
        *,
        record: Callable[[Event], None],
    ) -> None:
        self.config, self.connections, self.model = config, connections, model
        self.record = record
        fetch = config.fetch
        self.fallback = (
            open_store(fetch.store, fetch.store_options, create=False)
            if fetch.store is not None
            else None
        )
        """The store, read directly while no server answers (`FetchConfig.store`)."""
        self.recall = functools.partial(recall_all, connections)
        """Cuts the streams in flight on every server: a loop's router's `recall`."""
        self._manifests: dict[str, DatasetManifest] = {}
        self._listed: dict[str, tuple[float, float]] = {}
        """When `manifest` listed each prefix (`time.monotonic`), and how long it took."""
        self._fresh: set[str] = set()
        """Prefixes whose listing no loop has taken yet for its first epoch's versions."""
        self._head_digest: str | None = None
        self._features: FeatureCache | None = None
        """The trainer's feature cache, opened by the first loop that uses it."""

    def manifest(self, prefix: str) -> DatasetManifest:
        """The dataset under `prefix`, listed once by a server (or from the store itself
        while none answers), retried within `retry_budget_s`.

        Raises:
            ServerUnavailable, StoreUnavailable: no listing within the retry budget.
            CorruptObject: a shard breaks off before its end (an upload cut short) and
                `on_error="raise"`; under `"skip"` its complete samples train and each
                epoch reports the lost ones in `skipped`.
        """
        if prefix not in self._manifests:
            t0 = time.monotonic()
            for attempt in RetryPolicy(budget_s=self.config.fetch.retry_budget_s).retrying():
                with attempt:
                    listed = self.list(prefix)
            if listed.damaged and self.config.fetch.on_error == "raise":
                raise listed.damaged[0].error()
            self._manifests[prefix] = listed
            now = time.monotonic()
            self._listed[prefix] = (now, now - t0)
            self._fresh.add(prefix)
        return self._manifests[prefix]

    def list(self, prefix: str) -> DatasetManifest:
        """The dataset under `prefix`, listed now, once (no retry)."""
        try:
            return self.from_any(lambda c: c.manifest(prefix))
        except RETRYABLE:
            if self.fallback is None:
                raise
            return DatasetManifest.from_store(self.fallback, prefix)

    def from_any(self, call: Callable[[Connection], Any]) -> Any:
        """`call` on the first server that answers (any of them has the whole store).

        Raises:
            ServerUnavailable: none answered (the last one's error).
        """
        for connection in self.connections[:-1]:
            with contextlib.suppress(ServerUnavailable):
                return call(connection)
        return call(self.connections[-1])

    def requests(
        self,
        transforms: Transforms,
        connection: Server | None = None,
        codec: Codec | None = None,
    ) -> SessionRequests:
        """The session requests of a loop with `transforms`, on `connection`'s server
        (default: the first), its features sent with `codec` (default: the job's own, as
        the planner's probes are)."""
        config, wire = self.config, self.config.wire
        return SessionRequests(
            connection=connection or self.connections[0],
            model=self.model.wire_name(),
            freeze=self.model.freeze,
            transforms=transforms,
            image_size=config.data.image_size,
            codec=codec or loop_codec(wire.dtype, wire.compression, None),
            seed=config.training.seed,
            on_error=config.fetch.on_error,
            exact=wire.exact,
            head_dtype=wire.head_dtype,
        )

    def trainer_cache(
        self, transforms: Transforms, wire_dtype: WireDtype | None = None
    ) -> TrainerCache | None:
        """The trainer's feature cache for a loop with `transforms` whose features travel
        as `wire_dtype` (default the job's), if its features repeat."""
        config = self.config
        dtype = wire_dtype or config.wire.dtype
        if not config.cache.enabled or not cacheability(transforms).cacheable:
            return None
        if self._features is None:
            self._features = FeatureCache(config.cache.dir, max_bytes=config.cache.max_bytes)
        model = self.model
        if self._head_digest is None:
            # Once: the head is frozen, and hashing a large one's weights takes a while.
            self._head_digest = head_content_digest(model.graph.head(model.freeze))
        space = loop_space(
            # A bf16 head's features are another space's: never served to an fp32 job.
            self._head_digest + ("/bf16" if config.wire.head_dtype == "bf16" else ""),
            model.freeze,
            transforms,
            wire_dtype=dtype,
            exact=config.wire.exact,
            seed=config.training.seed,
        )
        return TrainerCache(self._features, space, transforms, dtype)

    def cacheability(self) -> Cacheability:
        """Whether the training features repeat between epochs (and are cached), and why."""
        found = cacheability(self.config.train_transforms)
        if found.cacheable and not self.config.cache.enabled:
            return Cacheability(False, "not cached: cache=False")
        return found

    def all_cached(self, epoch: int) -> bool:
        """Whether the trainer's cache holds every feature of training epoch `epoch`."""
        cache = self.trainer_cache(self.config.train_transforms)
        if cache is None:
            return False
        manifest = self.manifest(self.config.dataset)
        versions = manifest.version_map()
        if versions is None:
            return False
        cache.set_versions(epoch, versions)
        return cache.holds(epoch, manifest.keys)

    @contextlib.contextmanager
    def loader(
        self,
        prefix: str,
        transforms: Transforms,
        *,
        train: bool,
        router: Router,
        codec: Codec,
        shard: Shard | None = None,
        homes: np.ndarray | None = None,
    ) -> Iterator[FeatureLoader]:
        """The loader of one loop over `prefix`, its sessions closed when it ends.

        Args:
            train: shuffle each epoch (off for evaluation).
            router: the loop's routes (the plan in force).
            codec: taken once per loop: its sessions, local chunks and cache agree on it.
            shard: the part of each epoch to fetch; None: the data-parallel rank's, or all.
            homes: the keys' homes an earlier loop found (`FeatureLoader.homes`).
        """
        config, model = self.config, self.model
        fetch, seed, exact = config.fetch, config.training.seed, config.wire.exact
        sessions = self._loop_sessions(transforms, codec, router=router, train=train)
        decoder = RawDecoder(transforms, seed, fetch.on_error)
        manifest = self.manifest(prefix)
        listed_at, listing_s = self._listed[prefix]
        fresh = prefix in self._fresh
        self._fresh.discard(prefix)
        loader = FeatureLoader(
            self.connections[0],
            sessions,
            manifest,
            cache=self.trainer_cache(transforms, codec[0]),
            # Listed again each epoch only where a feature may be cached: a rewritten
            # object is then a miss, never a stale hit.
            relist=(
                functools.partial(self.list, prefix) if cacheability(transforms).cacheable else None
            ),
            # The first loop over a prefix may take its listing for its first epoch.
            fresh_until=listed_at + config.cache.listing_fresh_s if fresh else None,
            listing_s=listing_s,
            batch_size=config.training.batch_size,
            chunk_size=fetch.chunk_size,
            prefetch=fetch.prefetch,
            seed=seed,
            shuffle=train,
            retry_budget_s=fetch.retry_budget_s,
            router=router,
            local=LocalCompute(decoder, model.graph.head, codec[0], model.device, exact=exact),
            convert=model.parts.convert,
            record=self.record,
            shard=shard if shard is not None else model.dp.shard if model.dp is not None else None,
            fallback=self.fallback,
            homes=homes,
        )
        with loader.servers:
            try:
                yield loader
            finally:
                loader.close()

    def _loop_sessions(
        self, transforms: Transforms, codec: Codec, *, router: Router, train: bool
    ) -> Sequence[Sessions]:
        """One `Sessions` per server for a loop; each records an event when it re-opens a
        session the server had lost."""

        def reopened(cut: int, lost: str, new: str) -> None:
            self.record(
                Event(
                    "reopen",
                    router.epoch if train else None,
                    None,
                    f"the server had lost the session for cut {cut} (restarted?): re-opened",
                    {"cut": cut, "lost": lost, "session": new},
                )
            )

        return [
            Sessions(connection, self.requests(transforms, connection, codec), on_reopen=reopened)
            for connection in self.connections
        ]
