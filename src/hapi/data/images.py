"""Decoding objects into images, and images into model inputs."""

from __future__ import annotations

import io

import torch
from PIL import Image

from hapi.data.transforms import Transforms
from hapi.errors import CorruptObject, shorten

__all__ = ["MAX_PIXELS", "decode_image", "load_sample"]

MAX_PIXELS = 64_000_000
"""Images larger than this are refused before decoding: one crafted object must not make a
server allocate gigabytes. Checked here rather than through PIL's global
`Image.MAX_IMAGE_PIXELS`, which belongs to the user's program."""


def decode_image(data: bytes, key: str) -> Image.Image:
    """Decode an object's bytes into an RGB image, fully (a truncated file fails here).

    Raises:
        CorruptObject: the bytes are not a complete image of at most `MAX_PIXELS`, naming
            the key.
    """
    try:
        # No `warnings.catch_warnings()` here: it swaps process-wide state and is not
        # thread-safe, and chunks decode concurrently. PIL's own bomb limits lie above
        # MAX_PIXELS, so whatever it would only warn about is refused just below.
        image = Image.open(io.BytesIO(data))  # reads the header only
        if image.width * image.height > MAX_PIXELS:
            raise ValueError(f"{image.width}x{image.height} pixels is over {MAX_PIXELS}")
        # Decode now, and convert (which decodes lazily-loaded frames too), so that a
        # truncated file is a CorruptObject here and not an OSError deep in a transform.
        return image.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CorruptObject(
            f"object {shorten(repr(key))} is not a decodable image ({reason}); remove or "
            "replace it, or pass on_error='skip' to train on the rest and report it"
        ) from None


def load_sample(data: bytes, key: str, transforms: Transforms, seed: int) -> torch.Tensor:
    """Decode and transform one object into a float32 CHW tensor.

    Raises:
        CorruptObject: the bytes are not a decodable image, naming the key.
    """
    return transforms(decode_image(data, key), seed=seed)
