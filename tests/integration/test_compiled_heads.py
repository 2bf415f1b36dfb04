"""A server compiles a head (`compile_heads`) for sessions that are not exact: its
features agree with an eager server's, it says how each head runs, and exact sessions
stay eager."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from hapi.client import FeatureLoader, TransferJob, connect
from hapi.data import Transforms, open_store, synth_dataset
from hapi.server import HapiServer, serve
from hapi.wire import SessionRequest
from hapi.wire.messages import ProfileRequest
from hapi.wire.replies import ProfileReply

SIZE = 32
CUT = 6  # ResNet-18's layer1: a short graph, so a short compile
MODEL = {"name": "resnet18", "num_classes": 2}
"""The job's model too: one head, compiled once for both tests of the `always` server."""


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("store")
    synth_dataset(open_store(root), "train", classes=2, per_class=6, size=40, seed=3)
    return str(root)


def _request(exact: bool = False) -> SessionRequest:
    return SessionRequest(
        model=MODEL,
        cut=CUT,
        freeze=CUT,
        transforms=Transforms.eval(SIZE).to_dict(),
        image_size=SIZE,
        exact=exact,
    )


def _epoch(server: HapiServer, *, exact: bool = False) -> tuple[dict[str, torch.Tensor], int]:
    """Each key's features over one session, and the samples its compiled head gave."""
    with connect(server.address) as conn:
        info = conn.open_session(_request(exact))
        loader = FeatureLoader(conn, info.session, conn.manifest("train"), batch_size=6)
        features = {
            k: f for b in loader.batches(0) for k, f in zip(b.keys, b.features, strict=True)
        }
        stats = conn.close_session(info.session)
    return features, stats.compiled_samples


def _profile(server: HapiServer) -> ProfileReply:
    with connect(server.address) as conn:
        info = conn.open_session(_request())
        keys = list(conn.manifest("train").keys[:4])
        reply = conn.profile(ProfileRequest(session=info.session, keys=keys))
        conn.close_session(info.session)
    return reply


@pytest.fixture(scope="module")
def always(root: str) -> Iterator[HapiServer]:
    with serve(store=root, batch_size=6, compile_heads="always") as server:
        yield server


@pytest.fixture(scope="module")
def eager(root: str) -> dict[str, torch.Tensor]:
    with serve(store=root, batch_size=6, compile_heads="off") as server:
        return _epoch(server)[0]


def test_a_compiled_head_serves_the_features_eager_would(
    always: HapiServer, eager: dict[str, torch.Tensor]
) -> None:
    server = always
    before = _profile(server)
    compiled = 0
    deadline = time.monotonic() + 240  # a cold compile on a busy 2-core machine
    while not compiled and time.monotonic() < deadline:
        features, compiled = _epoch(server)
        (state,) = server.stats().compiled_heads.values()
        assert not state.startswith("refused"), state
    assert compiled, state
    assert state.startswith("compiled for batches of 6"), state
    exact, exact_compiled = _epoch(server, exact=True)
    # The planner is told the head as it runs now: the cached profile, at its speed.
    ((_, speed),) = server.opener.compiled.speeds().items()
    after = _profile(server)
    assert after.head_s[CUT] == pytest.approx(before.head_s[CUT] * speed)
    assert after.head_s[:CUT] == before.head_s[:CUT]
    assert features.keys() == eager.keys() == exact.keys()
    scale = max(f.abs().max().item() for f in eager.values())
    assert max((features[k] - eager[k]).abs().max().item() for k in eager) <= 1e-4 * scale
    assert exact_compiled == 0  # exact sessions never run the compiled head
    assert max((exact[k] - eager[k]).abs().max().item() for k in eager) <= 1e-4 * scale


def test_a_server_with_compiling_off_keeps_every_head_eager(root: str) -> None:
    with serve(store=root, batch_size=6, compile_heads="off") as server:
        _, compiled = _epoch(server)
        assert compiled == 0
        assert server.stats().compiled_heads == {}


def test_a_jobs_history_says_how_the_server_ran_its_head(always: HapiServer) -> None:
    server = always
    job = TransferJob(
        MODEL, "train", server.address, freeze="layer1", cut=None, image_size=SIZE, seed=1
    )
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not (
        job.history.epochs and job.history.epochs[-1].server_compiled
    ):
        job.fit(1, lr=0.01)
    last = job.history.epochs[-1]
    assert 0 < last.server_compiled <= last.samples == 12
    assert last.server_head.startswith("compiled for batches of 6"), last.server_head
    assert f"({last.server_compiled} by the server's compiled head)" in job.history.explain()
    assert "the server's head: compiled for batches of 6" in job.history.explain()
