"""gc against concurrent and interrupted pushes: stateful tests against a plain dict model."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from hapi.data import open_store
from hapi.errors import RepoError, StoreUnavailable
from hapi.repo import ModelRepo, PushTransaction, RepoConfig
from hapi.repo.storage.layout import hash_of_tensor_key

# A small pool of tensors, so versions share blobs as fine-tuned models do.
POOL = [torch.full((3,), float(i)) for i in range(6)]
KEYS = ["a", "b", "c"]


def blob_hashes(repo: ModelRepo) -> set[str]:
    return {h for k in repo.store.list("tensors") if (h := hash_of_tensor_key(k))}


class RepoVsDict(RuleBasedStateMachine):
    """Pushes (whole, or step by step and interleaved), removals and gcs, checked after each
    step against a dict of the state dicts that should be visible."""

    txns = Bundle("txns")

    def __init__(self) -> None:
        super().__init__()
        self.repo = ModelRepo.open(f"memory://{uuid.uuid4().hex}", config=RepoConfig(lock_wait_s=0))
        self.expected: dict[str, dict[str, torch.Tensor]] = {}
        self.open_txns: list[tuple[PushTransaction, dict[str, torch.Tensor]]] = []

    @staticmethod
    def state(picks: list[int]) -> dict[str, torch.Tensor]:
        return {k: POOL[i] for k, i in zip(KEYS, picks, strict=False)}

    @rule(
        name=st.sampled_from(["x", "y"]), picks=st.lists(st.integers(0, 5), min_size=1, max_size=3)
    )
    def push(self, name: str, picks: list[int]) -> None:
        state = self.state(picks)
        self.expected[self.repo.push(state, name).id] = state

    @rule(target=txns, picks=st.lists(st.integers(0, 5), min_size=1, max_size=3))
    def begin_push(self, picks: list[int]) -> Any:
        state = self.state(picks)
        txn = self.repo.prepare_push(state, "z")
        txn.begin()
        self.open_txns.append((txn, state))
        return txn

    @rule(txn=txns)
    def upload_one(self, txn: PushTransaction) -> None:
        if txn.lock is not None:
            txn.upload(limit=1)

    @rule(txn=txns)
    def commit(self, txn: PushTransaction) -> None:
        for i, (open_txn, state) in enumerate(self.open_txns):
            if open_txn is txn:
                self.expected[txn.commit().id] = state
                del self.open_txns[i]
                return

    @rule(data=st.data())
    def rm(self, data: st.DataObject) -> None:
        if self.expected:
            victim = data.draw(st.sampled_from(sorted(self.expected)))
            self.repo.rm(victim)
            del self.expected[victim]

    @rule()
    def gc(self) -> None:
        report = self.repo.gc()
        assert report.skipped == bool(self.open_txns)
        if not report.skipped:
            # Complete as well as safe: exactly the referenced blobs remain.
            wanted = {
                self.repo.manifest(i).tensors[k].hash for i, s in self.expected.items() for k in s
            }
            assert blob_hashes(self.repo) == wanted

    @invariant()
    def visible_versions_are_the_expected_ones(self) -> None:
        assert {v.id for v in self.repo.find()} == set(self.expected)

    @invariant()
    def every_visible_version_pulls_intact(self) -> None:
        for mid, state in self.expected.items():
            pulled = self.repo.pull(mid)
            assert pulled.keys() == state.keys()
            assert all(torch.equal(pulled[k], v) for k, v in state.items())

    def teardown(self) -> None:
        for txn, _ in self.open_txns:
            txn.release()


TestRepoVsDict = RepoVsDict.TestCase
TestRepoVsDict.pytestmark = [pytest.mark.slow]  # 30 stateful examples: seconds of CPU
TestRepoVsDict.settings = settings(
    max_examples=30,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class FakeTime:
    """A clock and a sleep that moves it, to inject into `repo.locks`: waits take no time."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self.naps: list[float] = []
        self.on_nap: Any = None

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.naps.append(seconds)
        self.now += seconds
        if self.on_nap is not None:
            self.on_nap(len(self.naps))

    def install(self, repo: ModelRepo) -> FakeTime:
        repo.locks.clock, repo.locks.sleep = self.clock, self.sleep
        return self


def test_push_waits_for_a_running_gc_then_gives_up() -> None:
    repo = ModelRepo.open(f"memory://{uuid.uuid4().hex}", config=RepoConfig(lock_wait_s=5))
    fake = FakeTime().install(repo)
    held, _ = repo.locks.try_acquire_gc()
    assert held is not None
    with pytest.raises(RepoError, match="a gc is running"):
        repo.push({"a": POOL[0]}, "x")
    assert sum(fake.naps) >= 5  # it waited lock_wait_s before giving up
    assert [lock.kind for lock in repo.locks.read()] == ["gc"]  # and withdrew its own lock
    fake.naps.clear()

    def end_the_gc(naps: int) -> None:
        if naps == 3:  # the gc ends while the push waits
            held.release()

    fake.on_nap = end_the_gc
    assert repo.push({"a": POOL[0]}, "x").version == 1
    assert len(fake.naps) == 3 and sum(fake.naps) < 5


def test_a_push_paused_past_the_lock_ttl_rechecks_its_blobs() -> None:
    now = [1000.0]
    repo = ModelRepo.open(
        f"memory://{uuid.uuid4().hex}", config=RepoConfig(lock_ttl_s=10, lock_wait_s=0)
    )
    repo.locks.clock = lambda: now[0]
    old = repo.push({"a": POOL[1]}, "old")
    txn = repo.prepare_push({"a": POOL[1], "b": POOL[2]}, "new")
    txn.begin()  # finds POOL[1]'s blob present: it will not upload it
    repo.rm(old)
    now[0] += 11  # the push stalls past the TTL: its lock looks dead
    report = repo.gc()
    assert not report.skipped and report.removed_blobs == 1 and report.removed_locks == 1
    pushed = txn.commit()  # notices, re-takes the lock and re-uploads the blob gc took
    assert pushed.uploaded_tensors == 2
    assert torch.equal(repo.pull("new")["a"], POOL[1])


@pytest.mark.slow
def test_gc_and_pushes_in_threads_lose_nothing(tmp_path: Any) -> None:
    repo = ModelRepo.open(
        tmp_path / "repo", catalog=tmp_path / "c.sqlite", config=RepoConfig(lock_wait_s=30)
    )
    stop = threading.Event()
    reports = []

    def collect() -> None:
        while not stop.is_set():
            reports.append(repo.gc())

    thread = threading.Thread(target=collect)
    thread.start()
    try:
        kept = {}
        for i in range(30):
            state = {"w": torch.full((64,), float(i % 7)), "b": torch.full((2,), float(i % 3))}
            v = repo.push(state, f"m{i % 4}")
            kept[v.id] = state
            if i % 3 == 0:
                victim = sorted(kept)[0]
                repo.rm(victim)
                del kept[victim]
    finally:
        stop.set()
        thread.join()
    assert any(not r.skipped for r in reports)
    for mid, state in kept.items():
        pulled = repo.pull(mid)
        assert all(torch.equal(pulled[k], v) for k, v in state.items())


class FailingStore:
    """A store that fails after `budget` writes, as a crash or a lost connection would."""

    def __init__(self, inner: Any, budget: int) -> None:
        self.inner, self.budget, self.uri = inner, budget, inner.uri

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _spend(self) -> None:
        self.budget -= 1
        if self.budget < 0:
            raise StoreUnavailable("injected failure")

    def put(self, key: str, data: bytes) -> None:
        if not key.startswith("locks/"):
            self._spend()
        self.inner.put(key, data)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        self._spend()
        return bool(self.inner.put_if_absent(key, data))

    def delete(self, key: str) -> None:
        if self.budget < 0:  # the connection is gone: the push cannot clean up its lock
            raise StoreUnavailable("injected failure")
        self.inner.delete(key)


# A push writes the epoch, 4 blobs, the manifest and the ref: 7 writes.
@pytest.mark.parametrize("budget", [0, 1, 3, 5, 6])
def test_an_interrupted_push_leaves_no_visible_model(budget: int) -> None:
    uri = f"memory://{uuid.uuid4().hex}"
    state = {k: POOL[i] for i, k in enumerate("abcd")}
    # Real time as the origin, so the abandoned manifest's own timestamp ages with the clock.
    fake = FakeTime(time.time())
    broken = ModelRepo(FailingStore(open_store(uri), budget), catalog=":memory:")
    fake.install(broken)
    with pytest.raises(StoreUnavailable):
        broken.push(state, "m")
    repo = ModelRepo.open(uri, config=RepoConfig(lock_ttl_s=10))
    fake.install(repo)
    assert repo.gc().skipped  # the dead push's lock is live until its TTL: it is our pid
    fake.now += 11  # past the TTL, for the lock and for the manifest written after `fake`
    assert repo.find() == []
    blobs_written = min(max(budget - 1, 0), 4)
    assert repo.push(state, "m").uploaded_tensors == 4 - blobs_written
    assert torch.equal(repo.pull("m")["d"], POOL[3])
    repo.rm("m")
    report = repo.gc()
    assert report.removed_blobs == 4 and report.removed_manifests == (budget == 6)
    assert report.removed_locks == 1  # the dead push's lock
