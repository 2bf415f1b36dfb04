"""`FeatureLoader`: the trainer's side of the pipeline.

It owns the epoch order (a seeded permutation) and keeps K chunks in flight. Each chunk
is routed when it is issued: pushed down (the server sends features at the plan's cut)
or local (the server sends raw bytes and the trainer computes the features, in a worker
thread). Batches are handed on as they arrive, not when their chunk is complete, and in
epoch order; they are cut and joined into training batches (`hapi.client.rebatch`), so
the request's size, the server's batch and the training batch are three numbers.

K chunks are in flight at the servers and links: chunk j+K is issued as soon as chunk j
has been read, not when it has been trained. (Issued at training, the server worked
only K - 2 chunks ahead while the trainer held a training batch of two, and the two
tiers ran in lockstep: 1.2x the slower one's time.) The chunks read but not yet trained
are bounded too: at most those a training batch spans, plus one.

In a hybrid plan the local chunks and the pushed-down ones have a window each: a local
chunk asks the server only to read its objects, and counted against the server's window
its raw bytes, holding the link, left the server K - 1 chunks to compute and then idle.
The ViT at 10 Mbit/s: a raw chunk of 16 photos held the link 1.4 s while the 2 chunks
behind it took the server 0.7 s. The pushed-down window holds K chunks; a hybrid's local
window one (`HYBRID_LOCAL_WINDOW`), the RAW baseline's K. Raw bytes are ready as soon as
they are read, so every raw chunk in flight goes into the network's buffers as soon as
its turn on the connection comes: with 4 in flight, a link that dropped from 1 Gbit/s to
10 Mbit/s still had 3 MB of them to carry (2.4 s) before the re-plan's first chunk. One
is enough where pushed-down chunks cross between them, while the next is read; the RAW
baseline has none between, and its link would wait for each request. Chunks are still
issued in order; a chunk whose window is full waits, and the chunks after it too.

The link serves chunks in order: every chunk's request goes out when it is issued, so
the server works ahead, but a chunk's stream is read only once the one before it is
read. Read at once, K streams would share the link and the first chunk would arrive
about when all of them do - the trainer would wait for nearly every byte of the first K
chunks before its first batch. Read in order, chunk i arrives at the link's full rate
while the server computes chunk i+1 into its stream's flow-control window. The server
keeps the order too (`hapi.server._order`): its streams on one connection send in
chunk order, across the job's sessions, since bytes written ahead of their turn cross
anyway, up to flow-control windows of megabytes, and a raw chunk's are ready at once.

Epochs run back to back: told which epoch comes next (`batches(..., then=)`), an epoch
whose chunks are all issued starts issuing the next one's as its windows free, the two
sharing the windows. Otherwise each epoch would begin with the server and the link idle
until its first chunk is requested, and end with them idle while the trainer finishes:
in an epoch of 8 training steps, a pipeline fill and drain of up to an eighth of it
each (ResNet-50 to `layer3` at 1 Gbit/s: 1.10x its slowest stage with 256 images,
1.04x with 1024). The next epoch's chunks are read in their turn, after this one's, and
wait in their queues until it starts; every key is still delivered once per epoch.

With several servers (one beside each storage node) each chunk goes to one of them
(`hapi.client.servers`: by their measured rates and what is local to each), K chunks in
flight per server, and each server's link serves its own chunks in order.

A stream that fails (server gone, store gone, stream cut, session lost to a restart) is
retried with backoff up to a time budget, for the keys not yet delivered only: samples
depend on (job seed, epoch, key), not on which request carried them, so the retry may go
to another server. Every key is delivered once per epoch or the epoch fails saying which
went missing or came twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from hapi.client._epoch_run import EpochRun, LoaderStats, Windows
from hapi.client._trainer_cache import TrainerCache
from hapi.client.distributed import Shard
from hapi.client.history import Event
from hapi.client.local import LocalCompute
from hapi.client.rebatch import Batch, Convert
from hapi.client.retry import RetryPolicy
from hapi.client.routing import Router
from hapi.client.servers import Servers
from hapi.client.sessions import Sessions
from hapi.client.source import ChunkSource
from hapi.data import DatasetManifest, ObjectStore
from hapi.data.shard_order import shard_order
from hapi.errors import (
    HapiError,
    InvalidRequest,
    shorten,
)
from hapi.graph import INPUT
from hapi.plan import HYBRID_LOCAL_WINDOW

__all__ = ["HYBRID_LOCAL_WINDOW", "FeatureLoader", "LoaderStats"]

log = logging.getLogger("hapi.client")

# Called in the fetching thread after each part of a chunk is handed on: (chunk, keys).
OnPart = Callable[[int, list[str]], None]


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
        router: routes each chunk (pushed down or local); default: all pushed down at `cut`.
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

    Raises:
        InvalidRequest: a size below 1, negative retries or budget.
    """

    def __init__(
        self,
        connection: ChunkSource,
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
    ) -> None:
        for name, value in (
            ("batch_size", batch_size),
            ("chunk_size", chunk_size),
            ("prefetch", prefetch),
        ):
            if value < 1:
                raise InvalidRequest(f"{name} must be >= 1, got {value}")
        self.retry = RetryPolicy(budget_s=retry_budget_s, retries=retries)
        self.connection = connection
        if isinstance(session, str):
            session = Sessions.fixed(connection, session, cut)
        self.servers = Servers([session] if isinstance(session, Sessions) else session)
        self.manifest = manifest
        self.batch_size = batch_size
        self.chunk_size = chunk_size
        self.prefetch = prefetch
        self.seed = seed
        self.shuffle = shuffle
        self.router = router if router is not None else Router(cut)
        self.router.recall = self.recall
        self.local = local
        self.convert = convert
        self.record = record
        self.on_part = on_part
        self.shard = shard
        self.fallback = fallback
        self.cache = cache
        self.relist = relist
        self.stats = LoaderStats()
        self._ahead: EpochRun | None = None
        """The next epoch, started while the one before it drained."""

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
        """The epoch's order of manifest indices (with a shard, this rank's part of it).

        A dataset of shards' members is ordered as WebDataset users expect (`shard_order`:
        shards shuffled, then samples a few shards at a time), in runs a chunk reads with
        one request."""
        n = len(self.manifest)
        if not self.shuffle:
            order = np.arange(n)
        else:
            sharded = shard_order(
                self.manifest.keys, seed=self.seed, epoch=epoch, block=self.chunk_size
            )
            order = (
                sharded
                if sharded is not None
                else np.random.default_rng([self.seed, epoch]).permutation(n)
            )
        return order if self.shard is None else self.shard.take(order, self.batch_size)

    def chunks(self, epoch: int, *, start: int = 0) -> list[tuple[list[str], list[int]]]:
        """The epoch's chunks in order, each as (keys, labels), from place `start` of its
        order on."""
        order = self.order(epoch)[start:]
        keys, labels = self.manifest.keys, self.manifest.labels
        return [
            (
                [keys[j] for j in order[start : start + self.chunk_size]],
                [labels[j] for j in order[start : start + self.chunk_size]],
            )
            for start in range(0, len(order), self.chunk_size)
        ]

    def epoch(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield `(features, labels)` training batches of one epoch (see `batches`)."""
        for batch in self.batches(epoch):
            yield batch.features, batch.labels

    def batches(self, epoch: int, *, start: int = 0, then: int | None = None) -> Iterator[Batch]:
        """Yield the epoch's training batches, each at one cut, in epoch order.

        `start` resumes an epoch: its order's first `start` places are left out (they
        were trained before an interruption). At a multiple of `batch_size` the batches
        are those the whole epoch would have had from there on.

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
        if not 0 <= start <= samples:
            raise InvalidRequest(f"start must be 0..{samples} (the epoch's samples), got {start}")
        run, self._ahead = self._ahead, None
        if run is not None and (run.epoch != epoch or start):
            run.shutdown()
            run = None
        if run is None:
            chunks = self.chunks(epoch, start=start)
            versions = self.versions()
            self.router.start(epoch, len(chunks))
            run = EpochRun(self, epoch, chunks, versions=versions)
        run.then = then
        self.stats = run.stats
        return run.run()

    def recall(self) -> None:
        """Cut every server's chunk streams in flight (a change of plan moved their chunks)
        with what the servers had sent ahead on them, which would otherwise cross the link
        at the old route first; each chunk asks again for the keys it has not delivered."""
        cut = [m.address for m in self.servers if m.connection.recall()]
        if cut and self.record is not None:
            self.record(
                Event(
                    "recall",
                    self.router.epoch,
                    None,
                    f"the plan moved the chunks in flight: their streams from {', '.join(cut)} "
                    "were cut with what the server had sent ahead, and asked again",
                    {"servers": cut},
                )
            )

    def close(self) -> None:
        """Stop fetching a next epoch that was started ahead and will not be asked for."""
        run, self._ahead = self._ahead, None
        if run is not None:
            run.shutdown()

    def versions(self) -> dict[str, str] | None:
        """The objects' versions, listed now (None: not listed - no `relist`, or the
        listing failed, and the epoch is then neither looked up in the cache nor kept)."""
        if self.relist is None:
            return _versions(self.manifest)
        try:
            return _versions(self.relist())
        except HapiError as exc:
            log.warning(
                "listing the dataset's versions failed (%s): this epoch does not use the "
                "feature cache",
                shorten(str(exc)),
            )
            return None

    def _start_ahead(
        self, epoch: int, windows: Windows, before: EpochRun, versions: dict[str, str] | None
    ) -> EpochRun:
        """Start `epoch` while `before` drains (from its `_advance`)."""
        chunks = self.chunks(epoch)
        self.router.start(epoch, len(chunks))
        self._ahead = EpochRun(
            self, epoch, chunks, windows=windows, before=before, versions=versions
        )
        return self._ahead


def _versions(manifest: DatasetManifest) -> dict[str, str] | None:
    if not manifest.versions:
        return None  # an older server lists no versions: nothing is cached
    return dict(zip(manifest.keys, manifest.versions, strict=True))
