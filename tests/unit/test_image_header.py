"""The decoded size read from a JPEG's or PNG's header without PIL is the size PIL's
decoder gives, draft included: the server's memory estimate of every object rests on it."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from hapi.data import Transforms
from hapi.data.images import _open, decoded_size


def _encoded(size: tuple[int, int], fmt: str, mode: str = "RGB", **options: object) -> bytes:
    rng = np.random.default_rng(sum(size))
    pixels = rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(out, fmt, **options)
    return out.getvalue()


IMAGES = [
    _encoded((32, 32), "JPEG"),
    _encoded((440, 440), "JPEG", quality=90),
    _encoded((1000, 301), "JPEG", progressive=True),
    _encoded((257, 1999), "JPEG", mode="L"),
    _encoded((640, 480), "JPEG", mode="CMYK"),
    _encoded((300, 200), "PNG"),
    _encoded((45, 80), "PNG", mode="L"),
    _encoded((120, 90), "WEBP"),
]


@pytest.mark.parametrize("data", IMAGES, ids=range(len(IMAGES)))
@pytest.mark.parametrize(
    "transforms",
    [Transforms.eval(32), Transforms.eval(112), Transforms.train(64), Transforms.eval(224)],
    ids=["eval32", "eval112", "train64", "eval224"],
)
def test_the_header_gives_the_size_pil_decodes_at(data: bytes, transforms: Transforms) -> None:
    for seed in range(4):
        assert decoded_size(data, transforms, seed) == _open(data, transforms, seed)[0].size


def test_what_is_no_image_or_too_large_has_no_size() -> None:
    assert decoded_size(b"not an image at all", Transforms.eval(32), 0) is None
    assert decoded_size(b"\xff\xd8\xff\xe0\x00\x10JFIF", Transforms.eval(32), 0) is None
    huge = bytearray(_encoded((8, 8), "JPEG"))
    at = next(i for i in range(2, len(huge)) if huge[i] == 0xFF and huge[i + 1] == 0xC0)
    huge[at + 5 : at + 9] = (60_000).to_bytes(2, "big") * 2  # 60,000 x 60,000 pixels
    assert decoded_size(bytes(huge), Transforms.eval(32), 0) is None
