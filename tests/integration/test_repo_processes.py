"""Several processes pushing and reading one local-directory repository at once, and one
killed in the middle of a push."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hapi.repo import ModelRepo
from hapi.repo.storage.liveness import machine_id

BASE = {"frozen": torch.arange(4096, dtype=torch.float32), "head": torch.zeros(16)}


def derived(tag: int) -> dict[str, torch.Tensor]:
    """A fine-tune of BASE whose head encodes `tag`, so any reader can check what it got."""
    return {"frozen": BASE["frozen"], "head": torch.full((16,), float(tag))}


def worker(uri: str, catalog: str, rank: int) -> list[tuple[str, int, int]]:
    torch.set_num_threads(1)
    repo = ModelRepo.open(uri, catalog=catalog)
    pushed = []
    for i in range(4):
        tag = rank * 100 + i
        name = "shared" if i % 2 == 0 else f"own{rank}"
        v = repo.push(derived(tag), name, parent="base", metrics={"tag": tag})
        pushed.append((v.id, tag, v.version))
        # Read whatever the newest shared version is now, whoever pushed it.
        newest = repo.resolve("shared")
        head = repo.pull(newest)["head"]
        assert head[0].item() == newest.metrics["tag"]
    return pushed


def test_concurrent_processes_share_one_repository(tmp_path: Path) -> None:
    uri = str(tmp_path / "repo")
    ModelRepo.open(uri, catalog=tmp_path / "main.sqlite").push(BASE, "base")
    # Two processes share one catalog file, two have their own: both must work.
    catalogs = [tmp_path / "shared.sqlite"] * 2 + [tmp_path / f"own{i}.sqlite" for i in (2, 3)]
    # A fork server imports hapi once (seconds) and forks clean workers from it: forking the
    # test process itself could inherit obstore's runtime threads in a broken state.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["hapi.repo", __name__])
    with ctx.Pool(4) as pool:
        results = pool.starmap(worker, [(uri, str(c), r) for r, c in enumerate(catalogs)])
    pushed = [p for r in results for p in r]
    repo = ModelRepo.open(uri, catalog=tmp_path / "main.sqlite")
    shared = repo.log("shared")
    assert sorted(v.version for v in shared) == list(range(1, 9))  # no number given twice
    assert len({v.id for v in repo.descendants("base")}) == len(pushed) == 16
    for mid, tag, _ in pushed:
        assert repo.pull(mid)["head"][0].item() == tag
    assert repo.gc().removed_blobs == 0
    # "frozen" once, and each distinct head once (tag 0 is the base head: zeros).
    assert repo.usage().blobs == 1 + 16


HOLD_A_PUSH = """
import sys, torch
from hapi.repo import ModelRepo
txn = ModelRepo.open(sys.argv[1], catalog=":memory:").prepare_push({"w": torch.ones(3)}, "net")
txn.begin()
print("locked", flush=True)
sys.stdin.read()
"""


@pytest.mark.skipif(machine_id() is None, reason="process liveness needs Linux /proc")
def test_gc_goes_ahead_at_once_when_a_push_was_killed(tmp_path: Path) -> None:
    uri = str(tmp_path / "repo")
    repo = ModelRepo.open(uri, catalog=tmp_path / "c.sqlite")  # the default 10-minute TTL
    repo.push(BASE, "base")
    repo.rm("base")
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD_A_PUSH, uri],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "locked"
        assert repo.gc().skipped  # the push is alive: gc keeps off
    finally:
        child.kill()  # SIGKILL: the push cannot release its lock
        child.wait()
    report = repo.gc()
    assert not report.skipped and report.removed_locks == 1 and report.removed_blobs == 2
    assert repo.locks.read() == []
