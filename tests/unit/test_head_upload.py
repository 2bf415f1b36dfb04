"""Uploading a head: the wire's pieces, the checks on arrival, and the server's store of them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.flight as flight
import pytest
import torch
from torch import nn

from hapi.errors import IntegrityError, InvalidRequest, UnknownModel
from hapi.graph import export_head, load_head, trace
from hapi.graph.export import HeadArtifact
from hapi.server.uploads import HeadUploads, on_device
from hapi.wire import SessionRequest, parse
from hapi.wire.heads import (
    PIECE_BYTES,
    HeadReceiver,
    head_batches,
    head_descriptor,
    head_digest_of,
    head_schema,
)
from hapi.wire.messages import UploadedHead


def _artifact(width: int = 8, seed: int = 0) -> HeadArtifact:
    torch.manual_seed(seed)
    # 768 inputs x `width` outputs: width 512 is 1.5 MB of weights, two pieces.
    net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, width), nn.ReLU(), nn.Linear(width, 2))
    return export_head(trace(net.eval(), (3, 16, 16)), 2)


@pytest.fixture(scope="module")
def large() -> HeadArtifact:
    return _artifact(512)


def _receive(artifact: HeadArtifact, max_bytes: int = 1 << 30) -> HeadArtifact:
    schema = head_schema(artifact.input_shape)
    receiver = HeadReceiver(artifact.digest, schema, max_bytes)
    for batch in head_batches(artifact):
        receiver.add(batch)
    return receiver.artifact()


def test_an_artifact_travels_in_pieces_of_at_most_a_mebibyte(large: HeadArtifact) -> None:
    batches = list(head_batches(large))
    sizes = [len(b.column("data")[0].as_py()) for b in batches]
    assert max(sizes) <= PIECE_BYTES and len(batches) >= 3  # the program, and 2+ of weights
    parts = [b.column("part")[0].as_py() for b in batches]
    assert parts == ["program"] * parts.count("program") + ["weights"] * parts.count("weights")
    received = _receive(large)
    assert received == large


def test_what_arrives_is_checked_against_its_digest_and_the_size_limit(
    large: HeadArtifact,
) -> None:
    other = _artifact(8, seed=1)
    schema = head_schema(large.input_shape)
    receiver = HeadReceiver(other.digest, schema, 1 << 30)  # named as another head
    for batch in head_batches(large):
        receiver.add(batch)
    with pytest.raises(IntegrityError, match="does not match"):
        receiver.artifact()
    with pytest.raises(InvalidRequest, match="larger than this server's limit of 100000 bytes"):
        _receive(large, max_bytes=100_000)
    receiver = HeadReceiver(large.digest, schema, 1 << 30)
    batches = list(head_batches(large))
    receiver.add(batches[-1])  # weights first
    with pytest.raises(InvalidRequest, match="program, then its weights"):
        receiver.add(batches[0])


def test_only_head_descriptors_and_schemas_are_taken(large: HeadArtifact) -> None:
    assert head_digest_of(head_descriptor(large.digest)) == large.digest
    for bad in (
        flight.FlightDescriptor.for_path("hapi-head", "not-a-digest"),
        flight.FlightDescriptor.for_path("elsewhere", large.digest),
        flight.FlightDescriptor.for_command(b"hapi-head"),
    ):
        with pytest.raises(InvalidRequest, match="do not answer do_put but to upload a head"):
            head_digest_of(bad)
    with pytest.raises(InvalidRequest, match="columns"):
        HeadReceiver(large.digest, pa.schema([("x", pa.int64())]), 1 << 30)
    with pytest.raises(InvalidRequest, match="input shape"):
        HeadReceiver(large.digest, pa.schema([("part", pa.string()), ("data", pa.binary())]), 9)


def test_the_server_keeps_uploads_by_digest_newest_first(large: HeadArtifact) -> None:
    small = [_artifact(8, seed=s) for s in range(3)]
    size = len(small[0].program) + len(small[0].weights)
    uploads = HeadUploads(max_bytes=1 << 30, keep_bytes=2 * size + size // 2)
    try:
        for artifact in small:
            schema = head_schema(artifact.input_shape)
            assert uploads.receive(artifact.digest, schema, head_batches(artifact))
        # Kept within keep_bytes: the oldest went.
        assert [uploads.has(a.digest) for a in small] == [False, True, True]
        assert uploads.get(small[1].digest) == small[1] and uploads.size(small[1].digest) == size
        again = small[1]
        assert not uploads.receive(again.digest, head_schema((3, 16, 16)), head_batches(again))
        with pytest.raises(UnknownModel, match="upload it again"):
            uploads.get(small[0].digest)
        root = uploads.root
    finally:
        uploads.close()
    assert not root.exists()


def test_a_killed_servers_directory_goes_when_the_next_server_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    orphan = tmp_path / "hapi-heads-123-abc"
    old = tmp_path / "hapi-heads-nolock"  # made before the lock file: not ours to judge
    for path in (orphan, old):
        (path / "digest").mkdir(parents=True)
    # The orphan's owner took its lock and was killed (SIGKILL runs no cleanup).
    killed = subprocess.run(
        [
            sys.executable,
            "-c",
            "import fcntl, os, signal, sys\n"
            "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n",
            str(orphan / ".owner.lock"),
        ],
        check=False,
    )
    assert killed.returncode == -signal.SIGKILL
    living = HeadUploads()  # holds its own lock
    try:
        assert not orphan.exists() and old.exists()
        assert living.root.parent == tmp_path
        assert living.root.name.startswith(f"hapi-heads-{os.getpid()}-")
        second = HeadUploads()  # a server beside it leaves a living one's directory alone
        assert living.root.exists()
        second.close()
    finally:
        living.close()
    assert not living.root.exists()
    living.close()  # twice is harmless


def test_a_session_names_an_uploaded_head_by_digest() -> None:
    digest = "ab" * 32
    body = b'{"model": {"module": "MyNet", "artifact": "%s"}, "cut": 3, "transforms": {}}'
    request = parse(SessionRequest, body % digest.encode())
    assert request.model == UploadedHead(module="MyNet", artifact=digest)
    assert parse(SessionRequest, request.to_bytes()) == request
    with pytest.raises(InvalidRequest, match="model.uploaded.artifact"):
        parse(SessionRequest, body % b"not-a-digest")
    spec = parse(SessionRequest, b'{"model": {"name": "resnet18"}, "cut": 3, "transforms": {}}')
    assert spec.model == {"name": "resnet18"} and not spec.exact


class _MakesTensors(nn.Module):
    """Makes a tensor in its forward: torch.export records the trainer's device in the op."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x) + torch.arange(x.shape[-1]).float()
        return self.fc(x.mean((2, 3)))


def test_a_head_exported_on_one_device_runs_on_the_servers() -> None:
    graph = trace(_MakesTensors().eval(), (3, 8, 8))
    artifact = export_head(graph, graph.num_cuts - 1)
    x = torch.randn(2, 3, 8, 8)
    with pytest.raises(RuntimeError, match="device"):
        load_head(artifact).to("meta")(x.to("meta"))  # arange stays on the CPU
    # The meta device stands in for a GPU: shapes flow, and nothing stays on the CPU.
    moved = on_device(load_head(artifact), torch.device("meta"))
    assert moved(x.to("meta")).shape == (2, 4)
    with torch.no_grad():
        assert torch.equal(
            on_device(load_head(artifact), torch.device("cpu"))(x),
            graph.head(graph.num_cuts - 1)(x),
        )
