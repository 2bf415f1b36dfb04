"""The server these modules talk to: a small store with a corrupt object, a served ResNet-18,
and the requests and tickets they send it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from hapi.client import Connection, connect
from hapi.data import (
    Transforms,
    open_store,
    synth_dataset,
)
from hapi.graph import ModelSpec
from hapi.server import HapiServer, ServerConfig, serve
from hapi.wire import (
    ChunkTicket,
    SessionRequest,
)

SIZE = 64
SPEC = ModelSpec(name="resnet18", num_classes=3)
EVAL = Transforms.eval(SIZE)


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("store")
    synth_dataset(open_store(root), "train", classes=3, per_class=4, size=80, seed=1)
    store = open_store(root)
    store.put("bad/cat/broken.jpg", b"this is not a jpeg")
    store.put("bad/cat/fine.jpg", store.get(next(iter(sorted(store.list("train"))))))
    return root


@pytest.fixture(scope="module")
def server(store_dir: Path) -> Iterator[HapiServer]:
    with serve(ServerConfig(store=str(store_dir), batch_size=5)) as running:
        yield running


@pytest.fixture
def conn(server: HapiServer) -> Iterator[Connection]:
    with connect(server.address) as c:
        yield c


def session_request(**overrides: object) -> SessionRequest:
    fields: dict[str, object] = {
        "model": SPEC.to_dict(),
        "cut": 5,
        "freeze": 8,
        "transforms": EVAL.to_dict(),
        "image_size": SIZE,
    }
    fields.update(overrides)
    return SessionRequest(**fields)  # type: ignore[arg-type]


def chunk_ticket(session: str, keys: list[str], epoch: int = 0) -> ChunkTicket:
    return ChunkTicket(session=session, chunk=0, epoch=epoch, keys=keys, labels=[0] * len(keys))
