"""Compressed and delta repositories keep the plain ones' guarantees across real processes:
a push killed by SIGKILL leaves nothing visible and gc removes the blobs, markers and lock
it left, a flipped byte on disk is caught, and gc run against live pushers never removes a
base that a kept delta needs."""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing as mp
import time
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch

from hapi.errors import IntegrityError, RefNotFound
from hapi.repo import ModelRepo, RepoConfig
from hapi.repo.storage.codec import DELTA, read_info
from hapi.repo.storage.layout import tensor_key
from hapi.repo.storage.liveness import machine_id
from hapi.repo.storage.markers import read_markers, with_bases
from hapi.repo.storage.tensors import tensor_hash

CONFIGS = [
    pytest.param(RepoConfig(compress=True, deltas=True), id="compressed"),
    pytest.param(RepoConfig(compress=True, deltas=True, compress_whole=False), id="deltas-only"),
]

needs_liveness = pytest.mark.skipif(
    machine_id() is None, reason="telling a killed push's lock dead needs Linux /proc"
)

_GEN = torch.Generator().manual_seed(0)
# Four 256 KiB weights: each well over the 16 KiB below which tensors stay plain.
BASE = {f"w{i}": torch.randn(256, 256, generator=_GEN) * 0.02 for i in range(4)}
BASE["head"] = torch.zeros(16)


def derived(tag: int) -> dict[str, torch.Tensor]:
    """The model tagged `tag` (0 is BASE): every weight nudged in a few places, as a
    fine-tune would, so it is stored as XOR deltas against whichever parent it has; the
    same tag always gives the same bits, so any process can check what it pulled."""
    if tag == 0:
        return dict(BASE)
    gen = torch.Generator().manual_seed(tag)
    out = {}
    for key, value in BASE.items():
        if key == "head":
            out[key] = torch.full((16,), float(tag))
            continue
        nudged = torch.rand(value.shape, generator=gen) < 0.05
        out[key] = value + torch.randn(value.shape, generator=gen) * 1e-4 * nudged
    return out


def pulls_exact(repo: ModelRepo) -> list[int]:
    """Check that every version `ls` and `log` show pulls the model its tag names; return
    the tags."""
    tags = []
    for version in [v for newest in repo.ls() for v in repo.log(newest.name)]:
        tag = int(version.metrics["tag"])
        pulled, expected = repo.pull(version), derived(tag)
        assert pulled.keys() == expected.keys()
        assert all(torch.equal(pulled[k], expected[k]) for k in expected), version.ref
        tags.append(tag)
    return tags


def fresh(uri: str, config: RepoConfig) -> ModelRepo:
    # A new catalog lists the store at once: what another process did is seen now.
    return ModelRepo.open(uri, catalog=":memory:", config=config)


def forkserver() -> mp.context.ForkServerContext:
    # A fork server imports hapi once (seconds) and forks clean children from it: forking
    # the test process itself could inherit obstore's runtime threads in a broken state.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["hapi.repo", __name__])
    return ctx


def pusher(uri: str, config: RepoConfig, tag: int, hold: int | None, out: Connection) -> None:
    """Push fine-tunes of "ft" from `tag` on, sending ("start", tag) before each push and
    ("done", tag, tensors uploaded) after it, until killed. With `hold`, push one, then
    begin the next, write `hold` of its blobs (-1: all, no manifest), send ("held", tag)
    and wait to be killed there, holding the push lock."""
    torch.set_num_threads(1)
    repo = ModelRepo.open(uri, catalog=":memory:", config=config)
    for n in itertools.count():
        try:
            parent = repo.resolve("ft").ref
        except RefNotFound:
            parent = "base"
        out.send(("start", tag))
        if hold is not None and n == 1:
            txn = repo.prepare_push(derived(tag), "ft", parent=parent, metrics={"tag": tag})
            txn.begin()
            txn.upload(None if hold < 0 else hold)
            out.send(("held", tag))
            time.sleep(3600)
        pushed = repo.push(derived(tag), "ft", parent=parent, metrics={"tag": tag})
        out.send(("done", tag, pushed.uploaded_tensors))
        tag += 1


# (how the push dies, whether gc runs before the next round). ("held", N): after one whole
# push, killed holding its lock with N of the next push's blobs written (-1: all of them,
# no manifest). The others are killed in their second push: ("blob", _) the moment its
# first blob is on disk (the rest in flight), ("manifest", _) the moment its manifest is
# (its ref written or not), ("after", S) S seconds after it started (in the encoder).
ROUNDS = [
    ("held", 0, True),
    ("held", 2, True),
    ("held", -1, False),  # the next round's retry must adopt these blobs, not rewrite them
    ("blob", 0, True),
    ("manifest", 0, False),
    ("after", 0.0, True),
]


def kill_mid_push(ctx, uri: str, config: RepoConfig, tag: int, kind: str, arg: float) -> list:
    """Run a pusher from `tag` and SIGKILL it as `kind`/`arg` say; its messages."""
    recv, send = ctx.Pipe(duplex=False)
    hold = int(arg) if kind == "held" else None
    child = ctx.Process(target=pusher, args=(uri, config, tag, hold, send))
    child.start()
    send.close()
    messages: list = []
    root = Path(uri)
    try:
        while not (kind == "held" and messages and messages[-1][0] == "held"):
            assert recv.poll(60), "the pusher said nothing for a minute"
            messages.append(recv.recv())
            starts = [m[1] for m in messages if m[0] == "start"]
            if len(starts) == 2 and kind != "held":
                break
        if kind == "after":
            time.sleep(arg)
        elif kind in ("blob", "manifest"):
            blobs = [root / tensor_key(tensor_hash(t)) for t in derived(starts[1]).values()]
            manifests = len(list((root / "manifests").iterdir()))
            # Polled, not timed: the push either reaches the point or finishes.
            while child.is_alive() and not recv.poll(0.001):
                if kind == "blob" and any(p.exists() for p in blobs):
                    break
                if kind == "manifest" and len(list((root / "manifests").iterdir())) > manifests:
                    break
    finally:
        # SIGKILL: the push cannot release its lock or finish a write. (A local store's
        # write cut short leaves a `<key>#<n>` staging file; no listing shows it, and gc
        # removes it only once older than the lock TTL: test_repo_partial_writes.py.)
        child.kill()
        child.join()
        # What it sent before it died (a "done" the loop above stopped short of reading).
        try:
            while recv.poll(0):
                messages.append(recv.recv())
        except EOFError:
            pass  # all read
        recv.close()
    return messages


def markers_have_blobs_and_bases(repo: ModelRepo) -> None:
    """Every delta marker left names a stored blob, and every delta's base is stored."""
    for digest, bases in read_markers(repo.store).items():
        assert repo.store.exists(tensor_key(digest))
        for base in bases:
            assert repo.store.exists(tensor_key(base))


@needs_liveness
@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS)
def test_a_push_killed_anywhere_leaves_nothing_visible_and_gc_clears_it(
    tmp_path: Path, config: RepoConfig
) -> None:
    uri = str(tmp_path / "repo")
    fresh(uri, config).push(BASE, "base", metrics={"tag": 0})
    ctx = forkserver()
    tag, done_tags, started_tags = 1, {0}, {0}
    dead_locks = (0, 0)  # (at least, at most) locks of killed pushes since the last gc
    adopt = False
    for kind, arg, collect in ROUNDS:
        messages = kill_mid_push(ctx, uri, config, tag, kind, arg)
        started = [m[1] for m in messages if m[0] == "start"]
        done = [m[1:] for m in messages if m[0] == "done"]
        if adopt:
            # The killed push wrote every blob and no gc ran since: its retry, this
            # child's first push, found them all and wrote none again.
            assert done[0] == (tag, 0)
        started_tags |= set(started)
        done_tags |= {t for t, _ in done}
        held = kind == "held"
        dead_locks = (dead_locks[0] + held, dead_locks[1] + 1)
        repo = fresh(uri, config)
        visible = pulls_exact(repo)
        # Every finished push is visible; a killed one only if its ref was written.
        assert done_tags <= set(visible) <= started_tags
        before = repo.fsck()
        assert before.ok, before
        if held and arg != 0:
            assert before.unreferenced  # what the dead push wrote: gc is to remove it
        if collect:
            report = repo.gc()
            assert not report.skipped, report.reason  # the dead push's lock is seen dead
            assert dead_locks[0] <= report.removed_locks <= dead_locks[1]
            if held and arg != 0:
                assert report.removed_blobs > 0
            assert repo.locks.read() == []
            after = repo.fsck()
            assert after.ok and not after.unreferenced, after
            markers_have_blobs_and_bases(repo)
            assert pulls_exact(repo) == visible
            dead_locks = (0, 0)
        adopt = held and arg < 0 and not collect
        tag = started[-1]  # the next child first retries the push this one killed
    # The fine-tunes were stored as deltas: the chains above were really exercised.
    repo = fresh(uri, config)
    newest = repo.manifest("ft").tensors.values()
    assert any(read_info(repo.store.get(tensor_key(e.hash))).codec == DELTA for e in newest)


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10  # mid-file: in the payload, past the header
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("config", CONFIGS)
def test_a_flipped_byte_in_a_delta_or_its_base_is_caught(
    tmp_path: Path, config: RepoConfig
) -> None:
    root = tmp_path / "repo"
    repo = ModelRepo.open(root, catalog=":memory:", config=config)
    repo.push(BASE, "base", metrics={"tag": 0})
    for tag in (1, 2):
        repo.push(derived(tag), f"ft{tag}", parent="base", metrics={"tag": tag})
    # A model of its own, sharing no blob with the others: nothing below may touch it.
    repo.push(derived(3), "other", metrics={"tag": 3})
    assert repo.fsck().ok
    delta = tensor_hash(derived(1)["w0"])
    assert read_markers(repo.store)[delta] == {tensor_hash(BASE["w0"])}

    flip_byte(root / tensor_key(delta))
    with pytest.raises(IntegrityError, match="w0"):
        repo.pull("ft1")
    report = repo.fsck()
    assert list(report.corrupt) == [tensor_key(delta)] and not report.ok
    for ref, tag in (("base", 0), ("ft2", 2), ("other", 3)):
        assert torch.equal(repo.pull(ref)["w0"], derived(tag)["w0"])

    base = tensor_hash(BASE["w1"])  # ft1's and ft2's w1 are deltas against it
    flip_byte(root / tensor_key(base))
    for ref in ("base", "ft1", "ft2"):
        with pytest.raises(IntegrityError, match="w1"):
            repo.pull(ref, keys=["w1"])
    report = repo.fsck()
    needing = {tensor_key(tensor_hash(derived(t)["w1"])) for t in (1, 2)}
    assert set(report.corrupt) == {tensor_key(delta), tensor_key(base)} | needing
    assert torch.equal(repo.pull("ft2", keys=["w0"])["w0"], derived(2)["w0"])
    other = repo.pull("other")
    assert all(torch.equal(other[k], v) for k, v in derived(3).items())


def fine_tuner(uri: str, config: RepoConfig, name: str, count: int) -> list[int]:
    """Push `count` fine-tunes to `name`, each on the one before; return their tags."""
    torch.set_num_threads(1)
    repo = ModelRepo.open(uri, catalog=":memory:", config=config)
    for tag in range(101, 101 + count):
        repo.push(derived(tag), name, parent=name, metrics={"tag": tag})
    return list(range(101, 101 + count))


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS)
def test_gc_among_delta_pushers_keeps_every_base_a_kept_delta_needs(
    tmp_path: Path, config: RepoConfig
) -> None:
    # Deep chains, so every fine-tune below is a delta on the one before (none resets).
    config = dataclasses.replace(config, max_delta_depth=16, relist_s=0)
    uri = str(tmp_path / "repo")
    repo = fresh(uri, config)
    repo.push(BASE, "base", metrics={"tag": 0})
    names = ("ft0", "ft1")
    for name in names:
        repo.push(derived(100), name, parent="base", metrics={"tag": 100})
    ctx = forkserver()
    with ctx.Pool(2) as pool:
        # Both push the same fine-tunes under their own names, so each finds blobs the
        # other wrote already: the case a gc running between pushes could break.
        running = pool.starmap_async(fine_tuner, [(uri, config, n, 5) for n in names])
        repo.rm("base")  # the base every chain starts from
        while not running.ready():
            repo.gc()
            # Keep only the newest of each name, so every kept delta's bases are in
            # removed versions; a pusher's parent is never removed (it is the newest).
            for name in names:
                for old in repo.log(name)[1:]:
                    repo.rm(old)
            running.wait(0.02)
        assert running.get() == [list(range(101, 106))] * 2
    for name in names:
        for old in repo.log(name)[1:]:
            repo.rm(old)
    assert sorted(pulls_exact(repo)) == [105, 105]
    assert repo.fsck().ok
    report = repo.gc()
    assert not report.skipped and report.removed_blobs > 0
    after = repo.fsck()
    assert after.ok and not after.unreferenced, after
    markers_have_blobs_and_bases(repo)
    assert sorted(pulls_exact(repo)) == [105, 105]
    # What gc kept only because a kept delta needs it: the chains' older tensors.
    direct = {e.hash for name in names for e in repo.manifest(name).tensors.values()}
    kept = with_bases(direct, read_markers(repo.store)) - direct
    assert tensor_hash(BASE["w0"]) in kept
