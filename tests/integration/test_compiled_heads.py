"""A server compiles a head (`compile_heads`) for sessions that are not exact: its
features agree with an eager server's, it says how each head runs, and exact sessions
stay eager."""

from __future__ import annotations

import time

import pytest
import torch

from hapi.client import FeatureLoader, connect
from hapi.data import Transforms, open_store, synth_dataset
from hapi.server import HapiServer, serve
from hapi.wire import SessionRequest

SIZE = 32
CUT = 6  # ResNet-18's layer1: a short graph, so a short compile


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("store")
    synth_dataset(open_store(root), "train", classes=2, per_class=6, size=40, seed=3)
    return str(root)


def _epoch(server: HapiServer, *, exact: bool = False) -> tuple[dict[str, torch.Tensor], int]:
    """Each key's features over one session, and the samples its compiled head gave."""
    request = SessionRequest(
        model={"name": "resnet18"},
        cut=CUT,
        freeze=CUT,
        transforms=Transforms.eval(SIZE).to_dict(),
        image_size=SIZE,
        exact=exact,
    )
    with connect(server.address) as conn:
        info = conn.open_session(request)
        loader = FeatureLoader(conn, info.session, conn.manifest("train"), batch_size=6)
        features = {
            k: f for b in loader.batches(0) for k, f in zip(b.keys, b.features, strict=True)
        }
        stats = conn.close_session(info.session)
    return features, stats.compiled_samples


@pytest.fixture(scope="module")
def eager(root: str) -> dict[str, torch.Tensor]:
    with serve(store=root, batch_size=6, compile_heads="off") as server:
        return _epoch(server)[0]


def test_a_compiled_head_serves_the_features_eager_would(
    root: str, eager: dict[str, torch.Tensor]
) -> None:
    with serve(store=root, batch_size=6, compile_heads="always") as server:
        compiled = 0
        deadline = time.monotonic() + 240  # a cold compile on a busy 2-core machine
        while not compiled and time.monotonic() < deadline:
            features, compiled = _epoch(server)
            (state,) = server.stats().compiled_heads.values()
            assert not state.startswith("refused"), state
        assert compiled, state
        assert state.startswith("compiled for batches of 6"), state
        exact, exact_compiled = _epoch(server, exact=True)
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
