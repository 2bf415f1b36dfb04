"""The feature cache's directory: entries round-trip, are checked, written atomically,
bounded by least recent use, and shared between caches on one directory."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hapi.cache import FeatureCache, FeatureSpace, cacheability, entry_name
from hapi.cache._index import RECORD
from hapi.data import HorizontalFlip, Normalize, RandomResizedCrop, Resize, Transforms
from hapi.errors import InvalidRequest

SPACE = FeatureSpace("head", 3, Transforms.eval(64).to_dict(), "fp16", False)


def _names(n: int) -> list[str]:
    return [entry_name(f"d/c/{i}.jpg", "v1", 0) for i in range(n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_entries_round_trip_bit_for_bit(tmp_path: Path, dtype: torch.dtype) -> None:
    cache = FeatureCache(tmp_path, memory_bytes=0)
    tensors = [torch.randn(4, 3, 3).to(dtype) for _ in range(3)]
    cache.put_many(SPACE, _names(3), tensors)
    got = FeatureCache(tmp_path).get_many(SPACE, _names(3))
    for want, have in zip(tensors, got, strict=True):
        assert have is not None and have.dtype == dtype
        assert torch.equal(want, have)


def test_a_batch_across_segments_shapes_and_dtypes_comes_back_in_its_order(
    tmp_path: Path,
) -> None:
    # Small segments, so 60 entries lie in several; three shapes and two dtypes, so the
    # records are of several lengths and headers; read back shuffled, in one batch.
    writer = FeatureCache(tmp_path, max_bytes=16 * 512, memory_bytes=0)
    names = _names(60)
    shapes = [(8,), (3, 5), (16,)]
    tensors = [
        torch.randn(shapes[i % 3]).to(torch.float16 if i % 2 else torch.float32) for i in range(60)
    ]
    for start in range(0, 60, 7):
        writer.put_many(SPACE, names[start : start + 7], tensors[start : start + 7])
    reader = FeatureCache(tmp_path, max_bytes=1 << 30, memory_bytes=0)
    order = torch.randperm(60, generator=torch.Generator().manual_seed(1)).tolist()
    held = [i for i in order if reader.contains(SPACE, names[i])]
    assert len(held) > 20  # the bound kept several segments' entries
    got = reader.get_many(SPACE, [names[i] for i in held])
    for i, have in zip(held, got, strict=True):
        assert have is not None and torch.equal(have, tensors[i])


def test_contains_all_looks_entries_up_together(tmp_path: Path) -> None:
    FeatureCache(tmp_path).put_many(SPACE, _names(3), [torch.ones(2)] * 3)
    for cache in (FeatureCache(tmp_path), FeatureCache(tmp_path, memory_bytes=0)):
        assert cache.contains_all(SPACE, _names(3)) and cache.contains_all(SPACE, [])
        assert not cache.contains_all(SPACE, _names(4))
    held = FeatureCache(tmp_path / "other")
    held.put_many(SPACE, _names(1), [torch.ones(2)])
    assert held.contains_all(SPACE, _names(1))  # in memory (and on disk)


def test_names_change_with_version_and_view_and_spaces_apart(tmp_path: Path) -> None:
    assert entry_name("k", "v1", 0) != entry_name("k", "v2", 0)
    assert entry_name("k", "v1", 0) != entry_name("k", "v1", 1)
    other = FeatureSpace("head", 4, SPACE.transforms, "fp16", False)
    assert other.id != SPACE.id
    cache = FeatureCache(tmp_path)
    cache.put_many(SPACE, _names(1), [torch.ones(2)])
    assert cache.get(other, _names(1)[0]) is None
    assert cache.stats.misses == 1


def _segments(root: Path) -> list[Path]:
    """The space's segment files, in the order one writer began them."""
    return sorted((root / "v2" / SPACE.id).glob("*.seg"))


def _indexed(root: Path) -> list[str]:
    """Every entry name the index files hold (a torn last record left out)."""
    names = []
    for path in sorted((root / "v2" / SPACE.id).glob("*.idx")):
        data = path.read_bytes()
        records = np.frombuffer(data[: len(data) // RECORD.itemsize * RECORD.itemsize], RECORD)
        names += [n.ljust(16, b"\0").hex() for n in records["name"].tolist()]
    return names


def test_a_flipped_byte_is_a_miss_until_the_entry_is_written_again(tmp_path: Path) -> None:
    names = _names(3)
    FeatureCache(tmp_path).put_many(SPACE, names, [torch.arange(8.0) + i for i in range(3)])
    (segment,) = _segments(tmp_path)
    data = bytearray(segment.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside the second entry
    segment.write_bytes(bytes(data))
    cache = FeatureCache(tmp_path, memory_bytes=0)
    got = cache.get_many(SPACE, names)
    assert got[1] is None and got[0] is not None and got[2] is not None
    assert cache.stats.corrupt == 1 and not cache.contains(SPACE, names[1])
    cache.put_many(SPACE, [names[1]], [torch.arange(8.0) + 1])
    for reader in (cache, FeatureCache(tmp_path, memory_bytes=0)):  # the newest record wins
        again = reader.get(SPACE, names[1])
        assert again is not None and torch.equal(again, torch.arange(8.0) + 1)


@pytest.mark.parametrize("damaged", [0, 1])
def test_a_corrupt_copy_does_not_hide_another_writers_intact_one(
    tmp_path: Path, damaged: int
) -> None:
    """Two writers hold an entry each; whichever copy is damaged (which writer's record
    a reader takes for the newer one is not known), the other is read."""
    name = _names(1)
    for part in ("a", "b"):  # two writers that raced: neither saw the other's copy
        FeatureCache(tmp_path / part).put_many(SPACE, name, [torch.arange(8.0)])
    for path in (tmp_path / "b" / "v2" / SPACE.id).glob("*-*"):
        path.rename(tmp_path / "a" / "v2" / SPACE.id / path.name)
    tmp_path = tmp_path / "a"
    segments = _segments(tmp_path)
    assert len(segments) == 2
    data = bytearray(segments[damaged].read_bytes())
    data[-8] ^= 0xFF
    segments[damaged].write_bytes(bytes(data))  # sorted by writer id: either may load first
    cache = FeatureCache(tmp_path, memory_bytes=0)
    got = cache.get(SPACE, name[0])
    assert got is not None and torch.equal(got, torch.arange(8.0))
    again = cache.get(SPACE, name[0])  # the intact copy is the one found from now on
    assert again is not None and cache.stats.corrupt <= 1


def test_names_that_share_their_first_bytes_are_told_apart(tmp_path: Path) -> None:
    """The index searches names by their first 8 bytes first; names alike there (rare
    for hashes, but possible) are still found exactly, in the sorted columns too."""
    alike = ["00" * 8 + f"{i:02x}" * 8 for i in (3, 1, 2)]
    names = alike + _names(20_000)  # enough for a new reader to load sorted columns
    FeatureCache(tmp_path).put_many(SPACE, names, list(torch.arange(len(names)).float()[:, None]))
    reader = FeatureCache(tmp_path, memory_bytes=0)
    got = reader.get_many(SPACE, [*alike, "00" * 8 + "04" * 8, names[-1]])
    assert [None if t is None else int(t) for t in got] == [0, 1, 2, None, len(names) - 1]


def test_a_truncated_segment_is_a_miss(tmp_path: Path) -> None:
    FeatureCache(tmp_path).put_many(SPACE, _names(2), [torch.arange(8.0)] * 2)
    (segment,) = _segments(tmp_path)
    segment.write_bytes(segment.read_bytes()[:20])
    cache = FeatureCache(tmp_path, memory_bytes=0)
    assert cache.get_many(SPACE, _names(2)) == [None, None]


def _write_forever(root: str, ready: multiprocessing.synchronize.Event, tag: str) -> None:
    cache = FeatureCache(root, memory_bytes=0)
    big = torch.zeros(1 << 18)
    ready.set()
    i = 0
    while True:
        names = [entry_name(f"{tag}{i}-{j}", "v", 0) for j in range(4)]
        cache.put_many(SPACE, names, [big + i] * 4)
        i += 1


@pytest.mark.slow
def test_three_writers_killed_mid_write_leave_only_whole_entries(tmp_path: Path) -> None:
    """Three processes append to one space at once, then die by SIGKILL wherever they are:
    every entry an index names reads back whole, and nothing is corrupt."""
    ctx = multiprocessing.get_context("spawn")
    writers, readies = [], []
    for tag in "abc":
        ready = ctx.Event()
        writers.append(ctx.Process(target=_write_forever, args=(str(tmp_path), ready, tag)))
        readies.append(ready)
        writers[-1].start()
    assert all(ready.wait(60) for ready in readies)
    import time

    time.sleep(1.5)
    for writer in writers:
        assert writer.pid is not None
        os.kill(writer.pid, signal.SIGKILL)
        writer.join()
    names = _indexed(tmp_path)
    assert len({n for n in names}) == len(names), "no entry written twice"
    assert len(_segments(tmp_path)) >= 3, "every writer appends to segments of its own"
    cache = FeatureCache(tmp_path, memory_bytes=0)
    got = cache.get_many(SPACE, names)
    assert names and all(t is not None for t in got), "an indexed entry is not whole"
    assert cache.stats.corrupt == 0


def test_an_entry_another_process_writes_is_seen_within_a_second(tmp_path: Path) -> None:
    reader = FeatureCache(tmp_path, memory_bytes=0)
    assert reader.get(SPACE, _names(1)[0]) is None
    FeatureCache(tmp_path).put_many(SPACE, _names(1), [torch.ones(3)])
    import time

    time.sleep(1.1)
    assert reader.contains(SPACE, _names(1)[0])
    assert reader.get(SPACE, _names(1)[0]) is not None


def test_least_recently_used_segments_go_past_the_bound(tmp_path: Path) -> None:
    one = torch.zeros(1000)  # 4,000 bytes of payload each: a segment each under this bound
    cache = FeatureCache(tmp_path, max_bytes=10 * 4100, memory_bytes=0)
    names = _names(12)
    for i, name in enumerate(names[:9]):
        cache.put_many(SPACE, [name], [one + i])
        os.utime(_segments(tmp_path)[-1], (1000 + i, 1000 + i))
    assert len(_segments(tmp_path)) == 9
    assert cache.get(SPACE, names[0]) is not None  # used: now the most recent
    for name in names[9:]:
        cache.put_many(SPACE, [name], [one])
    assert cache.stats.evictions >= 1
    assert cache.stats.bytes_held <= 10 * 4100
    assert sum(p.stat().st_size for p in (tmp_path / "v2").rglob("*.*") if p.suffix != ".json") == (
        cache.stats.bytes_held
    )
    assert cache.get(SPACE, names[0]) is not None
    assert cache.get(SPACE, names[1]) is None  # the least recently used went first
    assert FeatureCache(tmp_path, memory_bytes=0).get(SPACE, names[1]) is None


def test_a_directory_of_the_old_layout_is_ignored_then_cleared(tmp_path: Path) -> None:
    old = tmp_path / "v1" / SPACE.id / "ab"
    old.mkdir(parents=True)
    (old / ("ab" + "0" * 30)).write_bytes(b"HFC1 an entry of the file-per-sample layout")
    cache = FeatureCache(tmp_path)
    assert cache.usage() == [] and cache.get(SPACE, "ab" + "0" * 30) is None
    cache.put_many(SPACE, _names(1), [torch.ones(2)])
    assert cache.get(SPACE, _names(1)[0]) is not None
    cache.clear()
    assert not (tmp_path / "v1").exists()


def test_usage_and_clear(tmp_path: Path) -> None:
    cache = FeatureCache(tmp_path)
    cache.put_many(SPACE, _names(3), [torch.ones(10)] * 3)
    (usage,) = cache.usage()
    assert usage.id == SPACE.id and usage.entries == 3 and usage.described["cut"] == 3
    assert cache.clear() == usage.bytes
    assert cache.usage() == [] and cache.get(SPACE, _names(1)[0]) is None


def test_bad_bounds_and_a_file_as_root_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="cache_size"):
        FeatureCache(tmp_path, max_bytes=0)
    (tmp_path / "f").write_text("x")
    with pytest.raises(InvalidRequest, match="is a file"):
        FeatureCache(tmp_path / "f")


def test_cacheability_names_the_random_ops() -> None:
    assert cacheability(Transforms.eval(64)).cacheable
    fresh = cacheability(Transforms.train(64))
    assert not fresh.cacheable and "random_resized_crop" in fresh.why and "views=K" in fresh.why
    assert cacheability(Transforms.train(64).__class__(Transforms.train(64).ops, views=4)).cacheable
    tail_random = cacheability(Transforms((Resize(72), HorizontalFlip(), Normalize())))
    assert not tail_random.cacheable and "resize before it are deterministic" in tail_random.why


def test_views_repeat_every_k_epochs() -> None:
    views = Transforms((RandomResizedCrop(32), Normalize()), views=3)
    assert views.seed(0, 1, "k") == views.seed(0, 4, "k") != views.seed(0, 2, "k")
    fresh = Transforms((RandomResizedCrop(32), Normalize()))
    assert fresh.seed(0, 1, "k") != fresh.seed(0, 4, "k")
    assert Transforms.from_dict(views.to_dict()) == views
    with pytest.raises(InvalidRequest, match="views"):
        Transforms(views=0)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"views": 0}, "views must be a whole number"),
        ({"views": 2, "augment": False}, "augment=False trains without augmentation"),
        ({"augment": False, "transforms": Transforms.eval(64)}, "pass one of them"),
        ({"views": 2, "transforms": Transforms(views=3)}, "views is given twice"),
        ({"cache_size": "lots"}, "cannot read size"),
    ],
)
def test_cache_options_that_contradict_are_refused(
    options: dict[str, object], message: str
) -> None:
    from hapi.client.config.job import JobConfig

    with pytest.raises(InvalidRequest, match=message):
        JobConfig.from_options(
            model="m", dataset="d", server="grpc://127.0.0.1:1", repo="r", **options
        )  # type: ignore[arg-type]


def test_views_apply_to_the_default_augmentation() -> None:
    from hapi.client.config.job import JobConfig

    config = JobConfig.from_options(
        model="m", dataset="d", server="grpc://127.0.0.1:1", repo="r", views=3
    )
    assert config.train_transforms.views == 3 and config.train_transforms.is_random
    plain = JobConfig.from_options(
        model="m", dataset="d", server="grpc://127.0.0.1:1", repo="r", augment=False
    )
    assert plain.train_transforms == plain.test_transforms


def test_the_server_writer_drops_what_would_wait_past_its_bound(tmp_path: Path) -> None:
    from hapi.server.chunks._write_behind import WriteBehind

    class SlowCache(FeatureCache):
        def __init__(self, root: Path, gate: threading.Event) -> None:
            super().__init__(root)
            self.gate = gate

        def put_many(self, *args: Any, **kwargs: Any) -> None:
            self.gate.wait(10)
            super().put_many(*args, **kwargs)

    gate = threading.Event()
    writer = WriteBehind(SlowCache(tmp_path, gate), max_bytes=3 * 4000)
    row = torch.zeros(1000)  # 4,000 bytes
    kept = [writer.offer(SPACE, [n], [row]) for n in _names(5)]
    assert kept == [True, True, True, False, False] and writer.dropped == 2
    gate.set()
    writer.close()
    assert sum(FeatureCache(tmp_path).get(SPACE, n) is not None for n in _names(5)) == 3
