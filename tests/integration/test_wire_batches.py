"""Wire batches are bounded in bytes, whatever the cut: what a chunk holds outside the
memory budget (its batches waiting for their stream) stays a few MiB per chunk."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hapi.client import connect
from hapi.data import Transforms, open_store, synth_dataset
from hapi.graph import RAW, ModelSpec
from hapi.server import HapiServer, ServerConfig, serve
from hapi.server.chunks._batches import WIRE_BATCH_BYTES
from hapi.server.chunks.session import RAW_BATCH_BYTES
from hapi.wire import ChunkTicket, SessionRequest

SIZE = 64
MiB = 1 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HapiServer]:
    root = tmp_path_factory.mktemp("store")
    # Photos of ~20-30 KB: 48 of them are more than one RAW batch.
    synth_dataset(open_store(root), "train", classes=2, per_class=24, size=320)
    with serve(ServerConfig(store=str(root), batch_size=16, memory_budget="1GiB")) as s:
        yield s


def _request(cut: int) -> SessionRequest:
    return SessionRequest(
        model=ModelSpec(name="resnet18", num_classes=2).to_dict(),
        cut=cut,
        freeze=8,
        transforms=Transforms.eval(SIZE).to_dict(),
        image_size=SIZE,
    )


def test_a_cut_with_large_features_runs_batches_of_at_most_a_mib(server: HapiServer) -> None:
    with connect(server.address) as conn:
        keys = list(conn.manifest("train").keys[:16])
        # ResNet-18's relu at 64 px: 64 x 32 x 32 floats, 256 KiB a sample; 16 of them
        # (the server's batch) would be 4 MiB.
        info = conn.open_session(_request(3))
        assert info.bytes_per_sample == 256 << 10
        result = conn.fetch(ChunkTicket(session=info.session, chunk=0, keys=keys, labels=[0] * 16))
        sizes = [b.features.shape[0] for b in result.batches if b.features is not None]
        # A cut whose features are small still runs the server's whole batch.
        late = conn.open_session(_request(8))
        small = conn.fetch(ChunkTicket(session=late.session, chunk=0, keys=keys, labels=[0] * 16))
    assert sum(sizes) == 16 and max(sizes) * info.bytes_per_sample <= WIRE_BATCH_BYTES
    assert sizes == [4, 4, 4, 4]
    assert [b.features.shape[0] for b in small.batches if b.features is not None] == [16]


def test_raw_batches_are_cut_at_a_mib(server: HapiServer) -> None:
    with connect(server.address) as conn:
        keys = list(conn.manifest("train").keys)
        info = conn.open_session(_request(RAW))
        ticket = ChunkTicket(session=info.session, chunk=0, keys=keys, labels=[0] * len(keys))
        batches = [b.data for b in conn.fetch(ticket).batches if b.data]
    sizes = [sum(len(d) for d in data) for data in batches]
    largest = max(len(d) for data in batches for d in data)
    assert sum(len(data) for data in batches) == len(keys)
    assert len(batches) >= 2 and max(sizes) < RAW_BATCH_BYTES + largest
    assert MiB == RAW_BATCH_BYTES
