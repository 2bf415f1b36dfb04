"""A server under a memory budget: refusals, adaptive batches, cold opens, order, profiles."""

from __future__ import annotations

import io
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from PIL import Image

from hapi.client import Connection, connect
from hapi.data import Transforms, open_store, synth_dataset
from hapi.data.ops import CenterCrop, Normalize, Resize
from hapi.errors import InvalidCut, OverBudget
from hapi.graph import ModelSpec
from hapi.plan.profiles import ServerProfile
from hapi.server import HapiServer, ServerConfig, serve
from hapi.server.memory.budget import MemoryModel
from hapi.server.memory.scheduler import Demand
from hapi.wire import ActionType, ChunkReport, ChunkTicket, SessionRequest
from hapi.wire.messages import ProfileRequest
from hapi.wire.replies import ProfileReply

SIZE = 64
SPEC = ModelSpec(name="resnet18", num_classes=3)
EVAL = Transforms.eval(SIZE)


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("store")
    synth_dataset(open_store(root), "train", classes=3, per_class=8, size=80, seed=1)
    # 6000 x 6000 pixels: 144 MB decoded in PIL (and twice that while converted), a few
    # kilobytes as a PNG of one colour.
    data = io.BytesIO()
    Image.new("RGB", (6000, 6000), (90, 120, 30)).save(data, format="PNG")
    open_store(root).put("big/cat/huge.png", data.getvalue())
    # The same as a JPEG, which decodes at 1/8 of its size for a 64 px model: 2 MB.
    data = io.BytesIO()
    Image.new("RGB", (6000, 6000), (90, 120, 30)).save(data, format="JPEG")
    open_store(root).put("big/cat/huge.jpg", data.getvalue())
    return root


@pytest.fixture(scope="module")
def small(store_dir: Path) -> Iterator[HapiServer]:
    with serve(ServerConfig(store=str(store_dir), memory_budget="256MiB", batch_size=8)) as s:
        yield s


def _request(**overrides: object) -> SessionRequest:
    fields: dict[str, object] = {
        "model": SPEC.to_dict(),
        "cut": 5,
        "freeze": 8,
        "transforms": EVAL.to_dict(),
        "image_size": SIZE,
    }
    fields.update(overrides)
    return SessionRequest(**fields)  # type: ignore[arg-type]


def _ticket(session: str, keys: list[str], chunk: int = 0) -> ChunkTicket:
    return ChunkTicket(session=session, chunk=chunk, keys=keys, labels=[0] * len(keys))


def _features(conn: Connection, session: str, keys: list[str]) -> tuple[torch.Tensor, int]:
    result = conn.fetch(_ticket(session, keys))
    batches = [b.features for b in result.batches if b.features is not None]
    return torch.cat(batches), len(batches)


def test_what_cannot_fit_is_refused_at_open_naming_the_budget(small: HapiServer) -> None:
    with connect(small.address) as conn:
        for ops in ((Resize(100_000), CenterCrop(SIZE)), (CenterCrop(60_000),)):
            transforms = Transforms((*ops, Normalize())).to_dict()
            with pytest.raises(OverBudget, match=r"memory budget is 256\.0 MiB"):
                conn.open_session(_request(transforms=transforms))
        # Tracing resnet18 at 4096 px would run a 1 GB activation: refused from shapes.
        with pytest.raises(OverBudget, match=r"4096 px.*memory budget is 256\.0 MiB"):
            conn.open_session(_request(image_size=4096))
        # Nothing of that was allocated in the budget, and the server goes on serving.
        stats = conn.stats()
        assert stats.memory_peak <= stats.memory_budget == 256 << 20
        info = conn.open_session(_request())
        assert info.memory_per_sample > 0 and info.batch_size == 8
        keys = list(conn.manifest("train").keys[:3])
        assert _features(conn, info.session, keys)[0].shape[0] == 3


def test_an_image_too_large_for_the_budget_is_refused_before_decoding(small: HapiServer) -> None:
    with connect(small.address) as conn:
        key = conn.manifest("train").keys[0]
        skipping = conn.open_session(_request(on_error="skip"))
        result = conn.fetch(_ticket(skipping.session, ["big/cat/huge.png", key]))
        assert [k for b in result.batches for k in b.keys] == [key]
        assert [(s.key, s.error) for s in result.skipped] == [("big/cat/huge.png", "OverBudget")]
        raising = conn.open_session(_request())
        with pytest.raises(OverBudget, match="huge.png"):
            conn.fetch(_ticket(raising.session, [key, "big/cat/huge.png"]))
        assert conn.stats().memory_peak <= 256 << 20


def test_a_large_jpeg_is_counted_at_the_size_it_decodes_at(small: HapiServer) -> None:
    # Counted at its stored size, it would need 288 MB and be refused like the PNG.
    with connect(small.address) as conn:
        info = conn.open_session(_request())
        result = conn.fetch(_ticket(info.session, ["big/cat/huge.jpg"]))
        assert [k for b in result.batches for k in b.keys] == ["big/cat/huge.jpg"]
        assert not result.skipped
        assert conn.stats().memory_peak <= 256 << 20


def test_batches_shrink_to_the_budget_and_features_stay_the_same(store_dir: Path) -> None:
    with (
        serve(ServerConfig(store=str(store_dir), batch_size=8)) as roomy,
        connect(roomy.address) as conn,
    ):
        info = conn.open_session(_request())
        keys = list(conn.manifest("train").keys[:12])
        expected, batches = _features(conn, info.session, keys)
        assert batches == 2
        held = conn.stats().memory_used  # the model's weights, loaded once
    # Room for the weights and two samples of one batch at a time.
    budget = held + info.memory_fixed + 2 * info.memory_per_sample + (1 << 20)
    config = ServerConfig(store=str(store_dir), batch_size=8, memory_budget=budget)
    with serve(config) as tight, connect(tight.address) as conn:
        info = conn.open_session(_request())
        got, batches = _features(conn, info.session, keys)
        # A profile asked to time the job's batches of 8 times what the budget grants,
        # and keeps it for no other job.
        profile = ProfileRequest(session=info.session, keys=keys[:3], batch_size=8)
        for _ in range(2):
            reply = ProfileReply.model_validate_json(
                conn.action(ActionType.PROFILE, profile.to_bytes())
            )
            assert 1 <= reply.batch_size <= 2 and not reply.cached and reply.head_s[8] > 0
        stats = conn.stats()
    assert batches >= 6  # batches of 2 (or 1), not 8
    assert stats.memory_peak <= stats.memory_budget == budget
    # A batch size changes no sample's result beyond fp32 tolerance.
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


COLD_OPENS = [
    ("resnet18", 32, 5),
    ("resnet18", 64, 5),
    ("mobilenet_v3_small", 32, 3),
    ("resnet18", 32, 7),
    ("resnet18", 64, 5),
    ("mobilenet_v3_small", 32, 3),
    ("resnet18", 32, 5),
    ("mobilenet_v3_small", 64, 4),
]


@pytest.mark.parametrize("trial", range(3))
def test_eight_cold_opens_at_once_all_succeed(store_dir: Path, trial: int) -> None:
    with serve(ServerConfig(store=str(store_dir))) as server, connect(server.address) as conn:
        keys = list(conn.manifest("train").keys[:2])
        # A session already streaming while the others open: tracing must not touch it.
        busy = conn.open_session(_request(cut=3))
        stop, failures = threading.Event(), []

        def stream() -> None:
            while not stop.is_set():
                try:
                    conn.fetch(_ticket(busy.session, keys))
                except Exception as exc:
                    failures.append(exc)

        streamer = threading.Thread(target=stream)
        streamer.start()
        start = threading.Barrier(len(COLD_OPENS))
        opened: dict[int, str] = {}

        def open_one(i: int) -> None:
            name, size, cut = COLD_OPENS[i]
            request = _request(
                model=ModelSpec(name=name, num_classes=3).to_dict(),
                cut=cut,
                freeze=cut,
                transforms=Transforms.eval(size).to_dict(),
                image_size=size,
            )
            start.wait()
            try:
                with connect(server.address) as own:
                    opened[i] = own.open_session(request).session
            except Exception as exc:
                failures.append(exc)

        openers = [threading.Thread(target=open_one, args=(i,)) for i in range(len(COLD_OPENS))]
        for t in openers:
            t.start()
        for t in openers:
            t.join(timeout=300)
        stop.set()
        streamer.join(timeout=60)
        assert failures == [] and len(opened) == len(COLD_OPENS)
        # Every session computes, so no broken model was cached.
        for session in opened.values():
            assert conn.fetch(_ticket(session, keys)).batches


def test_chunks_of_a_session_finish_in_order(store_dir: Path) -> None:
    # Three batches a chunk: a chunk's stream ends a whole chunk's compute before the next
    # one's can, whatever the test's threads are doing meanwhile.
    config = ServerConfig(store=str(store_dir), batch_size=2, compute_slots=1)
    with serve(config) as server, connect(server.address) as conn:
        info = conn.open_session(_request())
        keys = list(conn.manifest("train").keys)
        finished: list[int] = []
        reports: dict[int, ChunkReport] = {}

        def run(chunk: int) -> None:
            with connect(server.address) as own:
                for part in own.stream(_ticket(info.session, keys[chunk * 6 :][:6], chunk)):
                    if part.report is not None:
                        reports[chunk] = part.report
            finished.append(chunk)

        hold = Demand(model=MemoryModel(fixed=0, per_sample=0), max_batch=1)
        with server.scheduler.run("test", (0, 0), hold):
            # All four wait for the one compute slot, asked for from last to first.
            threads = [threading.Thread(target=run, args=(c,)) for c in (3, 2, 1, 0)]
            for t in threads:
                t.start()
            while server.scheduler.stats().waiting < 4:
                threading.Event().wait(0.01)
        for t in threads:
            t.join(timeout=120)
    assert finished == [0, 1, 2, 3]
    for chunk, report in reports.items():
        assert report.chunk == chunk and report.server_s > 0 and 0 <= report.free_share <= 1
    assert reports[0].queue_s < reports[3].queue_s


def test_profile_times_every_cut_on_the_jobs_objects(small: HapiServer) -> None:
    with connect(small.address) as conn:
        info = conn.open_session(_request(cut=5, freeze=8, wire_dtype="fp16"))
        keys = list(conn.manifest("train").keys[:3])
        request = ProfileRequest(session=info.session, keys=keys)
        reply = ProfileReply.model_validate_json(
            conn.action(ActionType.PROFILE, request.to_bytes())
        )
        assert len(reply.head_s) == len(reply.out_bytes) == len(reply.memory_bytes) == 9
        assert reply.head_s[0] == 0 and reply.head_s == sorted(reply.head_s) and reply.head_s[8] > 0
        assert reply.cut_names[0] == "input" and len(reply.cut_names) == 9
        assert reply.out_bytes[0] > 2 * 3 * SIZE * SIZE  # fp16 input, plus key and label
        assert (
            reply.out_bytes[5] - reply.out_bytes[0]
            == 2 * info.feature_shape[0] * (info.feature_shape[1] * info.feature_shape[2])
            - 2 * 3 * SIZE * SIZE
        )
        assert all(m > 0 for m in reply.memory_bytes) and reply.batch_size == 4
        assert reply.read_s > 0 and reply.decode_s > 0 and reply.raw_bytes > 0
        assert reply.key.input_shape == [3, SIZE, SIZE] and reply.key.device == "cpu"
        assert not reply.cached and reply.samples == 3
        profile = ServerProfile.from_dict(reply.server_profile())  # what the planner reads
        assert profile.last_cut == 8 and profile.wire_dtype == "fp16"
        again = ProfileReply.model_validate_json(
            conn.action(ActionType.PROFILE, request.to_bytes())
        )
        assert again.cached and again.head_s == reply.head_s
        # Timed in the job's batches, up to the server's own (8): each batch its own entry.
        for asked, ran in ((6, 6), (100, 8)):
            sized = request.model_copy(update={"batch_size": asked})
            reply = ProfileReply.model_validate_json(
                conn.action(ActionType.PROFILE, sized.to_bytes())
            )
            assert reply.batch_size == ran and not reply.cached
        fewer = ProfileRequest(session=info.session, keys=keys[:1], cuts=[2, 3])
        short = ProfileReply.model_validate_json(conn.action(ActionType.PROFILE, fewer.to_bytes()))
        assert len(short.head_s) == 4
        with pytest.raises(InvalidCut, match="0..8"):
            past = ProfileRequest(session=info.session, keys=keys, cuts=[9])
            conn.action(ActionType.PROFILE, past.to_bytes())
