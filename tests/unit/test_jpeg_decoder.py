"""JPEGs go through libjpeg-turbo directly (simplejpeg) and come out as PIL's draft decodes
them, pixel for pixel, at the size every transform asks for: `exact=True` and the feature
cache's keys rest on it. What it does not take falls back to PIL, and a damaged file is
still a `CorruptObject`."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from hapi.data import Transforms
from hapi.data.images import _open, _turbo, load_sample
from hapi.errors import CorruptObject

from .test_image_header import IMAGES

TRANSFORMS = [Transforms.eval(32), Transforms.eval(112), Transforms.train(64), Transforms.eval(224)]


def _photo(size: tuple[int, int]) -> bytes:
    """Smooth gradients and edges, as photos have (not noise), quality 90."""
    y, x = np.mgrid[0 : size[1], 0 : size[0]]
    pixels = np.stack([x * 255 // size[0], y * 255 // size[1], (x ^ y) & 255], -1)
    out = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(out, "JPEG", quality=90)
    return out.getvalue()


CASES = [*IMAGES, _photo((440, 440)), _photo((500, 375))]


@pytest.mark.parametrize("data", CASES, ids=range(len(CASES)))
@pytest.mark.parametrize("transforms", TRANSFORMS, ids=["eval32", "eval112", "train64", "eval224"])
def test_a_jpeg_decodes_to_pils_pixels_at_pils_size(data: bytes, transforms: Transforms) -> None:
    for seed in range(3):
        pil, full = _open(data, transforms, seed)
        expected = np.asarray(pil.convert("RGB"))
        fast = _turbo(data, transforms, seed)
        is_jpeg = data[:2] == b"\xff\xd8"
        if fast is None:
            # Only what libjpeg-turbo cannot turn into RGB: CMYK, and what is no JPEG.
            assert not is_jpeg or Image.open(io.BytesIO(data)).mode == "CMYK"
            continue
        assert is_jpeg
        image, stored = fast
        assert stored == full and image.mode == "RGB"
        assert np.array_equal(np.asarray(image), expected)


def test_samples_are_the_transforms_of_pils_pixels() -> None:
    data, transforms = _photo((440, 440)), Transforms.train(64)
    for seed in range(4):
        pil, full = _open(data, transforms, seed)
        expected = transforms(pil.convert("RGB"), seed=seed, full_size=full)
        assert torch.equal(load_sample(data, "k", transforms, seed), expected)


def test_a_truncated_jpeg_is_still_a_corrupt_object() -> None:
    data = _photo((440, 440))
    cut = data[: len(data) // 2]
    assert _turbo(cut, Transforms.eval(112), 0) is None  # libjpeg-turbo's warning raises
    with pytest.raises(CorruptObject, match="'shard/k.jpg' is not a decodable image"):
        load_sample(cut, "shard/k.jpg", Transforms.eval(112), 0)
