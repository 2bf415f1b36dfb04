"""Decoding objects into images, and images into model inputs."""

from __future__ import annotations

import io
import warnings

import torch
from PIL import Image, UnidentifiedImageError

from hapi.data.transforms import Transforms
from hapi.errors import CorruptObject

__all__ = ["decode_image", "load_sample"]

# Refuse decompression bombs outright rather than warn: a server must not be made to
# allocate gigabytes by one crafted object.
Image.MAX_IMAGE_PIXELS = 64_000_000


def decode_image(data: bytes, key: str) -> Image.Image:
    """Decode an object's bytes into an RGB image.

    Raises:
        CorruptObject: the bytes are not a complete image, naming the key.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            image.load()  # force the decode now: a truncated file fails here, not later
        return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Warning) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CorruptObject(
            f"object {key!r} is not a decodable image ({reason}); replace or remove it, "
            "or use on_error='skip' to train on the rest and report it"
        ) from None


def load_sample(data: bytes, key: str, transforms: Transforms, seed: int) -> torch.Tensor:
    """Decode and transform one object into a float32 CHW tensor."""
    return transforms(decode_image(data, key), seed=seed)
