"""`hapi serve` in a real memory cgroup capped by the README's rule survives many jobs.

The rule: cap >= idle + budget + 8 MiB per chunk in flight, idle being the warm server's
charge less what its budget holds. Jobs here are connections streaming chunks at ResNet-18's `relu`
(the largest features, 256 KiB a sample at 64 px) and RAW, two chunks of 64 keys in
flight each, behind a 400 Mbit/s egress limit: the batches the chunks have computed wait
for the link outside the budget, which wire batches of at most 1 MiB keep to a few MiB
per chunk (the server's batches of 16 would be 4 MiB each, three of them per chunk: the
kernel killed the server).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hapi.client import connect
from hapi.data import Transforms, open_store, synth_dataset
from hapi.errors import HapiError
from hapi.graph import RAW, ModelSpec
from hapi.wire import ChunkTicket, SessionRequest

from ..memory_cgroup import CgroupUnavailable, MemoryCgroup

MiB = 1 << 20
BUDGET = 64 * MiB
JOBS, IN_FLIGHT, CHUNK = 6, 2, 64
PER_JOB = 8 * MiB * IN_FLIGHT  # the rule's 8 MiB per chunk in flight
SIZE = 64


@pytest.fixture
def group() -> Iterator[MemoryCgroup]:
    try:
        with MemoryCgroup(None, name="hapi-cap") as made:
            yield made
    except CgroupUnavailable as exc:
        pytest.skip(f"cannot make a memory cgroup here: {exc}")


def _request(cut: int) -> SessionRequest:
    return SessionRequest(
        model=ModelSpec(name="resnet18", num_classes=2).to_dict(),
        cut=cut,
        freeze=8,
        transforms=Transforms.eval(SIZE).to_dict(),
        image_size=SIZE,
    )


def _job(address: str, cut: int, keys: list[str], done: list[int], errors: list[str]) -> None:
    """One job: a connection with IN_FLIGHT chunk streams at once, every key once."""
    with connect(address, timeout=120) as conn:
        session = conn.open_session(_request(cut)).session
        chunks = [keys[i : i + CHUNK] for i in range(0, len(keys), CHUNK)]

        def stream(n: int) -> None:
            part = chunks[n]
            ticket = ChunkTicket(session=session, chunk=n, keys=part, labels=[0] * len(part))
            try:
                pieces = conn.stream(ticket)
                done.append(sum(len(p.batch.keys) for p in pieces if p.batch is not None))
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}"[:200])

        for start in range(0, len(chunks), IN_FLIGHT):
            threads = [
                threading.Thread(target=stream, args=(n,))
                for n in range(start, min(start + IN_FLIGHT, len(chunks)))
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()


def test_a_server_capped_by_the_rule_serves_every_job(tmp_path: Path, group: MemoryCgroup) -> None:
    synth_dataset(open_store(tmp_path), "train", classes=2, per_class=128, size=160)
    port = _free_port()
    address = f"grpc://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "hapi.cli", "serve", "--store", str(tmp_path)]
    cmd += ["--port", str(port), "--threads", "1", "--batch-size", "16"]
    cmd += ["--memory-budget", str(BUDGET), "--egress-limit", "400mbit"]
    server = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=group.preexec
    )
    try:
        _wait_ready(address, server)
        with connect(address, timeout=120) as conn:
            keys = list(conn.manifest("train").keys)
            warm: list[int] = []
            _job(address, 3, keys[:CHUNK], warm, [])  # its head, traced and measured
            time.sleep(0.5)
            idle = group.usage() - conn.stats().memory_used
            cap = idle + BUDGET + PER_JOB * JOBS
            group.set_limit(cap)
            group.reset_peak()
            done: list[int] = []
            errors: list[str] = []
            cuts = [3, 3, RAW] * (JOBS // 3)
            jobs = [
                threading.Thread(target=_job, args=(address, cut, keys, done, errors))
                for cut in cuts
            ]
            for t in jobs:
                t.start()
            for t in jobs:
                t.join()
            assert server.poll() is None, "the kernel killed the server at the cap"
            stats = conn.stats()
    finally:
        server.terminate()
        server.wait(30)
    assert group.oom_kills() == 0
    assert errors == [] and sum(done) == JOBS * len(keys)
    assert stats.memory_peak <= BUDGET
    # The kernel held the group to the rule's cap (the limit set is the one that bound it).
    assert group.peak() <= cap == group.limit


def _wait_ready(address: str, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120
    while True:
        try:
            connect(address, timeout=2).stats()
            return
        except HapiError:
            assert server.poll() is None, "hapi serve exited"
            assert time.monotonic() < deadline, "hapi serve did not start"
            time.sleep(0.2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
