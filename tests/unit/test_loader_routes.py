"""The loader's routes against an in-memory server with a store of images (`MemorySource`):
hybrid plans and the baseline, a change of plan under a chunk in flight, the windows of a
hybrid's local chunks, the store read when no server answers - every key once, and the
same features whichever tier computed them."""

from __future__ import annotations

import functools
import time
from typing import Any

import pytest
import torch
from torch import nn

from hapi.client import FeatureLoader
from hapi.client.pipeline.history import Event, ignore_event
from hapi.client.pipeline.routing import Router
from hapi.client.servers.decode import RawDecoder
from hapi.client.servers.local import LocalCompute
from hapi.client.servers.memory import MemorySource
from hapi.client.servers.sessions import Sessions
from hapi.client.servers.source import recall_all
from hapi.data import Transforms, open_store, synth_dataset
from hapi.data.store import ObjectStore
from hapi.errors import ServerUnavailable
from hapi.graph import RAW, trace
from hapi.plan import (
    LinkProfile,
    ReadMeasurement,
    ReplanConfig,
    Replanner,
    ServerProfile,
    TrainerProfile,
    TrainMeasurement,
    Workload,
    choose_plan,
)
from hapi.wire import ChunkTicket, FeatureBatch, SessionRequest, SkippedKey

SIZE = 16
SEED = 5
TRANSFORMS = Transforms.eval(SIZE)
CUT, LATER = 2, 4  # conv1+relu, conv2+relu


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(3, 4, 3)
        self.conv2 = nn.Conv2d(4, 4, 3)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.fc = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        return self.fc(torch.flatten(self.pool(x), 1))


class World:
    """24 images in a store, the model, and each key's features at each cut."""

    def __init__(self) -> None:
        self.store: ObjectStore = open_store("memory://")
        self.manifest = synth_dataset(self.store, "d", classes=2, per_class=12, size=20, seed=3)
        self.graph = trace(_Model().eval(), (3, SIZE, SIZE))
        self._features: dict[tuple[str, int], torch.Tensor] = {}

    def compute(self) -> LocalCompute:
        """The sample pipeline and head both tiers run (a server's, a trainer's)."""
        return LocalCompute(RawDecoder(TRANSFORMS, SEED, "raise"), self.graph.head)

    def convert(self, features: torch.Tensor, start: int, end: int) -> torch.Tensor:
        with torch.no_grad():
            return self.graph.segment(start, end)(features)

    def features(self, key: str, cut: int) -> torch.Tensor:
        """`key`'s features at `cut`, computed alone (evaluation transforms: any epoch)."""
        if (key, cut) not in self._features:
            label = torch.zeros(1, dtype=torch.int64)
            raw = FeatureBatch([key], label, data=[self.store.get(key)])
            batch, _ = self.compute()(raw, 0, cut)
            assert batch.features is not None
            self._features[key, cut] = batch.features[0]
        return self._features[key, cut]

    def source(self, **options: Any) -> MemorySource:
        return MemorySource(store=self.store, compute=self.compute(), **options)


@pytest.fixture(scope="module")
def world() -> World:
    return World()


def _request(cut: int) -> SessionRequest:
    return SessionRequest(
        model={"name": "tiny"}, cut=cut, transforms=TRANSFORMS.to_dict(), image_size=SIZE
    )


def _loader(
    world: World,
    source: MemorySource,
    router: Router,
    *,
    events: list[Event] | None = None,
    local: LocalCompute | None = None,
    **options: object,
) -> FeatureLoader:
    settings: dict[str, object] = {"batch_size": 8, "chunk_size": 4, "prefetch": 2, "seed": SEED}
    settings.update(options)
    return FeatureLoader(
        source,
        [Sessions(source, _request, keepalive_s=None)],
        world.manifest,
        router=router,
        local=local or world.compute(),
        convert=world.convert,
        record=events.append if events is not None else None,
        **settings,  # type: ignore[arg-type]
    )


def _router(
    source: MemorySource, cut: int, share: float = 0.0, events: list[Event] | None = None
) -> Router:
    """A router over `source` alone: a change of plan recalls its streams."""
    return Router(
        cut,
        share,
        record=events.append if events is not None else ignore_event,
        recall=functools.partial(recall_all, [source]),
    )


def _epoch(world: World, loader: FeatureLoader, epoch: int = 0) -> list[str]:
    """The epoch's keys, each batch's features checked against its keys' at its cut."""
    keys: list[str] = []
    with loader.servers:
        for batch in loader.batches(epoch):
            expected = torch.stack([world.features(k, batch.cut) for k in batch.keys])
            torch.testing.assert_close(batch.features, expected, rtol=1e-5, atol=1e-5)
            keys += batch.keys
    return keys


def _in_order(world: World, loader: FeatureLoader, epoch: int = 0) -> list[str]:
    return [world.manifest.keys[j] for j in loader.order(epoch)]


def _at(source: MemorySource, cut: int) -> list[ChunkTicket]:
    """The tickets `source` was sent on its sessions at `cut`."""
    return [t for t in source.tickets if source.cuts[t.session] == cut]


def test_a_hybrid_plan_gives_pure_pushdowns_features(world: World) -> None:
    pushed_source, hybrid_source = world.source(), world.source()
    pushed = _loader(world, pushed_source, _router(pushed_source, CUT))
    hybrid = _loader(world, hybrid_source, _router(hybrid_source, CUT, 0.5))
    assert _epoch(world, pushed) == _epoch(world, hybrid) == _in_order(world, hybrid)
    assert (pushed.stats.chunks_local, hybrid.stats.chunks_local) == (0, 3)  # of 6
    # The local chunks came as raw bytes, computed here from the store's objects.
    assert len(_at(hybrid_source, RAW)) == 3 and len(_at(hybrid_source, CUT)) == 3
    assert hybrid.stats.postprocess_s > 0 and pushed.stats.postprocess_s == 0
    assert hybrid.stats.bytes_received != pushed.stats.bytes_received


def test_the_baseline_computes_every_chunk_from_raw_bytes(world: World) -> None:
    source = world.source()
    loader = _loader(world, source, _router(source, RAW))
    assert _epoch(world, loader) == _in_order(world, loader)  # features at INPUT
    assert loader.stats.chunks_local == 6 and len(_at(source, RAW)) == 6
    assert set(source.cuts.values()) == {RAW}


def test_a_chunk_in_flight_follows_a_change_of_cut_with_its_keys_not_yet_delivered(
    world: World,
) -> None:
    source = world.source(batch_size=2)  # chunks of 4 keys come in two parts
    events: list[Event] = []
    router = _router(source, CUT, events=events)

    def change_after_the_first_part(chunk: int, keys: list[str]) -> None:
        if chunk == 0 and not any(e.kind == "replan" for e in events) and not router.changing:
            router.cell.publish(LATER, reason="the test's re-plan, mid-chunk")

    loader = _loader(world, source, router, events=events, on_part=change_after_the_first_part)
    assert _epoch(world, loader) == _in_order(world, loader)
    first, *_ = (e for e in events if e.kind == "reroute")
    assert (first.epoch, first.chunk) == (0, 0)
    assert first.data == {"from": CUT, "to": LATER, "keys_left": 2}
    # The streams in flight were recalled with what the server had sent ahead.
    (recall,) = (e for e in events if e.kind == "recall")
    assert recall.epoch == 0 and recall.data == {"servers": [source.address]}
    # Chunk 0 asked again for the keys it had not delivered, at the new cut.
    once, again = (t for t in source.tickets if t.chunk == 0)
    assert again.keys == once.keys[2:] and source.cuts[again.session] == LATER


class _SlowCompute(LocalCompute):
    """The trainer's local work, slow: its pieces are still computing when the pushed-down
    ones of the same chunk arrive."""

    def __call__(
        self, batch: FeatureBatch, epoch: int, cut: int
    ) -> tuple[FeatureBatch, list[SkippedKey]]:
        time.sleep(0.1)
        return super().__call__(batch, epoch, cut)


def test_a_local_chunk_in_flight_goes_pushed_down_when_the_share_falls(world: World) -> None:
    source = world.source(batch_size=1)  # raw bytes come one object a part
    events: list[Event] = []
    router = _router(source, CUT, 0.5, events)

    def no_more_local_chunks(chunk: int, keys: list[str]) -> None:
        if chunk == 0 and not router.changing and router.applied == (CUT, 0.5):
            router.cell.publish(CUT, 0.0, reason="the test's re-plan: no more local chunks")

    slow = _SlowCompute(RawDecoder(TRANSFORMS, SEED, "raise"), world.graph.head)
    loader = _loader(world, source, router, events=events, local=slow, on_part=no_more_local_chunks)
    # The chunk's samples keep their order: its local piece, then the pushed-down rest.
    assert _epoch(world, loader) == _in_order(world, loader)
    first, *_ = (e for e in events if e.kind == "reroute")
    assert (first.epoch, first.chunk) == (0, 0)  # chunk 0 is local (assign's first pick)
    assert first.data == {"from": RAW, "to": CUT, "keys_left": 3}
    assert loader.stats.chunks_local == 0 and len(_at(source, RAW)) == 1


def test_a_hybrids_local_chunks_keep_out_of_the_servers_window(world: World) -> None:
    """While a local chunk's raw bytes hold the link, the server is asked for the
    pushed-down chunks behind it: K of them in flight beside the local chunk, not K in
    all."""
    source = world.source()
    seen_while_held: list[tuple[int, int]] = []

    def hold_the_first_local_chunk(ticket: ChunkTicket, part: int) -> None:
        if ticket.chunk == 0 and part == 0 and not seen_while_held:
            deadline = time.monotonic() + 3
            while len(source.tickets) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.1)  # were the windows wider, more would be asked for now
            seen_while_held.extend(
                sorted((t.chunk, source.cuts[t.session]) for t in source.tickets)
            )

    source.on_part = hold_the_first_local_chunk
    # 12 chunks, K = 2; chunks 0, 4 and 8 local.
    loader = _loader(world, source, _router(source, CUT, 0.25), chunk_size=2)
    assert _epoch(world, loader) == _in_order(world, loader)
    # Chunk 0 and the two pushed down behind it; chunk 3 waits for chunk 1's read.
    assert seen_while_held == [(0, RAW), (1, CUT), (2, CUT)]
    assert loader.stats.chunks_local == 3


def test_a_hybrids_local_chunks_are_in_flight_one_at_a_time(world: World) -> None:
    """A local chunk is requested once the local chunk before it is read: raw bytes are
    ready at once and go into the network's buffers, which a dropped link then drains
    for seconds before a re-plan's first chunk."""
    source = world.source(part_delay_s=0.01)  # a slow link: the loader asks ahead meanwhile
    loader = _loader(world, source, _router(source, CUT, 0.5), chunk_size=2)
    assert _epoch(world, loader) == _in_order(world, loader)
    assert loader.stats.chunks_local == 6
    assert source.max_open_raw == 1 and source.max_open > 1


def test_a_chunk_is_timed_from_its_request_not_from_its_sessions_opening(
    world: World,
) -> None:
    # Opening a session takes as long as the server needs to trace the model; the first
    # chunk at a cut waits for it. Timed from before the opening, the opening would read
    # as the link's time.
    source = world.source(open_delay_s=0.3)
    loader = _loader(world, source, _router(source, CUT))
    _epoch(world, loader)
    first_request: dict[int, float] = {}
    for ticket, at in zip(source.tickets, source.requested, strict=True):
        first_request.setdefault(ticket.chunk, at)
    records = loader.stats.records
    assert sorted(r.chunk for r in records) == list(range(6))
    for record in records:
        assert record.issued is not None
        assert 0 <= first_request[record.chunk] - record.issued < 0.2, record.chunk


def test_the_store_is_read_when_no_server_answers(world: World) -> None:
    source = world.source()
    source.fail_next(ServerUnavailable("memory://0 is down"), times=10_000)
    events: list[Event] = []
    loader = _loader(
        world,
        source,
        _router(source, CUT),
        events=events,
        fallback=world.store,
        retry_budget_s=30.0,
    )
    assert _epoch(world, loader) == _in_order(world, loader)
    assert loader.stats.fallbacks == 6 and loader.stats.samples == 24
    assert {e.chunk for e in events if e.kind == "fallback"} == set(range(6))


def test_the_router_hears_each_chunks_read_and_its_training_once(world: World) -> None:
    # A chunk's server and link from the fetching thread when it is read, its trainer
    # from the consumer when it is trained: one measurement each, one chunk counted.
    cuts = world.graph.num_cuts
    server = ServerProfile(
        read_s=0.001, decode_s=0.01, head_s=(0.01,) * cuts, out_bytes=(10_000,) * cuts,
        memory_bytes=(0,) * cuts, raw_bytes=10_000,
    )  # fmt: skip
    trainer = TrainerProfile(decode_s=0.01, head_s=(0.01,) * cuts, tail_s=(0.01,) * cuts)
    plan = choose_plan(
        server, trainer, LinkProfile(bytes_per_s=1e6), Workload(samples=24, chunk_size=4),
        freeze=CUT,
    )  # fmt: skip
    # Its measurements drift from any profile here: a threshold none reaches keeps the plan.
    replanner = Replanner(plan, ReplanConfig(threshold=1e9))
    source = world.source()

    def observe(measured: ReadMeasurement | TrainMeasurement) -> None:
        if isinstance(measured, ReadMeasurement):
            replanner.observe(measured)
        else:
            replanner.observe(trained=measured)

    router = Router(CUT, 0.5, observe=observe, recall=functools.partial(recall_all, [source]))
    loader = _loader(world, source, router)
    assert _epoch(world, loader) == _in_order(world, loader)
    assert loader.stats.chunks_local == 3 and not replanner.changes
    assert (replanner.chunks, replanner.steps) == (6, 12)
