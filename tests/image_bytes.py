"""Small image bytes for the data tests."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def jpeg(height: int = 48, width: int = 56, seed: int = 0) -> bytes:
    """A noisy RGB JPEG of that size."""
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def encoded(mode: str, fmt: str = "PNG", size: int = 16) -> bytes:
    """A blank image in PIL mode `mode` ("L", "RGBA", "CMYK"...), saved as `fmt`."""
    buf = io.BytesIO()
    Image.new(mode, (size, size)).save(buf, fmt)
    return buf.getvalue()
