"""Actions that compute (`profile`) run inside the memory budget, as chunks do.

The planner profiles a RAW session: before the fix, the profile decoded the job's objects
and ran its heads under that session's RAW memory model, so a transform that
`open_session` refuses went through and allocated what the budget never counted.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from hapi.client import TransferJob, connect
from hapi.data import Transforms, open_store, synth_dataset
from hapi.data.ops import CenterCrop, Normalize, Resize
from hapi.errors import MemoryBusy, OverBudget
from hapi.graph import INPUT, RAW, ModelSpec
from hapi.server import HapiServer, ServerConfig, serve
from hapi.wire import ActionType, ChunkTicket, SessionRequest
from hapi.wire.messages import ProfileRequest
from hapi.wire.replies import ProfileReply

SIZE = 64
SPEC = ModelSpec(name="resnet18", num_classes=3)
BUDGET = 256 << 20
# 80 px images resized to 6000 px before the crop: ~290 MB to decode one, more than the
# budget, though little enough for the test to survive a server that tries it anyway.
HUGE = Transforms((Resize(6000), CenterCrop(SIZE), Normalize())).to_dict()


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("store")
    synth_dataset(open_store(root), "train", classes=3, per_class=4, size=80, seed=1)
    return root


@pytest.fixture(scope="module")
def server(store_dir: Path) -> Iterator[HapiServer]:
    config = ServerConfig(store=str(store_dir), memory_budget=BUDGET, batch_size=8)
    with serve(config) as s:
        yield s


def _request(**overrides: object) -> SessionRequest:
    fields: dict[str, object] = {
        "model": SPEC.to_dict(),
        "cut": RAW,
        "freeze": 8,
        "transforms": Transforms.eval(SIZE).to_dict(),
        "image_size": SIZE,
    }
    fields.update(overrides)
    return SessionRequest(**fields)  # type: ignore[arg-type]


def _profile(conn: object, request: ProfileRequest) -> ProfileReply:
    body = conn.action(ActionType.PROFILE, request.to_bytes())  # type: ignore[attr-defined]
    return ProfileReply.model_validate_json(body)


def test_a_profile_whose_one_sample_cannot_fit_is_refused_as_open_session_is(
    server: HapiServer,
) -> None:
    with connect(server.address) as conn:
        keys = list(conn.manifest("train").keys[:3])
        # A RAW session decodes nothing, so it opens; its transforms are the job's.
        raw = conn.open_session(_request(transforms=HUGE))
        with pytest.raises(OverBudget) as at_open:
            conn.open_session(_request(cut=INPUT, transforms=HUGE))
        with pytest.raises(OverBudget) as profiled:
            _profile(conn, ProfileRequest(session=raw.session, keys=keys, batch_size=8))
        # The same check and the same words: the sizes, the budget, and what to do.
        assert str(profiled.value) == str(at_open.value)
        message = str(profiled.value)
        assert "at cut 0 needs" in message and "for one sample" in message
        assert "memory budget is 256.0 MiB" in message and "raise --memory-budget" in message
        stats = conn.stats()
        assert stats.memory_peak <= stats.memory_budget == BUDGET
        assert stats.sessions[raw.session].samples == 0  # nothing of it was computed
        # The server goes on serving another session.
        info = conn.open_session(_request(cut=5))
        ticket = ChunkTicket(session=info.session, chunk=0, keys=keys, labels=[0] * len(keys))
        assert sum(len(b.keys) for b in conn.fetch(ticket).batches) == len(keys)


def test_a_profile_that_fits_only_in_smaller_batches_runs_in_them(store_dir: Path) -> None:
    keys_n = 3
    with (
        serve(ServerConfig(store=str(store_dir), batch_size=8)) as roomy,
        connect(roomy.address) as conn,
    ):
        keys = list(conn.manifest("train").keys[:keys_n])
        # What a batch at the freeze cut holds (the profile's heaviest), and the weights.
        info = conn.open_session(_request(cut=8))
        held = conn.stats().memory_used
    # Room for the weights and two samples at the freeze cut, not for the eight asked.
    budget = held + info.memory_fixed + 2 * info.memory_per_sample + (1 << 20)
    config = ServerConfig(store=str(store_dir), batch_size=8, memory_budget=budget)
    with serve(config) as tight, connect(tight.address) as conn:
        raw = conn.open_session(_request())
        reply = _profile(conn, ProfileRequest(session=raw.session, keys=keys, batch_size=8))
        assert 1 <= reply.batch_size <= 2 and reply.samples == keys_n
        assert reply.head_s[8] > 0 and reply.memory_bytes[8] == info.memory_per_sample
        stats = conn.stats()
        assert stats.memory_peak <= stats.memory_budget == budget
        assert stats.batches_running == stats.batches_waiting == 0  # all given back
        # And the server keeps serving a session of the same job.
        session = conn.open_session(_request(cut=8)).session
        ticket = ChunkTicket(session=session, chunk=0, keys=keys, labels=[0] * keys_n)
        assert sum(len(b.keys) for b in conn.fetch(ticket).batches) == keys_n
        assert conn.stats().memory_peak <= budget


def test_a_planned_job_whose_samples_cannot_fit_fails_with_the_budget_named(
    server: HapiServer,
) -> None:
    """The issue's job, from the user's side: `cut="auto"` with a transform no budget
    holds. Planning opens its sessions first, and the first is refused: `fit` raises
    `OverBudget` naming the budget before anything is decoded on either tier."""
    job = TransferJob(
        SPEC.to_dict(), "train", server.address, freeze="layer3", image_size=SIZE,
        transforms=Transforms.from_dict(HUGE), retry_budget_s=5,
    )  # fmt: skip
    with pytest.raises(OverBudget, match="memory-budget"):
        job.fit(1)
    assert not job.history.of_kind("plan-deferred")  # bad input, not a fault to wait out
    # The server goes on serving everyone else.
    ok = connect(server.address).open_session(_request(transforms=Transforms.eval(SIZE).to_dict()))
    assert ok.session


def test_a_job_waits_for_memory_other_sessions_hold_and_trains_once_they_close(
    store_dir: Path,
) -> None:
    """A head the budget holds, but not beside another session's: the job's session is
    refused for now (`MemoryBusy`, an `OverBudget`), retried, and opens once the other
    session closes; without that, the job fails at its retry budget, naming the sizes."""
    config = ServerConfig(store=str(store_dir), memory_budget=96 << 20, batch_size=4)
    with serve(config) as server:
        other = connect(server.address)
        held = other.open_session(_request(cut=12, freeze=12)).session  # ~43 MiB
        # resnet34's needs ~82 MiB of the 96: not while the other session holds its head.
        job = TransferJob(
            {"name": "resnet34", "num_classes": 3}, "train", server.address,
            freeze="layer3", cut=None, image_size=SIZE, chunk_size=4, retry_budget_s=2,
        )  # fmt: skip
        with pytest.raises(MemoryBusy, match="open sessions hold"):
            job.fit(1)

        job = TransferJob(
            {"name": "resnet34", "num_classes": 3}, "train", server.address,
            freeze="layer3", cut=None, image_size=SIZE, chunk_size=4, retry_budget_s=60,
        )  # fmt: skip
        closer = threading.Timer(2.0, other.close_session, args=(held,))
        closer.start()
        try:
            (epoch,) = job.fit(1).epochs
        finally:
            closer.join()
        assert epoch.samples == 12
        assert job.history.retries  # it waited, retrying
