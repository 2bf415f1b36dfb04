"""One protocol for everything the trainer asks of a server (`Server`): a Flight
`Connection` and the in-memory `MemorySource` both speak it, and the planner takes either."""

from __future__ import annotations

import torch
from torch import nn

from hapi.client import Connection
from hapi.client.planning._server_profile import profile_action
from hapi.client.servers.memory import MemorySource
from hapi.client.servers.source import Server
from hapi.data import open_store, synth_dataset
from hapi.graph import export_head, trace


def test_a_connection_and_a_memory_source_are_servers() -> None:
    assert isinstance(Connection(address="grpc://127.0.0.1:1"), Server)  # connects lazily
    assert isinstance(MemorySource(), Server)


def test_a_memory_source_lists_its_store_as_a_server_does() -> None:
    store = open_store("memory://")
    synth_dataset(store, "train", classes=2, per_class=3, size=16, seed=1)
    manifest = MemorySource(store=store).manifest("train")
    assert len(manifest) == 6 and sorted(set(manifest.labels)) == [0, 1]


def test_the_planner_profiles_a_server_without_the_action_another_way() -> None:
    # As an older server's, the profile is refused: the planner scales the trainer's heads.
    assert profile_action(MemorySource(), "s", ["a", "b"], batch_size=2) is None


def test_a_head_is_kept_once_by_its_digest() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2))
    model(torch.zeros(1, 3, 8, 8))
    head = export_head(trace(model, (3, 8, 8)), 1)
    source = MemorySource()
    source.put_head(head)
    source.put_head(head)
    assert list(source.heads) == [head.digest]
