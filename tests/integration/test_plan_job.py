"""Planned jobs against a real server: the automatic plan, hybrid plans, re-plans, streaming."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from hapi.client import EpochStats, FeatureLoader, TransferJob, _epochs, connect
from hapi.client._fetch import Flow
from hapi.client.connection import ChunkPart, ChunkStream, Connection
from hapi.data import open_store, synth_dataset
from hapi.errors import InvalidCut
from hapi.graph import INPUT, RAW
from hapi.server import HapiServer, serve
from hapi.wire import ChunkTicket, SessionRequest

SIZE = 64
LAYER3 = 10  # resnet18's cut after layer3 (its 15 cuts: conv1, bn1, ..., fc)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HapiServer]:
    root = tmp_path_factory.mktemp("store")
    synth_dataset(open_store(root), "train", classes=3, per_class=8, size=72, seed=11)
    # The server's batch (7), the request (5 keys) and the training batch (8) all differ.
    with serve(store=str(root), batch_size=7) as running:
        yield running


def _job(server: HapiServer, **options: object) -> TransferJob:
    defaults: dict[str, object] = {
        "freeze": "layer3",
        "image_size": SIZE,
        "batch_size": 8,
        "chunk_size": 5,
        "prefetch": 2,
        "seed": 5,
    }
    defaults.update(options)
    return TransferJob({"name": "resnet18", "num_classes": 3}, "train", server.address, **defaults)


def _same_losses(a: TransferJob, b: TransferJob) -> None:
    # fp32 throughout; the server and the trainer run the head in different batch sizes,
    # so the features may differ in the last bits: 1e-4 is the tolerance the tests state.
    assert len(a.history.losses) == len(b.history.losses) > 0
    torch.testing.assert_close(
        torch.tensor(a.history.losses), torch.tensor(b.history.losses), rtol=1e-4, atol=1e-4
    )


def test_an_automatic_plan_is_a_valid_choice_and_trains(server: HapiServer) -> None:
    job = _job(server, freeze=None, replan=False)
    assert job.freeze == 14 and "the default" in job.freeze_reason  # all but the classifier
    plan = job.plan
    assert plan is not None
    assert RAW <= plan.cut <= job.freeze and 0.0 <= plan.share < 1.0
    assert plan.chosen in plan.options and len(plan.options) > job.freeze
    # The server timed its heads in the batches the job's chunks run (5 keys each).
    assert plan.server.batch_size == 5
    # Receiving costs the trainer CPU, measured on the RAW probe: above nothing, and far
    # below a second per MB (5-6 ms per MB here).
    assert 0.0 < plan.trainer.receive_s < 1e-6
    # Serving an object raw, as the RAW probe's report said: its read and more.
    assert plan.server.raw_s is not None and plan.server.raw_s >= plan.server.read_s > 0
    assert plan.server.compute_s(RAW) == plan.server.raw_s
    # Sending costs the server's cores too, measured on the same probe (the process's CPU
    # beyond its chunks' threads): above nothing, far below a second per MB.
    assert 0.0 < plan.server.send_s < 1e-6
    assert plan.server.serve_s(RAW) > plan.server.compute_s(RAW)
    explained = plan.explain()
    assert plan.reason in explained and "*" in explained
    assert "plan:" in job.summary() and "1,539 parameters train" in job.summary()
    (first,) = job.history.of_kind("plan")
    assert first.data["cut"] == plan.cut
    (epoch,) = job.fit(1, lr=0.05).epochs
    assert epoch.samples == 24 and epoch.chunks_local + epoch.chunks_pushed == 5
    assert (epoch.cut, epoch.share) == (plan.cut, plan.share)
    assert epoch.server_s > 0 and epoch.trainer_s > 0 and epoch.transfer_s >= 0
    assert epoch.binding in ("server", "link", "trainer")
    assert all(torch.isfinite(torch.tensor(job.history.losses)))


def test_the_plan_predicts_the_freeze_cut_at_what_its_probe_chunks_reported(
    server: HapiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's profile is levelled on the probe at the freeze cut: its head, its wait
    for the store and the rest of its chunks' reported time, so the plan's server time at
    the freeze cut is what those chunks reported - the figure the re-planner weighs the
    job's chunks against - not the profile action's reads, timed one by one."""
    seen: list[tuple[str, int, float]] = []  # session, keys, reported server time
    stream = Connection.stream

    def recorded(self: Connection, ticket: ChunkTicket) -> Iterator[ChunkPart]:
        reported = 0.0
        for part in stream(self, ticket):
            reported += part.report.server_s if part.report is not None else 0.0
            yield part
        seen.append((ticket.session, len(ticket.keys), reported))

    monkeypatch.setattr(Connection, "stream", recorded)
    # Measured, not kept ones; uncompressed, as the probes are (a codec adds its encoding).
    job = _job(server, replan=False, reuse_profiles=False, wire_compression="none")
    assert job.plan is not None
    # The probes: a pass at the freeze cut that warms, RAW measured, the freeze cut
    # measured - its chunks ran twice, the second measured.
    sessions = list(dict.fromkeys(session for session, _, _ in seen))
    assert len(sessions) == 2
    at_freeze = [chunk for chunk in seen if chunk[0] == sessions[0]]
    assert len(at_freeze) % 2 == 0 and at_freeze
    measured = at_freeze[len(at_freeze) // 2 :]
    reported = sum(r for *_, r in measured) / sum(n for _, n, _ in measured)
    assert reported > 0.0
    assert job.plan.server.compute_s(job.freeze) == pytest.approx(reported, rel=1e-9)


def test_receiving_is_the_trainers_busy_time_on_one_core(
    server: HapiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The process's CPU beyond training and decoding is receiving the streams: part of
    the trainer's busy time when the trainer has one core, beside it with more."""
    job = _job(server, cut="input", replan=False)  # 48 KB a sample: receiving shows
    monkeypatch.setattr("hapi.client._epochs._one_core", lambda: True)
    (one,) = job.fit(1, lr=0.05).epochs[-1:]
    assert one.receive_s > 0.0
    assert one.trainer_s == pytest.approx(one.compute_s + one.decode_s + one.receive_s)
    monkeypatch.setattr("hapi.client._epochs._one_core", lambda: False)
    (many,) = job.fit(1, lr=0.05).epochs[-1:]
    assert many.receive_s > 0.0
    assert many.trainer_s == pytest.approx(many.compute_s + many.decode_s)


def test_a_fits_epochs_add_up_to_its_time_and_ask_the_servers_nothing_between_them(
    server: HapiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each epoch's window starts where the one before it ended, so what runs between
    epochs is counted; and servers that report their time with each chunk are asked for
    their counters once, before anything is in flight (behind an epoch fetched ahead, a
    stats call waits a second at 10 Mbit/s, and the trainer with it)."""
    job = _job(server, cut=LAYER3, replan=False)
    calls: list[float] = []
    stats = Connection.stats

    def counted(self: Connection) -> object:
        calls.append(time.perf_counter())
        return stats(self)

    def slow_record(*args: Any, **kwargs: Any) -> EpochStats:
        time.sleep(1.0)  # after an epoch's end, its figures: the next epoch's time
        return EpochStats(*args, **kwargs)

    monkeypatch.setattr(Connection, "stats", counted)
    monkeypatch.setattr(_epochs, "EpochStats", slow_record)
    began = time.perf_counter()
    epochs = job.fit(3, lr=0.05).epochs
    assert len(epochs) == 3 and all(e.seconds >= 1.0 for e in epochs[1:])
    assert sum(e.seconds for e in epochs) <= time.perf_counter() - began - 1.0  # the last's
    assert len(calls) == 1 and all(e.server_s > 0 for e in epochs)


def test_a_server_that_does_not_report_per_chunk_is_timed_by_its_counters(
    server: HapiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = _job(server, cut=LAYER3, replan=False)
    stream = Connection.stream
    sessions: set[str] = set()

    def unreported(self: Connection, ticket: ChunkTicket) -> Iterator[ChunkPart]:
        sessions.add(ticket.session)
        for part in stream(self, ticket):
            if part.report is not None:  # as from a server that leaves the time out
                part = dataclasses.replace(
                    part, report=part.report.model_copy(update={"server_s": 0.0})
                )
            yield part

    monkeypatch.setattr(Connection, "stream", unreported)
    epochs = job.fit(2, lr=0.05).epochs
    assert all(e.server_s > 0 for e in epochs)
    # Each epoch's difference of the counters: together the sessions' CPU, once.
    closed = server.stats().closed_sessions
    cpu = sum(closed[s].cpu_s for s in sessions)
    assert 0.5 * cpu <= sum(e.server_s for e in epochs) <= cpu + 1e-6


def test_a_hybrid_plan_trains_like_pure_pushdown(server: HapiServer) -> None:
    pushdown = _job(server, cut="layer3")
    hybrid = _job(server, cut="layer3", local_share=0.5)
    pushdown.fit(2, lr=0.05)
    hybrid.fit(2, lr=0.05)
    _same_losses(hybrid, pushdown)
    for epoch in hybrid.history.epochs:
        assert epoch.samples == 24  # the loader checks each key came once
        assert (epoch.chunks_local, epoch.chunks_pushed) == (3, 2)  # 2.5 rounded up
        assert epoch.decode_s > 0
    assert all(e.chunks_local == 0 for e in pushdown.history.epochs)
    # Local chunks came as raw bytes: fewer feature bytes, more object bytes.
    assert hybrid.history.epochs[0].bytes_received != pushdown.history.epochs[0].bytes_received


def test_the_baseline_is_the_plan_where_every_chunk_is_local(server: HapiServer) -> None:
    baseline = _job(server, mode="local")
    pushdown = _job(server, cut=INPUT)
    assert baseline.cut == RAW and baseline.local_share == 1.0 and baseline.plan is None
    baseline.fit(1, lr=0.05)
    pushdown.fit(1, lr=0.05)
    _same_losses(baseline, pushdown)
    assert baseline.history.epochs[0].chunks_local == 5


@pytest.mark.parametrize(
    ("cut", "share"),
    [(12, 0.5), (7, 0.0), (RAW, 0.0)],
    ids=["to-a-later-cut-and-hybrid", "to-an-earlier-cut", "to-raw"],
)
def test_a_mid_epoch_replan_keeps_every_key_once_and_the_losses(
    server: HapiServer, cut: int, share: float
) -> None:
    # Chunks of 2: 12 an epoch. By the first step three are finished (the batch of 8
    # ends in the fourth), and the loader's window lets at most 2 in flight + the 4 a
    # batch spans + 1 be issued beyond them: 10, never the last two. (With chunks of 3,
    # 8 an epoch, the window could issue all 8 when the reads won the race.)
    fixed = _job(server, freeze="layer4", cut=LAYER3, chunk_size=2)
    fixed.fit(2, lr=0.05)
    changed = _job(server, freeze="layer4", cut=LAYER3, chunk_size=2)

    def replan_after_the_first_step(step: int, total: int) -> None:
        if step == 1 and not changed.history.epochs:
            changed.set_plan(cut, share, reason="the test's re-plan")

    changed.fit(2, lr=0.05, progress=replan_after_the_first_step)
    _same_losses(changed, fixed)
    (event,) = changed.history.plan_changes
    assert event.epoch == 0 and 0 < event.chunk < 12  # mid-epoch
    assert event.data["from"] == {"cut": LAYER3, "share": 0.0}
    first, second = changed.history.epochs
    assert first.samples == second.samples == 24
    assert (second.cut, second.share) == (cut, share)
    if share or cut == RAW:
        assert second.chunks_local > 0


def test_a_hybrids_local_chunks_keep_out_of_the_servers_window(
    server: HapiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a local chunk's raw bytes hold the link, the server is asked for the
    pushed-down chunks behind it: K of them in flight beside the local chunk, not K in
    all."""
    from hapi.client._fetch import Fetcher

    job = _job(server, freeze="layer4", cut=LAYER3, chunk_size=2)  # 12 chunks, K = 2
    job.set_plan(LAYER3, 0.25, reason="the test's hybrid")  # chunks 0, 4 and 8 local
    started: list[tuple[int, bool]] = []
    seen_while_held: list[tuple[int, bool]] = []
    start, fetch = Fetcher.start, Fetcher.fetch

    def noting(self: Fetcher, flow: Flow) -> None:
        started.append((flow.index, flow.route.local))
        start(self, flow)

    def first_read_held(self: Fetcher, flow: Flow) -> None:
        if flow.index == 0 and not seen_while_held:
            # The link busy with chunk 0's raw bytes (and the chunks after it waiting
            # their turn): what is asked of the server meanwhile.
            deadline = time.monotonic() + 3
            while len(started) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.2)  # were the windows wider, more would start now
            seen_while_held.extend(started)
        fetch(self, flow)

    monkeypatch.setattr(Fetcher, "start", noting)
    monkeypatch.setattr(Fetcher, "fetch", first_read_held)
    job.fit(1, lr=0.05)
    # Chunk 0 and the two pushed down behind it; chunk 3 waits for chunk 1's read. One
    # window of 2 in all stopped at chunks 0 and 1, and the server had one chunk to
    # compute.
    assert seen_while_held == [(0, True), (1, False), (2, False)]
    (epoch,) = job.history.epochs
    assert epoch.samples == 24 and epoch.chunks_local == 3


def test_a_hybrids_local_chunks_are_in_flight_one_at_a_time(
    server: HapiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local chunk is requested once the local chunk before it is read: raw bytes are
    ready at once and go into the network's buffers, which a dropped link then drains
    for seconds before a re-plan's first chunk."""
    from hapi.client._fetch import Fetcher

    job = _job(server, freeze="layer4", cut=LAYER3, chunk_size=2)  # 12 chunks, K = 2
    job.set_plan(LAYER3, 0.5, reason="the test's hybrid")  # chunks 0, 2, 4, ... local
    local: list[Flow] = []
    most = 0
    start, fetch = Fetcher.start, Fetcher.fetch

    def noting(self: Fetcher, flow: Flow) -> None:
        nonlocal most
        if flow.route.local:
            local.append(flow)
            most = max(most, sum(not f.read_done.is_set() for f in local))
        start(self, flow)

    def reading(self: Fetcher, flow: Flow) -> None:
        time.sleep(0.05)  # a slow link: the loader would request more meanwhile
        fetch(self, flow)

    monkeypatch.setattr(Fetcher, "start", noting)
    monkeypatch.setattr(Fetcher, "fetch", reading)
    job.fit(1, lr=0.05)
    assert most == 1
    (epoch,) = job.history.epochs
    assert epoch.samples == 24 and epoch.chunks_local == 6


def test_a_chunk_in_flight_follows_a_change_of_cut_with_its_keys_not_yet_delivered(
    server: HapiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hapi.client._fetch import Fetcher

    # Chunks of 10 keys, which the server computes in batches of 7: two parts each.
    fixed = _job(server, freeze="layer4", cut=LAYER3, chunk_size=10)
    fixed.fit(1, lr=0.05)
    changed = _job(server, freeze="layer4", cut=LAYER3, chunk_size=10)
    deliver = Fetcher._deliver

    def change_after_the_first_part(self: Fetcher, flow: object, batch: object) -> None:
        deliver(self, flow, batch)  # type: ignore[arg-type]
        if not changed.history.plan_changes:
            changed.set_plan(12, 0.0, reason="the test's re-plan, mid-chunk")

    monkeypatch.setattr(Fetcher, "_deliver", change_after_the_first_part)
    changed.fit(1, lr=0.05)
    _same_losses(changed, fixed)
    first, *_ = changed.history.reroutes
    assert (first.epoch, first.chunk) == (0, 0)
    assert first.data == {"from": LAYER3, "to": 12, "keys_left": 3}
    assert "its 3 keys not yet delivered go at cut 12" in first.message
    # The chunks in flight were recalled with the server's bytes sent ahead at cut 10.
    (recall,) = changed.history.recalls
    assert recall.epoch == 0 and recall.data == {"servers": [server.address]}
    (epoch,) = changed.history.epochs
    assert epoch.samples == 24  # the loader checks each key came once
    assert epoch.cut == 12


def test_a_local_chunk_in_flight_goes_pushed_down_when_the_share_falls(
    server: HapiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hapi.client._fetch import Fetcher
    from hapi.server import session

    monkeypatch.setattr(session, "RAW_BATCH_BYTES", 1)  # raw bytes come one object a part
    fixed = _job(server, freeze="layer4", cut=LAYER3, chunk_size=10)
    fixed.fit(1, lr=0.05)
    changed = _job(server, freeze="layer4", cut=LAYER3, local_share=0.5, chunk_size=10)
    deliver = Fetcher._deliver

    def change_after_the_first_part(self: Fetcher, flow: object, batch: object) -> None:
        deliver(self, flow, batch)  # type: ignore[arg-type]
        if not changed.history.plan_changes:
            changed.set_plan(LAYER3, 0.0, reason="the test's re-plan: no more local chunks")

    compute = Fetcher._compute

    def slow_compute(self: Fetcher, *args: object) -> None:
        time.sleep(0.5)  # the local piece is still computing when the pushed ones come
        compute(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(Fetcher, "_deliver", change_after_the_first_part)
    monkeypatch.setattr(Fetcher, "_compute", slow_compute)
    changed.fit(1, lr=0.05)
    _same_losses(changed, fixed)  # the same batches: the chunk's samples kept their order
    first, *_ = changed.history.reroutes
    assert (first.epoch, first.chunk) == (0, 0)  # chunk 0 is local (assign's first pick)
    assert first.data == {"from": RAW, "to": LAYER3, "keys_left": 9}
    (epoch,) = changed.history.epochs
    assert epoch.samples == 24 and epoch.chunks_local == 0


def test_a_replanner_that_always_drifts_keeps_every_key_once(server: HapiServer) -> None:
    from hapi.plan import ReplanConfig

    # A threshold near zero re-plans on any noise: whatever it chooses, keys stay once
    # and the losses are a fixed plan's.
    job = _job(server, replan=ReplanConfig(threshold=1e-9, min_chunks=1))
    plan = job.plan
    assert plan is not None
    fixed = _job(server, cut=plan.cut, local_share=plan.share)
    job.fit(2, lr=0.05)
    fixed.fit(2, lr=0.05)
    _same_losses(job, fixed)
    assert [e.samples for e in job.history.epochs] == [24, 24]


def test_a_chunk_is_timed_from_its_request_not_from_its_sessions_opening(
    server: HapiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hapi.client.routing import ChunkRecord, Router
    from hapi.client.sessions import Sessions

    # Opening a session takes as long as the server needs to trace the model; the first
    # chunk at a cut waits for it. Timed from before the opening, the opening read as the
    # link's time (a 1 Gbit/s link at 2 MB/s, and a re-plan away from the cut).
    open_session, stream, observe = Sessions._open, Connection.stream, Router.observe
    requested: dict[int, float] = {}
    records: list[ChunkRecord] = []

    def slow_open(self: Sessions, cut: int) -> str:
        time.sleep(0.5)
        return open_session(self, cut)

    def timed_stream(self: Connection, ticket: ChunkTicket) -> ChunkStream:
        requested.setdefault(ticket.chunk, time.perf_counter())
        return stream(self, ticket)

    def recorded(self: Router, record: ChunkRecord) -> None:
        records.append(record)
        observe(self, record)

    monkeypatch.setattr(Sessions, "_open", slow_open)
    monkeypatch.setattr(Connection, "stream", timed_stream)
    monkeypatch.setattr(Router, "observe", recorded)
    job = _job(server, cut=LAYER3)
    job.fit(1, lr=0.05)
    reads = [r for r in records if r.trainer_s is None]
    assert sorted(r.chunk for r in reads) == list(range(5))  # 24 keys in chunks of 5
    for record in reads:
        assert record.issued is not None
        assert 0 <= requested[record.chunk] - record.issued < 0.25, record.chunk


def test_batches_stream_before_their_chunk_is_complete(server: HapiServer) -> None:
    conn = connect(server.address)
    job = _job(server, cut=LAYER3)
    request = SessionRequest(
        model=job.spec.to_dict(),
        cut=LAYER3,
        freeze=job.freeze,
        transforms=job.config.train_transforms.to_dict(),
        image_size=SIZE,
    )
    session = conn.open_session(request).session
    first_batch = threading.Event()
    parts: list[int] = []
    held: list[bool] = []

    def on_part(chunk: int, keys: list[str]) -> None:
        parts.append(len(keys))
        if len(parts) == 1:
            # Hold the stream after its first part until the trainer has a batch: a loader
            # that waited for the whole chunk would never yield one, and this would fail.
            held.append(first_batch.wait(timeout=60))

    # One chunk of all 24 keys, which the server computes in batches of 7.
    loader = FeatureLoader(
        conn, session, conn.manifest("train"), batch_size=4, chunk_size=24, on_part=on_part
    )
    sizes = []
    for _, y in loader.epoch(0):
        sizes.append(len(y))
        first_batch.set()
    conn.close_session(session)
    assert held == [True]
    assert parts == [7, 7, 7, 3] and sizes == [4] * 6


def test_a_freeze_that_trains_nothing_is_refused_when_the_job_is_built(
    server: HapiServer,
) -> None:
    with pytest.raises(InvalidCut, match="nothing to train"):
        _job(server, freeze="fc")
