"""Planned jobs against a real server: the automatic plan, hybrid plans, re-plans, streaming."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import torch

from hapi.client import FeatureLoader, TransferJob, connect
from hapi.client.servers.connection import ChunkPart, Connection
from hapi.client.servers.source import PartStream
from hapi.data import open_store, synth_dataset
from hapi.errors import InvalidCut
from hapi.graph import INPUT, RAW
from hapi.server import HapiServer, serve
from hapi.wire import ActionType, ChunkTicket, SessionInfo, SessionRequest

SIZE = 64
LAYER3 = 10  # resnet18's cut after layer3 (its 15 cuts: conv1, bn1, ..., fc)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HapiServer]:
    root = tmp_path_factory.mktemp("store")
    synth_dataset(open_store(root), "train", classes=3, per_class=8, size=72, seed=11)
    # The server's batch (7), the request (5 keys) and the training batch (8) all differ.
    with serve(store=str(root), batch_size=7) as running:
        yield running


def _job(server: HapiServer | Connection, **options: object) -> TransferJob:
    defaults: dict[str, object] = {
        "freeze": "layer3",
        "image_size": SIZE,
        "batch_size": 8,
        "chunk_size": 5,
        "prefetch": 2,
        "seed": 5,
    }
    defaults.update(options)
    where = server if isinstance(server, Connection) else server.address
    return TransferJob({"name": "resnet18", "num_classes": 3}, "train", where, **defaults)


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


class _Counted:
    """A chunk's stream, passed through: the server time its reports give is noted at
    its end."""

    def __init__(self, stream: PartStream, done: Callable[[float], None]) -> None:
        self._stream, self._done = stream, done

    def __iter__(self) -> Iterator[ChunkPart]:
        reported = 0.0
        for part in self._stream:
            reported += part.report.server_s if part.report is not None else 0.0
            yield part
        self._done(reported)

    def cancel(self) -> None:
        self._stream.cancel()


@dataclass
class Watched(Connection):
    """The job's server as the test sees it: each chunk (session, keys, the server time
    reported) and each action. `unlike`: it says it runs more torch threads than the
    trainer, as a server unlike it would, which then profiles itself."""

    unlike: bool = False
    seen: list[tuple[str, int, float]] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)

    def open_session(self, request: SessionRequest) -> SessionInfo:
        info = super().open_session(request)
        return info.model_copy(update={"threads": info.threads + 1}) if self.unlike else info

    def stream(self, ticket: ChunkTicket) -> _Counted:  # type: ignore[override]
        def done(reported: float) -> None:
            self.seen.append((ticket.session, len(ticket.keys), reported))

        return _Counted(super().stream(ticket), done)

    def action(self, name: str, body: bytes = b"") -> bytes:
        self.actions.append(name)
        return super().action(name, body)


@pytest.mark.parametrize("own_profile", [True, False], ids=["profile-action", "scaled-trainer"])
def test_the_plan_predicts_the_freeze_cut_at_what_its_probe_chunks_reported(
    server: HapiServer, own_profile: bool
) -> None:
    """The server's profile is levelled on the probe at the freeze cut: its head, its wait
    for the store and the rest of its chunks' reported time, so the plan's server time at
    the freeze cut is what those chunks reported - the figure the re-planner weighs the
    job's chunks against - not the profile action's reads, timed one by one. So it is
    whether the server profiles itself (a server unlike the trainer: a GPU, more threads)
    or its heads are the trainer's scaled (this in-process server runs them alike)."""
    connection = Watched(address=server.address, unlike=own_profile)
    seen, actions = connection.seen, connection.actions
    # Measured, not kept ones; uncompressed, as the probes are (a codec adds its encoding).
    job = _job(connection, replan=False, reuse_profiles=False, wire_compression="none")
    assert job.plan is not None
    assert (ActionType.PROFILE in actions) == own_profile
    # The probes: RAW first (the link, both tiers idle), then at the freeze cut a chunk of
    # a few objects that warms the session, and the measured chunks.
    sessions = list(dict.fromkeys(session for session, _, _ in seen))
    assert len(sessions) == 2
    warm, *measured = [chunk for chunk in seen if chunk[0] == sessions[-1]]
    assert measured and warm[1] < sum(n for _, n, _ in measured)
    reported = sum(r for *_, r in measured) / sum(n for _, n, _ in measured)
    assert reported > 0.0
    assert job.plan.server.compute_s(job.freeze) == pytest.approx(reported, rel=1e-9)


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

    # One chunk of all 24 keys, which the server computes in batches of at most 7.
    loader = FeatureLoader(
        conn, session, conn.manifest("train"), batch_size=4, chunk_size=24, on_part=on_part
    )
    sizes = []
    for _, y in loader.epoch(0):
        sizes.append(len(y))
        first_batch.set()
    conn.close_session(session)
    assert held == [True]
    # Sizes the server's tuner chose for this head (other tests ran it before).
    assert len(parts) > 1 and max(parts) <= 7 and sum(parts) == 24 and sizes == [4] * 6


def test_a_freeze_that_trains_nothing_is_refused_when_the_job_is_built(
    server: HapiServer,
) -> None:
    with pytest.raises(InvalidCut, match="nothing to train"):
        _job(server, freeze="fc")
