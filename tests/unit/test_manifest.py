"""Manifests: the ImageFolder layout, their JSON form, validation, datasets by URI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hapi.data import DatasetManifest, open_dataset, open_store
from hapi.data.shards.damage import ShardDamage
from hapi.errors import InvalidRequest, ObjectNotFound
from hapi.wire.tables import table_from_ipc, table_to_ipc


def _store_with(keys: list[str], name: str):  # type: ignore[no-untyped-def]
    store = open_store(f"memory://{name}")
    for key in keys:
        store.put(key, b"x")
    return store


def test_manifest_reads_an_imagefolder_layout() -> None:
    store = _store_with(
        [
            "d/b/2.jpg", "d/a/1.png", "d/a/0.JPG", "d/a/deep/er/3.webp",  # images
            "d/readme.txt", "d/b/notes.txt", "d/top.jpg",  # not images, or not in a class
            "d/.cache/4.jpg", "d/a/.ipynb_checkpoints/5.jpg",  # hidden
            "e/a/9.jpg", "dd/a/8.jpg",  # other datasets
        ],
        "layout",
    )  # fmt: skip
    m = DatasetManifest.from_store(store, "d")
    assert m.prefix == "d" and m.classes == ("a", "b")
    assert m.keys == ("d/a/0.JPG", "d/a/1.png", "d/a/deep/er/3.webp", "d/b/2.jpg")
    assert m.labels == (0, 0, 0, 1)
    assert len(m) == 4 and m.counts() == {"a": 3, "b": 1}
    assert DatasetManifest.from_store(store, "/d/") == m
    assert DatasetManifest.from_store(store, "d", extensions=(".png",)).keys == ("d/a/1.png",)


def test_the_same_store_gives_the_same_manifest() -> None:
    keys = [f"c{c}/{i}.jpg" for c in range(3) for i in range(5)]
    forward = DatasetManifest.from_store(_store_with(keys, "order-1"))
    backward = DatasetManifest.from_store(_store_with(keys[::-1], "order-2"))
    assert forward == backward and list(forward.keys) == sorted(keys)


def test_manifest_json_is_a_stable_format() -> None:
    m = DatasetManifest("d", ("d/a/0.jpg", "d/b/1.jpg"), (0, 1), ("a", "b"))
    text = json.dumps(m.to_dict())
    assert text == (
        '{"prefix": "d", "keys": ["d/a/0.jpg", "d/b/1.jpg"], "labels": [0, 1], '
        '"classes": ["a", "b"]}'
    )
    assert DatasetManifest.from_dict(json.loads(text)) == m


def test_the_arrow_form_reads_back_whole() -> None:
    damage = ShardDamage(shard="s/t.tar", size=100, at=40, reason="cut short", lost=("x",))
    m = DatasetManifest(
        "d", ("d/a/0.jpg", "d/b/1.jpg"), (0, 1), ("a", "b"), ("v0", "v1"), (damage,)
    )
    back = DatasetManifest.from_arrow(table_from_ipc(table_to_ipc(m.to_arrow())))
    assert back == m and list(back.versions) == ["v0", "v1"] and back.damaged == (damage,)
    unlisted = DatasetManifest("", ("a/0",), (0,), ("a",))
    assert DatasetManifest.from_arrow(unlisted.to_arrow()).version_map() is None


def test_a_malformed_arrow_manifest_is_refused() -> None:
    m = DatasetManifest("", ("a/0",), (0,), ("a",))
    with pytest.raises(InvalidRequest, match="no field"):
        DatasetManifest.from_arrow(m.to_arrow().replace_schema_metadata({}))
    with pytest.raises(InvalidRequest, match="columns key and label"):
        DatasetManifest.from_arrow(m.to_arrow().drop_columns(["label"]))
    with pytest.raises(InvalidRequest, match="not an Arrow IPC table"):
        table_from_ipc(b"not arrow")


def test_version_map_finds_each_key_and_only_listed_ones() -> None:
    keys = [f"c/{i:05d}.jpg" for i in range(5000)]
    m = DatasetManifest("", keys, [0] * len(keys), ("c",), [f"v{i}" for i in range(5000)])
    versions = m.version_map()
    assert versions is not None and versions is m.version_map()  # one index a manifest
    assert versions.of(["c/00007.jpg", "gone.jpg", "c/04999.jpg"], "?") == ["v7", "?", "v4999"]
    assert versions["c/00123.jpg"] == "v123" and "gone.jpg" not in versions
    assert dict(versions.pairs()) == dict(zip(keys, (f"v{i}" for i in range(5000)), strict=True))


def test_subset_keeps_classes_and_order() -> None:
    m = DatasetManifest("", ("a/0", "a/1", "b/2"), (0, 0, 1), ("a", "b"))
    sub = m.subset([2, 0])
    assert sub.keys == ("b/2", "a/0") and sub.labels == (1, 0) and sub.classes == m.classes
    assert len(m.subset([])) == 0


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"prefix": "", "keys": ["a"], "labels": [0]}, "no field 'classes'"),
        ({"prefix": "", "keys": ["a"], "labels": ["0"], "classes": ["x"]}, "integers"),
        ({"prefix": "", "keys": [1], "labels": [0], "classes": ["x"]}, "strings"),
        ({"prefix": "", "keys": ["a"], "labels": [1], "classes": ["x"]}, "does not index"),
        ({"prefix": "", "keys": ["a", "b"], "labels": [0], "classes": ["x"]}, "1 labels"),
        ({"prefix": "", "keys": [], "labels": [], "classes": ["x", "x"]}, "repeat"),
    ],
)
def test_malformed_manifests_are_refused(data: dict, needle: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(InvalidRequest, match=needle):
        DatasetManifest.from_dict(data)


def test_a_prefix_without_images_names_the_prefix_and_the_layout() -> None:
    store = _store_with(["train/README.txt", "train/loose.jpg"], "empty")
    with pytest.raises(ObjectNotFound, match=r"prefix 'train' of store memory://empty.*"
                       r"train/<class>/<name>.jpg"):  # fmt: skip
        DatasetManifest.from_store(store, "train")
    with pytest.raises(ObjectNotFound, match="at the root"):
        DatasetManifest.from_store(open_store("memory://nothing-at-all"))


def test_open_dataset_reads_from_the_uri_root(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    store.put("train/cat/1.jpg", b"x")
    store.put("train/dog/2.jpg", b"y")
    dataset_store, m = open_dataset(tmp_path / "train")
    assert m.prefix == "" and m.keys == ("cat/1.jpg", "dog/2.jpg")
    assert dataset_store.get(m.keys[1]) == b"y"
