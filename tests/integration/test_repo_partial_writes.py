"""A push SIGKILLed while a blob is being written to a local directory repository leaves
obstore's staging file (`<key>#<n>`) on disk: no reader sees it, gc leaves it alone while
a live push could still be writing it, and removes it once it is older than the threshold,
with every visible version still pulling."""

from __future__ import annotations

import itertools
import multiprocessing as mp
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch

from hapi.data.store.partial import is_partial_name
from hapi.repo import ModelRepo, RepoConfig
from hapi.repo.storage.liveness import machine_id

needs_liveness = pytest.mark.skipif(
    machine_id() is None, reason="telling a killed push's lock dead needs Linux /proc"
)

# Two 128 MiB tensors a push: each blob takes long enough to write that the parent,
# polling the disk, catches its staging file before it is renamed into place.
NUMEL = 32 * 1024 * 1024


def model(tag: int) -> dict[str, torch.Tensor]:
    """The model tagged `tag`: new blobs for every tag, the same bits for the same tag."""
    return {f"w{i}": torch.full((NUMEL,), float(2 * tag + i)) for i in range(2)}


def big_pusher(uri: str, tag: int, out: Connection) -> None:
    """Push "big" with tags from `tag` on, sending each tag before its push, until killed."""
    torch.set_num_threads(1)
    repo = ModelRepo.open(uri, catalog=":memory:")
    for t in itertools.count(tag):
        out.send(t)
        repo.push(model(t), "big", metrics={"tag": t})


def staged(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if is_partial_name(p.name) and p.is_file()]


def has_bytes(path: Path) -> bool:
    try:
        return path.stat().st_size > 0
    except FileNotFoundError:
        return False  # renamed into place meanwhile


def kill_mid_write(ctx: mp.context.BaseContext, uri: str, tag: int) -> int:
    """Run a pusher from `tag` and SIGKILL it the moment a staging file has bytes on disk;
    return the tag it was pushing then (the next pusher starts after it)."""
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=big_pusher, args=(uri, tag, send))
    child.start()
    send.close()
    root = Path(uri)
    try:
        # Polled, not timed: the child pushes new blobs until one is caught mid-write.
        while child.is_alive() and not any(has_bytes(p) for p in staged(root)):
            while recv.poll(0):
                tag = recv.recv()
            child.join(0.001)
        assert child.is_alive(), f"the pusher died on its own (exit {child.exitcode})"
    finally:
        child.kill()
        child.join()
        try:
            while recv.poll(0):
                tag = recv.recv()
        except EOFError:
            pass
        recv.close()
    return tag + 1


def pulls_exact(repo: ModelRepo) -> list[int]:
    tags = []
    for version in repo.log("big"):
        tag = int(version.metrics["tag"])
        pulled, expected = repo.pull(version), model(tag)
        assert all(torch.equal(pulled[k], expected[k]) for k in expected), version.ref
        tags.append(tag)
    return tags


@needs_liveness
@pytest.mark.slow
def test_gc_removes_the_staging_file_of_a_push_killed_mid_write(tmp_path: Path) -> None:
    uri = str(tmp_path / "repo")
    ModelRepo.open(uri, catalog=":memory:").push(model(0), "big", metrics={"tag": 0})
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["hapi.repo", __name__])
    tag = 1
    # A write cut short between the child's last look and the kill may have been renamed
    # into place already: kill again until a staging file outlives its writer.
    for _ in range(5):
        tag = kill_mid_write(ctx, uri, tag)
        if left := staged(Path(uri)):
            break
    assert left, "no push was caught mid-write in five tries"
    assert all(p.relative_to(uri).parts[0] == "tensors" for p in left)

    repo = ModelRepo.open(uri, catalog=":memory:")
    listed = set(repo.store.list())
    assert not {p.relative_to(uri).as_posix() for p in left} & listed  # no reader sees them
    visible = pulls_exact(repo)
    assert 0 in visible

    # Left alone while younger than the lock TTL: a paused live push may yet finish it.
    report = repo.gc()
    assert not report.skipped, report.reason  # the killed push's lock is seen dead
    assert report.removed_partial == 0 and all(p.exists() for p in left)

    eager = ModelRepo.open(uri, catalog=":memory:", config=RepoConfig(partial_age_s=0))
    report = eager.gc()
    assert report.removed_partial == len(left)
    assert staged(Path(uri)) == []
    after = eager.fsck()
    assert after.ok and not after.unreferenced, after
    assert pulls_exact(eager) == visible
