"""Transforms, manifests, decoding and synthetic data, on the in-memory store."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image
from torchvision.transforms import v2

from hapi.data import (
    CenterCrop,
    HorizontalFlip,
    Manifest,
    Normalize,
    RandomResizedCrop,
    Resize,
    Transforms,
    decode_image,
    import_folder,
    load_sample,
    open_store,
    sample_seed,
    synth_dataset,
)
from hapi.errors import CorruptObject, InvalidRequest, ObjectNotFound


def _jpeg(size: int = 48, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size, size + 8, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def test_random_transforms_depend_only_on_the_seed() -> None:
    data = _jpeg()
    t = Transforms.train(32)
    again = Transforms.from_dict(t.to_dict())
    a = load_sample(data, "k", t, seed=sample_seed(1, 0, "k"))
    b = load_sample(data, "k", again, seed=sample_seed(1, 0, "k"))
    torch.manual_seed(123)  # the global RNG plays no part
    c = load_sample(data, "k", t, seed=sample_seed(1, 0, "k"))
    assert a.shape == (3, 32, 32) and a.dtype == torch.float32
    assert torch.equal(a, b) and torch.equal(a, c)
    others = [load_sample(data, "k", t, seed=sample_seed(1, e, "k")) for e in range(1, 6)]
    assert not all(torch.equal(a, o) for o in others)
    assert t.is_random and not Transforms.eval(32).is_random


def test_sample_seeds_are_stable_numbers() -> None:
    # A golden value: the seed of a sample must not change between versions or machines.
    assert sample_seed(0, 0, "train/class_0/00000.jpg") == sample_seed(0, 0, "train/class_0/00000.jpg")
    assert sample_seed(0, 0, "a") != sample_seed(0, 1, "a") != sample_seed(1, 0, "a")
    assert 0 <= sample_seed(2**40, 7, "x") < 2**63


def test_eval_pipeline_matches_torchvision() -> None:
    image = decode_image(_jpeg(64), "k")
    ours = Transforms((Resize(40), CenterCrop(32), Normalize()))(image, seed=0)
    theirs = v2.Compose([
        v2.Resize(40, antialias=True), v2.CenterCrop(32), v2.ToImage(),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
    ])(image)  # fmt: skip
    assert torch.equal(ours, theirs.as_subclass(torch.Tensor))


def test_flip_and_crop_ops() -> None:
    image = decode_image(_jpeg(40), "k")
    plain = Transforms()(image, seed=0)
    flipped = Transforms((HorizontalFlip(p=1.0),))(image, seed=0)
    assert torch.equal(flipped, plain.flip(-1))
    crop = Transforms((RandomResizedCrop(16, scale=(0.5, 0.5)),))(image, seed=3)
    assert crop.shape == (3, 16, 16)


ops = st.one_of(
    st.builds(Resize, st.integers(1, 512)),
    st.builds(CenterCrop, st.integers(1, 512)),
    st.builds(HorizontalFlip, st.floats(0, 1)),
    st.builds(RandomResizedCrop, st.integers(1, 512)),
    st.builds(Normalize),
)


@given(st.lists(ops, max_size=6))
def test_transform_specs_round_trip(op_list: list) -> None:  # type: ignore[type-arg]
    t = Transforms(tuple(op_list))
    assert Transforms.from_dict(t.to_dict()) == t


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ({"ops": [{"op": "sharpen"}]}, "unknown transform"),
        ({"ops": [{"op": "resize", "size": 0}]}, "positive"),
        ({"ops": [{"op": "resize", "size": 8, "mode": "x"}]}, "no parameter"),
        ({"ops": [{"op": "horizontal_flip", "p": 2}]}, r"\[0, 1\]"),
        ("resize", "ops"),
    ],
)
def test_bad_transform_specs_say_what_is_wrong(spec: object, needle: str) -> None:
    with pytest.raises(InvalidRequest, match=needle):
        Transforms.from_dict(spec)  # type: ignore[arg-type]


@pytest.mark.parametrize("data", [b"", b"not an image", _jpeg()[:200]])
def test_corrupt_and_truncated_images_name_their_key(data: bytes) -> None:
    with pytest.raises(CorruptObject, match="train/cat/7.jpg"):
        decode_image(data, "train/cat/7.jpg")


def test_manifest_reads_an_imagefolder_layout() -> None:
    store = open_store("memory://manifest")
    for key in ["d/b/2.jpg", "d/a/1.png", "d/a/0.JPG", "d/readme.txt", "d/b/notes.txt", "e/a/9.jpg"]:
        store.put(key, b"x")
    m = Manifest.from_store(store, "d")
    assert m.classes == ("a", "b")
    assert m.keys == ("d/a/0.JPG", "d/a/1.png", "d/b/2.jpg")
    assert m.labels == (0, 0, 1)
    assert Manifest.from_dict(m.to_dict()) == m
    assert m.subset([2]).keys == ("d/b/2.jpg",)
    with pytest.raises(ObjectNotFound, match="ImageFolder"):
        Manifest.from_store(store, "nothing")


def test_synthetic_images_are_decodable_and_separable() -> None:
    store = open_store("memory://synth")
    m = synth_dataset(store, "s", classes=3, per_class=12, size=48, seed=1)
    assert len(m) == 36 and m.classes == ("class_0", "class_1", "class_2")
    again = synth_dataset(open_store("memory://synth2"), "s", classes=3, per_class=12, size=48, seed=1)
    assert store.get(m.keys[5]) == open_store("memory://synth2").get(again.keys[5])
    x = torch.stack([
        torch.from_numpy(np.asarray(decode_image(store.get(k), k), np.float32)).mean((0, 1))
        for k in m.keys
    ])  # fmt: skip
    y = torch.tensor(m.labels)
    train, test = torch.arange(36) % 2 == 0, torch.arange(36) % 2 == 1
    centroids = torch.stack([x[train & (y == c)].mean(0) for c in range(3)])
    predicted = torch.cdist(x[test], centroids).argmin(1)
    assert (predicted == y[test]).float().mean() >= 0.9


def test_import_folder_uploads_class_folders(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "cats").mkdir()
    (tmp_path / "dogs" / "more").mkdir(parents=True)
    (tmp_path / "cats" / "1.jpg").write_bytes(_jpeg())
    (tmp_path / "dogs" / "more" / "2.jpg").write_bytes(_jpeg(seed=2))
    (tmp_path / "stray.jpg").write_bytes(_jpeg())
    store = open_store("memory://import")
    m = import_folder(tmp_path, store, "ds")
    assert m.keys == ("ds/cats/1.jpg", "ds/dogs/more/2.jpg") and m.labels == (0, 1)
    with pytest.raises(ObjectNotFound, match="not a directory"):
        import_folder(tmp_path / "missing", store)
