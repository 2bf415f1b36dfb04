"""Locks whose process is gone are stale at once, but only where that can be known for sure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from hapi.repo import ModelRepo, RepoConfig
from hapi.repo.storage.liveness import machine_id, process_started

pytestmark = pytest.mark.skipif(machine_id() is None, reason="process liveness needs Linux /proc")


@pytest.fixture
def repo() -> ModelRepo:
    # lock_wait_s=0: a push that had to wait for a gc lock would fail at once.
    return ModelRepo.open(f"memory://{uuid.uuid4().hex}", config=RepoConfig(lock_wait_s=0))


@pytest.fixture
def exited() -> Iterator[int]:
    """The pid of a child that has exited and been collected."""
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    yield child.pid


def put_lock(repo: ModelRepo, kind: str, **fields: Any) -> str:
    """A lock as another process writes it (the stored format)."""
    body = {"kind": kind, "created": repo.locks.clock(), "owner": "someone:1", **fields}
    key = f"locks/{kind}-{uuid.uuid4().hex}.json"
    repo.store.put(key, json.dumps(body).encode())
    return key


def test_a_lock_names_its_process_which_keeps_it_live(repo: ModelRepo) -> None:
    held = repo.locks.acquire_push()
    [lock] = repo.locks.live("push")
    assert (lock.machine, lock.pid) == (machine_id(), os.getpid())
    assert lock.started == process_started(os.getpid()) and not lock.holder_gone
    assert repo.gc().skipped
    held.release()
    assert not repo.gc().skipped


def test_a_dead_push_does_not_hold_off_gc(repo: ModelRepo, exited: int) -> None:
    repo.push({"w": torch.ones(3)}, "net")
    repo.rm("net")
    put_lock(repo, "push", machine=machine_id(), pid=exited, started=123)
    report = repo.gc()
    assert not report.skipped and report.removed_blobs == 1 and report.removed_locks == 1
    assert repo.locks.read() == []


def test_a_dead_gc_does_not_hold_off_pushes(repo: ModelRepo, exited: int) -> None:
    put_lock(repo, "gc", machine=machine_id(), pid=exited)
    assert repo.push({"w": torch.ones(3)}, "net").version == 1


def test_an_exited_but_uncollected_process_is_gone(repo: ModelRepo) -> None:
    child = subprocess.Popen([sys.executable, "-c", ""])
    try:
        # Wait for it to exit but leave it a zombie: its pid still exists.
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
        put_lock(repo, "push", machine=machine_id(), pid=child.pid)
        assert not repo.gc().skipped
    finally:
        child.wait()


def test_a_reused_pid_is_told_by_its_start_time(repo: ModelRepo) -> None:
    me, started = os.getpid(), process_started(os.getpid())
    assert started is not None
    put_lock(repo, "push", machine=machine_id(), pid=me, started=started)
    assert repo.gc().skipped  # our own pid, our own start: alive
    for lock in repo.locks.read():
        repo.store.delete(lock.key)
    put_lock(repo, "push", machine=machine_id(), pid=me, started=started - 1)
    assert not repo.gc().skipped  # same pid, another process: the writer is gone


def test_locks_from_elsewhere_wait_for_their_ttl(repo: ModelRepo, exited: int) -> None:
    elsewhere = "other-host/boot/pid:[1]"
    put_lock(repo, "push", machine=elsewhere, pid=exited)
    put_lock(repo, "push", pid=exited)  # written before locks named their machine
    put_lock(repo, "push", machine=machine_id(), pid=0)  # never a process group
    assert len(repo.locks.live("push")) == 3
    report = repo.gc()
    assert report.skipped and "3 push(es) running" in report.reason
