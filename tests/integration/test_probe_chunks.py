"""The RAW probe a plan is measured with holds a slow link for a fraction of a second.

At 10 Mbit/s the probe's 16 objects of 90 KB took 1.2 s of a job's start; a first chunk
of four tells the link's pace, and the rest follow only where the link carries them
quickly. Real servers, one behind a shaped egress.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hapi.client import connect
from hapi.client.planning._probe_chunks import RAW_FIRST, link_of, probe_raw
from hapi.data import Transforms, open_store, synth_dataset
from hapi.graph import RAW, ModelSpec
from hapi.server import ServerConfig, serve
from hapi.wire import SessionRequest

KEYS = 12


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("store")
    # Noisy 160 px JPEGs: some 20 KB each, 0.16 s each at 1 Mbit/s.
    synth_dataset(open_store(root), "train", classes=2, per_class=KEYS // 2, size=160, seed=3)
    return root


def _raw_probe(config: ServerConfig) -> tuple[int, int, float]:
    """The probe's objects, requests and the link's measured bytes per second."""
    with serve(config) as server, connect(server.address) as conn:
        manifest = conn.manifest("train")
        request = SessionRequest(
            model=ModelSpec(name="resnet18", num_classes=2).to_dict(),
            cut=RAW,
            transforms=Transforms.eval(32).to_dict(),
            image_size=32,
        )
        session = conn.open_session(request).session
        keys, labels = list(manifest.keys[:KEYS]), list(manifest.labels[:KEYS])
        probe = probe_raw(conn, session, keys, labels)
        assert len(probe.blobs) == probe.samples  # every object read arrives whole
        return probe.samples, probe.requests, link_of(probe).bytes_per_s


def test_a_slow_link_is_probed_with_the_first_chunk_alone(store_dir: Path) -> None:
    samples, requests, rate = _raw_probe(ServerConfig(store=str(store_dir), egress_limit="1mbit"))
    assert (samples, requests) == (RAW_FIRST, 1)
    assert rate < 1e6 / 8 * 1.5  # the shaped rate, give or take the bucket


def test_a_fast_link_is_probed_with_every_object(store_dir: Path) -> None:
    samples, requests, rate = _raw_probe(ServerConfig(store=str(store_dir)))
    assert (samples, requests) == (KEYS, 2)
    assert rate > 1e6 / 8 * 1.5
