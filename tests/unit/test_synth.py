"""Synthetic datasets and uploads of local ImageFolder trees."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hapi.data import (
    DatasetManifest,
    decode_image,
    import_folder,
    local_images,
    open_store,
    summarize,
    synth_dataset,
)
from hapi.errors import InvalidRequest, ObjectNotFound

from ..image_bytes import jpeg


def test_synthetic_images_are_decodable_and_separable() -> None:
    store = open_store("memory://synth-separable")
    m = synth_dataset(store, "train", classes=4, per_class=10, size=32, seed=1)
    assert len(m) == 40 and m.classes == ("class_0", "class_1", "class_2", "class_3")
    x = np.stack(
        [np.asarray(decode_image(store.get(k), k), np.float32).mean((0, 1)) for k in m.keys]
    )
    y = np.array(m.labels)
    # Nearest centroid on mean colour, fitted on even samples, scored on odd ones.
    train, test = np.arange(len(y)) % 2 == 0, np.arange(len(y)) % 2 == 1
    centroids = np.stack([x[train & (y == c)].mean(0) for c in range(4)])
    predicted = np.linalg.norm(x[test][:, None] - centroids[None], axis=2).argmin(1)
    assert (predicted == y[test]).mean() >= 0.9


def test_the_same_seed_writes_the_same_bytes() -> None:
    stores = [open_store(f"memory://synth-seed-{i}") for i in range(3)]
    args = {"classes": 2, "per_class": 3, "size": 16}
    a = synth_dataset(stores[0], seed=5, **args)
    b = synth_dataset(stores[1], seed=5, **args)
    c = synth_dataset(stores[2], seed=6, **args)
    assert a == b == c
    assert [stores[0].get(k) for k in a.keys] == [stores[1].get(k) for k in b.keys]
    assert [stores[0].get(k) for k in a.keys] != [stores[2].get(k) for k in c.keys]


def test_train_and_val_splits_share_classes() -> None:
    store = open_store("memory://synth-splits")
    calls: list[int] = []
    train = synth_dataset(store, "train", classes=2, per_class=3, size=16, progress=calls.append)
    val = synth_dataset(store, "val", classes=2, per_class=1, size=16, seed=1)
    assert calls == list(range(1, 7))
    assert train.classes == val.classes and len(train) == 6 and len(val) == 2
    assert all(k.startswith("train/") for k in train.keys)
    assert DatasetManifest.from_store(store, "val") == val


def test_class_names_sort_in_label_order() -> None:
    m = synth_dataset(open_store("memory://synth-11"), classes=11, per_class=1, size=8)
    assert m.classes[:3] == ("class_00", "class_01", "class_02") and m.classes[-1] == "class_10"


@pytest.mark.parametrize("kwargs", [{"classes": 1}, {"per_class": 0}, {"size": 4}, {"quality": 0}])
def test_synth_arguments_are_checked(kwargs: dict[str, int]) -> None:
    with pytest.raises(InvalidRequest, match="synth needs"):
        synth_dataset(open_store("memory://synth-bad"), **kwargs)


def test_import_folder_uploads_class_folders(tmp_path: Path) -> None:
    src = tmp_path / "src"
    for path in ["cats/1.jpg", "dogs/more/2.JPG", "stray.jpg", ".hidden/3.jpg",
                 "cats/.ipynb_checkpoints/4.jpg"]:  # fmt: skip
        (src / path).parent.mkdir(parents=True, exist_ok=True)
        (src / path).write_bytes(jpeg(16, 16))
    (src / "cats" / "notes.txt").write_text("not an image")
    store = open_store(tmp_path / "dst")
    done: list[int] = []
    m = import_folder(src, store, "ds", progress=done.append)
    assert m.keys == ("ds/cats/1.jpg", "ds/dogs/more/2.JPG") and m.labels == (0, 1)
    assert done == [1, 2] and len(local_images(src)) == 2
    assert store.get("ds/cats/1.jpg") == (src / "cats" / "1.jpg").read_bytes()
    summary = summarize(store, m)
    assert summary.images == 2 and summary.counts == {"cats": 1, "dogs": 1}
    assert summary.nbytes == 2 * len(jpeg(16, 16))
    assert str(summary).startswith("2 images, 2 classes (cats: 1, dogs: 1)")


def test_import_folder_says_what_is_wrong(tmp_path: Path) -> None:
    store = open_store("memory://import-bad")
    with pytest.raises(ObjectNotFound, match="is not a directory"):
        import_folder(tmp_path / "missing", store)
    (tmp_path / "flat.jpg").write_bytes(jpeg())
    with pytest.raises(ObjectNotFound, match="no images in class folders"):
        import_folder(tmp_path, store)
