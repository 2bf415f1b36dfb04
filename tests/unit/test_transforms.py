"""Transforms: seeded randomness, numerics against torchvision, specs, decoding."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import random
import struct
import zlib

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
    Normalize,
    RandomResizedCrop,
    Resize,
    Transforms,
    decode_image,
    load_sample,
    sample_seed,
    synth_image,
)
from hapi.data.images import MAX_PIXELS
from hapi.data.ops import Op
from hapi.errors import CorruptObject, InvalidRequest

from ..image_bytes import encoded, jpeg

IMAGENET = ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])


def test_a_sample_is_bit_identical_wherever_it_is_transformed() -> None:
    data, key = jpeg(), "train/cat/1.jpg"
    seed = sample_seed(1, 0, key)
    here = Transforms.train(32)
    there = Transforms.from_dict(json.loads(json.dumps(here.to_dict())))  # as on the wire
    a = load_sample(data, key, here, seed)
    torch.manual_seed(123)  # the global RNGs play no part
    random.seed(123)
    b = load_sample(data, key, there, seed)
    assert a.shape == (3, 32, 32) and a.dtype == torch.float32 and a.is_contiguous()
    assert torch.equal(a, b)


def photo(width: int = 441, height: int = 331) -> bytes:
    """A photo-like JPEG (~90 KB at 440 px), odd-sized so that a decoder's scaling rounds."""
    image = synth_image(1, 4, max(width, height), np.random.default_rng(0))
    buf = io.BytesIO()
    image.crop((0, 0, width, height)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(10 * torch.log10(1 / torch.mean((a - b) ** 2)))


@pytest.mark.parametrize(
    "ops",
    [(RandomResizedCrop(64), HorizontalFlip()), (Resize(73), CenterCrop(64)), (Resize(50),)],
    ids=["train", "eval", "resize"],
)
def test_a_jpeg_decodes_no_larger_than_the_first_op_needs(ops: tuple[Op, ...]) -> None:
    data, key = photo(), "train/cat/1.jpg"
    reduced = Transforms(ops)
    full = dataclasses.replace(reduced, reduced_decode=False)
    wire = Transforms.from_dict(json.loads(json.dumps(reduced.to_dict())))
    for seed in range(4):
        width, height = reduced.decode_size(441, 331, seed=seed)
        assert width < 441 and height < 331
        assert full.decode_size(441, 331, seed=seed) == (441, 331)
        a, b = load_sample(data, key, reduced, seed), load_sample(data, key, full, seed)
        # The same geometry (the resized side from the full size, not the rounded-up
        # decoded one), a different decode, nearly the same pixels.
        assert a.shape == b.shape
        assert not torch.equal(a, b)
        assert psnr(a, b) > 38
        assert torch.equal(a, load_sample(data, key, wire, seed))  # as on the other tier


@pytest.mark.parametrize(
    ("data", "ops"),
    [
        (photo(), (CenterCrop(64), Resize(32))),  # the first op keeps full-size pixels
        (photo(), (Resize(400),)),  # it barely shrinks
        (photo(), (HorizontalFlip(), Resize(32))),  # only a first op that shrinks counts
        (encoded("RGB", "PNG", 256), (Resize(32),)),  # only JPEG decoders scale
    ],
    ids=["center-crop-first", "little-shrink", "flip-first", "png"],
)
def test_other_images_and_pipelines_decode_fully(data: bytes, ops: tuple[Op, ...]) -> None:
    reduced = Transforms(ops)
    full = dataclasses.replace(reduced, reduced_decode=False)
    assert torch.equal(load_sample(data, "k", reduced, 3), load_sample(data, "k", full, 3))


def test_different_seeds_give_different_crops() -> None:
    crop = RandomResizedCrop(16)
    params = {crop.params(48, 56, random.Random(sample_seed(1, e, "k"))) for e in range(8)}
    assert len(params) == 8
    image = decode_image(jpeg(), "k")
    t = Transforms((crop,))
    assert not torch.equal(t(image, seed=1), t(image, seed=2))


def test_sample_seeds_are_golden_numbers() -> None:
    # The seed of a sample must not change between versions, processes or machines.
    assert sample_seed(0, 0, "train/class_0/00000.jpg") == 6469572956766013817
    assert sample_seed(7, 3, "x") == 3160029695252716533
    assert len({sample_seed(0, 0, "a"), sample_seed(0, 1, "a"), sample_seed(1, 0, "a")}) == 3


def test_eval_pipeline_matches_torchvision_bit_for_bit() -> None:
    image = decode_image(jpeg(64, 80), "k")
    ours = Transforms.eval(32)(image, seed=0)
    theirs = v2.Compose([
        v2.Resize(37, antialias=True), v2.CenterCrop(32), v2.ToImage(),
        v2.ToDtype(torch.float32, scale=True), v2.Normalize(*IMAGENET),
    ])(image)  # fmt: skip
    assert torch.equal(ours, theirs.as_subclass(torch.Tensor))


@pytest.mark.parametrize(
    ("mode", "stats"),
    [("RGB", IMAGENET), ("L", ([0.5], [0.25])), ("RGB", ([0.5], [0.25])), ("I;16", ([0.5], [2.0]))],
)
def test_to_tensor_and_normalize_match_torchvision_bit_for_bit(
    mode: str, stats: tuple[list[float], list[float]]
) -> None:
    # hapi converts 8-bit images itself (torchvision's dispatch costs more than the work
    # on a small image): the values must stay torchvision's, or caches and exact=True
    # features would change under users.
    if mode == "I;16":  # 16-bit: torchvision's own path
        pixels = np.random.default_rng(0).integers(0, 65535, (40, 48), dtype=np.uint16)
        image = Image.fromarray(pixels)
    else:
        image = decode_image(jpeg(48, 40), "k").convert(mode)
    ours = Transforms((RandomResizedCrop(24), Normalize(*stats)))(image, seed=3)
    rrc = RandomResizedCrop(24)(image, random.Random(3))
    theirs = v2.Compose(
        [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(*stats)]
    )(rrc)
    assert torch.equal(ours, theirs.as_subclass(torch.Tensor))
    assert ours.is_contiguous() and ours.dtype == torch.float32


@pytest.mark.parametrize(
    "ops",
    [Transforms.train(24).ops, Transforms.eval(24).ops, (CenterCrop(24),),
     (CenterCrop(24), Normalize([0.5], [0.25]), Normalize([0.1], [2.0]))],
    ids=["train", "eval", "no-normalize", "two-normalizes"],
)  # fmt: skip
def test_a_batch_finished_together_is_bit_identical_to_each_sample_alone(
    ops: tuple[Op, ...],
) -> None:
    # The server converts and normalizes a batch's pixels in one pass (`finish`); an exact
    # job's local features and the caches hold each sample's own (`__call__`).
    transforms = Transforms(ops)
    rgb = [decode_image(jpeg(48 + 4 * i, 40), "k") for i in range(3)]
    sixteen = Image.fromarray(
        np.random.default_rng(0).integers(0, 65535, (40, 48), dtype=np.uint16)
    )  # 16-bit: torchvision's conversion, a float tensor from `prepare`
    gray = [rgb[0].convert("L"), sixteen]
    for batch, kinds in ((rgb, [torch.uint8] * 3), (gray, [torch.uint8, torch.float32])):
        alone = torch.stack([transforms(image, seed=i) for i, image in enumerate(batch)])
        prepared = [transforms.prepare(image, seed=i) for i, image in enumerate(batch)]
        together = transforms.finish(prepared)
        assert [p.dtype for p in prepared] == kinds
        assert torch.equal(together, alone) and together.is_contiguous()


def test_normalize_numerics() -> None:
    image = decode_image(jpeg(), "k")
    plain = Transforms()(image, seed=0)
    assert plain.min() >= 0 and plain.max() <= 1  # ToTensor semantics: 0..1
    normalized = Transforms((Normalize(),))(image, seed=0)
    mean = torch.tensor(IMAGENET[0])[:, None, None]
    std = torch.tensor(IMAGENET[1])[:, None, None]
    torch.testing.assert_close(normalized, (plain - mean) / std)


def test_flip_ops() -> None:
    image = decode_image(jpeg(), "k")
    plain = Transforms()(image, seed=0)
    assert torch.equal(Transforms((HorizontalFlip(p=1.0),))(image, seed=0), plain.flip(-1))
    assert torch.equal(Transforms((HorizontalFlip(p=0.0),))(image, seed=0), plain)


def test_presets() -> None:
    assert Transforms.train(32).is_random and not Transforms.eval(32).is_random
    assert Transforms.eval(224).ops[0] == Resize(256)  # torchvision's reference 256 -> 224
    assert Transforms.eval(224).to_dict() == {
        "ops": [
            {"op": "resize", "size": 256},
            {"op": "center_crop", "size": 224},
            {"op": "normalize", "mean": IMAGENET[0], "std": IMAGENET[1]},
        ],
        "reduced_decode": True,
    }


unit = st.floats(0.01, 1.0)
pairs = st.tuples(unit, unit).map(sorted).map(tuple)
ops = st.one_of(
    st.builds(Resize, st.integers(1, 512)),
    st.builds(CenterCrop, st.integers(1, 512)),
    st.builds(HorizontalFlip, st.floats(0, 1)),
    st.builds(
        RandomResizedCrop,
        st.integers(1, 512),
        scale=pairs,
        ratio=st.tuples(st.floats(0.1, 10), st.floats(0.1, 10)).map(sorted).map(tuple),
    ),
)
normalize = st.builds(
    Normalize,
    mean=st.lists(st.floats(-10, 10), min_size=3, max_size=3),
    std=st.lists(st.floats(0.01, 10), min_size=3, max_size=3),
)


@given(st.lists(ops, max_size=5), st.lists(normalize, max_size=1), st.booleans())
def test_transform_specs_round_trip_through_json(
    image_ops: list[Op], tail: list[Op], reduced: bool
) -> None:
    t = Transforms(tuple(image_ops + tail), reduced_decode=reduced)
    assert Transforms.from_dict(json.loads(json.dumps(t.to_dict(), allow_nan=False))) == t


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ({"ops": [{"op": "sharpen"}]}, "unknown transform"),
        ({"ops": [{"op": "resize", "size": 0}]}, "positive integer"),
        ({"ops": [{"op": "resize", "size": True}]}, "positive integer"),
        ({"ops": [{"op": "resize", "size": 8, "mode": "x"}]}, "no parameter"),
        ({"ops": [{"op": "resize"}]}, "missing"),
        ({"ops": [{"op": "horizontal_flip", "p": 2}]}, r"\[0, 1\]"),
        ({"ops": [{"op": "horizontal_flip", "p": "half"}]}, "finite number"),
        ({"ops": [{"op": "random_resized_crop", "size": 8, "scale": [0.5]}]}, "two numbers"),
        ({"ops": [{"op": "random_resized_crop", "size": 8, "scale": [0.9, 0.1]}]}, "a <= b"),
        ({"ops": [{"op": "normalize", "mean": [0.5, 0.5], "std": [1, 1]}]}, "1 or 3"),
        ({"ops": [{"op": "normalize", "mean": [0.5], "std": [0]}]}, "stds > 0"),
        ({"ops": [{"op": "normalize", "mean": [float("nan")], "std": [1]}]}, "finite"),
        ({"ops": [{"op": "normalize"}, {"op": "resize", "size": 8}]}, "after Normalize"),
        ({"ops": "resize"}, "ops"),
        ({"ops": [], "reduced_decode": "yes"}, "true or false"),
        ({"ops": [], "draft": True}, "no field"),
        ("resize", "ops"),
    ],
)
def test_bad_transform_specs_say_what_is_wrong(spec: object, needle: str) -> None:
    with pytest.raises(InvalidRequest, match=needle):
        Transforms.from_dict(spec)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["L", "RGBA", "P", "CMYK", "I;16"])
def test_any_image_mode_decodes_to_rgb(mode: str) -> None:
    image = decode_image(encoded(mode, "JPEG" if mode == "CMYK" else "PNG"), "k")
    assert image.mode == "RGB"
    assert Transforms.eval(8)(image, seed=0).shape == (3, 8, 8)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "cannot identify image file"),
        (b"not an image", "cannot identify image file"),
        (jpeg()[:300], "[Tt]runcated"),
        (jpeg()[: len(jpeg()) // 2], "truncated"),
    ],
)
def test_corrupt_and_truncated_images_name_their_key(data: bytes, reason: str) -> None:
    with pytest.raises(CorruptObject, match=rf"'train/cat/7.jpg' is not a decodable .*{reason}"):
        load_sample(data, "train/cat/7.jpg", Transforms.eval(8), seed=0)


def _png_header(width: int, height: int) -> bytes:
    """A PNG that says it is `width` x `height` pixels (a decompression bomb's header) and
    holds no pixels: refused from the header, it never needs them."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body).to_bytes(4, "big")
        return len(body).to_bytes(4, "big") + kind + body + crc

    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)  # 1-bit grey
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")


def test_oversized_images_are_refused_before_decoding() -> None:
    side = math.isqrt(MAX_PIXELS) + 1
    with pytest.raises(CorruptObject, match=f"{side}x{side} pixels is over {MAX_PIXELS}"):
        decode_image(_png_header(side, side), "big.png")
