"""The one sample pipeline both tiers run: reads in order and ahead, skip or raise."""

from __future__ import annotations

import io
import threading
from collections.abc import Iterator

import pytest
import torch
from PIL import Image

from hapi.data import ObjectStore, Transforms, load_sample, open_store, sample_seed
from hapi.data.samples import Sample, Skipped, load_samples, read_objects, skip_or_raise
from hapi.errors import CorruptObject, ObjectNotFound

TRAIN = Transforms.train(16)


def _jpeg(i: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (24 + i, 20), (20 * i, 100, 200 - 10 * i)).save(out, format="JPEG")
    return out.getvalue()


class _CountingStore:
    """A store at the boundary that records which keys were read."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self.uri = store.uri
        self.read: list[str] = []
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes:
        with self._lock:
            self.read.append(key)
        return self.store.get(key)


@pytest.fixture
def store() -> Iterator[ObjectStore]:
    store = open_store(f"memory://samples-{id(object())}")
    for i in range(10):
        store.put(f"d/{i}.jpg", _jpeg(i))
    store.put("d/bad.jpg", b"not a jpeg")
    yield store


def test_objects_come_in_order_with_failures_in_place(store: ObjectStore) -> None:
    keys = ["d/3.jpg", "d/missing.jpg", "d/1.jpg"]
    got = list(read_objects(store, keys, ahead=2))
    assert got[0] == store.get("d/3.jpg") and got[2] == store.get("d/1.jpg")
    assert isinstance(got[1], ObjectNotFound)


def test_reads_stay_a_bounded_distance_ahead(store: ObjectStore) -> None:
    counting = _CountingStore(store)
    keys = [f"d/{i}.jpg" for i in range(10)]
    reads = read_objects(counting, keys, ahead=2)  # type: ignore[arg-type]
    next(reads)
    # Two started at once, one more for the object taken: never all ten.
    assert len(counting.read) <= 3
    reads.close()
    assert len(counting.read) <= 3


def test_samples_are_the_seeded_transform_of_each_object(store: ObjectStore) -> None:
    keys = ["d/0.jpg", "d/1.jpg"]
    items = list(
        load_samples(keys, [5, 6], read_objects(store, keys), TRAIN, seed=3, epoch=2, skip=False)
    )
    assert [(s.key, s.label) for s in items if isinstance(s, Sample)] == [
        ("d/0.jpg", 5),
        ("d/1.jpg", 6),
    ]
    for item in items:
        assert isinstance(item, Sample)
        expected = load_sample(store.get(item.key), item.key, TRAIN, sample_seed(3, 2, item.key))
        assert torch.equal(item.tensor, expected)


def test_skip_leaves_out_bad_objects_and_says_why(store: ObjectStore) -> None:
    keys = ["d/bad.jpg", "d/2.jpg", "d/gone.jpg"]
    objects = read_objects(store, keys)
    items = list(load_samples(keys, [0, 1, 2], objects, TRAIN, seed=0, epoch=0, skip=True))
    assert [type(i) for i in items] == [Skipped, Sample, Skipped]
    assert isinstance(items[0], Skipped) and isinstance(items[0].error, CorruptObject)
    assert isinstance(items[2], Skipped) and isinstance(items[2].error, ObjectNotFound)


def test_raise_fails_on_the_first_bad_object(store: ObjectStore) -> None:
    keys = ["d/2.jpg", "d/bad.jpg"]
    items = load_samples(
        keys, [0, 1], read_objects(store, keys), TRAIN, seed=0, epoch=0, skip=False
    )
    assert isinstance(next(items), Sample)
    with pytest.raises(CorruptObject, match="d/bad.jpg"):
        next(items)


def test_only_hapi_errors_are_skipped() -> None:
    assert skip_or_raise("k", CorruptObject("bad"), skip=True).key == "k"
    with pytest.raises(RuntimeError):
        skip_or_raise("k", RuntimeError("a bug, not bad data"), skip=True)
    with pytest.raises(CorruptObject):
        skip_or_raise("k", CorruptObject("bad"), skip=False)
