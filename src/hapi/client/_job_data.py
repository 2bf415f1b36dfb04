"""The job's data side: its servers, the datasets they list, the trainer's feature cache,
and the loader of one loop over a dataset."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from hapi._sizes import parse_bytes
from hapi.cache import FeatureCache, cacheability
from hapi.client._codec_choice import Codec, loop_codec
from hapi.client._decode import RawDecoder
from hapi.client._job_model import JobModel
from hapi.client._trainer_cache import TrainerCache, head_content_digest, loop_space
from hapi.client.connection import Connection, connect
from hapi.client.history import Event
from hapi.client.job_config import JobConfig
from hapi.client.loader import FeatureLoader
from hapi.client.local import LocalCompute
from hapi.client.retry import RETRYABLE, RetryPolicy
from hapi.client.routing import Router
from hapi.client.sessions import OnReopen, Sessions
from hapi.data import DatasetManifest, Transforms, open_store
from hapi.errors import ServerUnavailable
from hapi.graph import RAW
from hapi.wire import SessionRequest, WireDtype

__all__ = ["JobData", "connect_all"]


def connect_all(config: JobConfig, given: str | Connection | Sequence[str]) -> list[Connection]:
    """One connection per server of `config`, in its order: `given` itself when the user
    passed a `Connection`."""
    if isinstance(given, Connection):
        return [given]
    return [
        connect(
            address,
            token=config.token,
            tls_ca=config.tls_ca,
            tls_cert=config.tls_cert,
            tls_key=config.tls_key,
        )
        for address in config.servers
    ]


class JobData:
    """Where a job's data comes from.

    Args:
        config: the job's options.
        connections: one per server, in the order given.
        model: the job's model side (sessions name its head; local chunks run it).
        record: receives the loops' events.
        on_reopen: called when a lost session was opened again.
    """

    def __init__(
        self,
        config: JobConfig,
        connections: list[Connection],
        model: JobModel,
        *,
        record: Callable[[Event], None],
        on_reopen: OnReopen,
    ) -> None:
        self.config, self.connections, self.model = config, connections, model
        self.record, self.on_reopen = record, on_reopen
        self.fallback = (
            open_store(config.store, config.store_options, create=False)
            if config.store is not None
            else None
        )
        """The store, read directly while no server answers (`JobConfig.store`)."""
        self._manifests: dict[str, DatasetManifest] = {}
        self._head_digest: str | None = None
        self._features: FeatureCache | None = None
        """The trainer's feature cache, opened by the first loop that uses it."""

    def manifest(self, prefix: str) -> DatasetManifest:
        """The dataset under `prefix`, listed once by a server (or from the store itself
        while none answers), retried within `retry_budget_s`.

        Raises:
            ServerUnavailable, StoreUnavailable: no listing within the retry budget.
        """
        if prefix not in self._manifests:
            for attempt in RetryPolicy(budget_s=self.config.retry_budget_s).retrying():
                with attempt:
                    self._manifests[prefix] = self.list(prefix)
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

    def request(
        self,
        cut: int,
        transforms: Transforms,
        connection: Connection | None = None,
        codec: Codec | None = None,
    ) -> SessionRequest:
        """A session request at `cut`, for `connection`'s server (default: the first), its
        features sent with `codec` (default: the job's own, as the planner's probes are)."""
        config = self.config
        dtype, compression = codec or loop_codec(config.wire_dtype, config.wire_compression, None)
        return SessionRequest(
            model=self.model.wire_model(cut, connection or self.connections[0]),
            cut=cut,
            freeze=self.model.freeze,
            transforms=transforms.to_dict(),
            image_size=config.image_size,
            wire_dtype=dtype,
            seed=config.seed,
            on_error=config.on_error,
            exact=config.exact,
            compression=compression if cut != RAW else "none",
        )

    def trainer_cache(
        self, transforms: Transforms, wire_dtype: WireDtype | None = None
    ) -> TrainerCache | None:
        """The trainer's feature cache for a loop with `transforms` whose features travel
        as `wire_dtype` (default the job's), if its features repeat."""
        config = self.config
        dtype = wire_dtype or config.wire_dtype
        if not config.cache or not cacheability(transforms).cacheable:
            return None
        if self._features is None:
            size = parse_bytes(config.cache_size)
            self._features = FeatureCache(config.cache_dir, max_bytes=size)
        model = self.model
        if self._head_digest is None:
            # Once: the head is frozen, and hashing a large one's weights takes a while.
            self._head_digest = head_content_digest(model.graph.head(model.freeze))
        space = loop_space(
            self._head_digest,
            model.freeze,
            transforms,
            wire_dtype=dtype,
            exact=config.exact,
            seed=config.seed,
        )
        return TrainerCache(self._features, space, transforms, dtype)

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
    ) -> Iterator[FeatureLoader]:
        """The loader of one loop over `prefix`, its sessions closed when it ends.

        Args:
            train: shuffle each epoch (off for evaluation).
            router: the loop's routes (the plan in force).
            codec: taken once per loop: its sessions, local chunks and cache agree on it.
        """
        config, model = self.config, self.model
        sessions = [
            Sessions(
                connection,
                functools.partial(
                    self.request, transforms=transforms, connection=connection, codec=codec
                ),
                on_reopen=self.on_reopen,
            )
            for connection in self.connections
        ]
        decoder = RawDecoder(transforms, config.seed, config.on_error)
        loader = FeatureLoader(
            self.connections[0],
            sessions,
            self.manifest(prefix),
            cache=self.trainer_cache(transforms, codec[0]),
            # Listed again each epoch only where a feature may be cached: a rewritten
            # object is then a miss, never a stale hit.
            relist=(
                functools.partial(self.list, prefix) if cacheability(transforms).cacheable else None
            ),
            batch_size=config.batch_size,
            chunk_size=config.chunk_size,
            prefetch=config.prefetch,
            seed=config.seed,
            shuffle=train,
            retry_budget_s=config.retry_budget_s,
            router=router,
            local=LocalCompute(
                decoder, model.graph.head, codec[0], model.device, exact=config.exact
            ),
            convert=model.parts.convert,
            record=self.record,
            shard=model.dp.shard if model.dp is not None else None,
            fallback=self.fallback,
        )
        with loader.servers:
            try:
                yield loader
            finally:
                loader.close()
