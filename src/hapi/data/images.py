"""Decoding objects into images, and images into model inputs."""

from __future__ import annotations

import io

import torch
from PIL import Image

from hapi.data.shards.blob import Blob
from hapi.data.transforms import Transforms
from hapi.errors import CorruptObject, shorten

__all__ = ["MAX_PIXELS", "decode_image", "decoded_size", "load_sample"]

MAX_PIXELS = 64_000_000
"""Images larger than this are refused before decoding: one crafted object must not make a
server allocate gigabytes. Checked here rather than through PIL's global
`Image.MAX_IMAGE_PIXELS`, which belongs to the user's program."""


def decode_image(data: Blob, key: str) -> Image.Image:
    """Decode an object's bytes into an RGB image, fully (a truncated file fails here).

    Raises:
        CorruptObject: the bytes are not a complete image of at most `MAX_PIXELS`, naming
            the key.
    """
    return _decode(data, key, None, 0)[0]


def load_sample(data: Blob, key: str, transforms: Transforms, seed: int) -> torch.Tensor:
    """Decode and transform one object into a float32 CHW tensor; a JPEG no larger than
    the transforms need (`Transforms.reduced_decode`).

    Raises:
        CorruptObject: the bytes are not a decodable image, naming the key.
    """
    image, full = _decode(data, key, transforms, seed)
    return transforms(image, seed=seed, full_size=full)


def decoded_size(data: Blob, transforms: Transforms, seed: int) -> tuple[int, int] | None:
    """The (width, height) `load_sample` decodes the object at, from its header alone;
    None when the bytes are not an image or one over `MAX_PIXELS`: `load_sample` then
    refuses it, before decoding, saying why."""
    try:
        return _open(data, transforms, seed)[0].size
    except Exception:  # PIL raises many types for what is not an image
        return None


def _open(
    data: Blob, transforms: Transforms | None, seed: int
) -> tuple[Image.Image, tuple[int, int]]:
    """The image, its header read and its decoder set to the size `transforms` needs for
    the sample of `seed` (or the nearest larger one it can scale to: JPEG only), and the
    stored size.

    Raises:
        ValueError: the image has more than `MAX_PIXELS`.
    """
    image = Image.open(io.BytesIO(data))  # reads the header only
    full = image.size
    if image.width * image.height > MAX_PIXELS:
        raise ValueError(f"{image.width}x{image.height} pixels is over {MAX_PIXELS}")
    if transforms is not None:
        size = transforms.decode_size(*full, seed=seed)
        if size != full:
            image.draft(None, size)  # a no-op but for JPEG
    return image, full


def _decode(
    data: Blob, key: str, transforms: Transforms | None, seed: int
) -> tuple[Image.Image, tuple[int, int]]:
    """The RGB image, decoded as `_open` sets it, and the stored size."""
    try:
        # No `warnings.catch_warnings()` here: it swaps process-wide state and is not
        # thread-safe, and chunks decode concurrently. PIL's own bomb limits lie above
        # MAX_PIXELS, so whatever it would only warn about is refused in `_open`.
        image, full = _open(data, transforms, seed)
        # Decode now, and convert (which decodes lazily-loaded frames too), so that a
        # truncated file is a CorruptObject here and not an OSError deep in a transform.
        return image.convert("RGB"), full
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CorruptObject(
            f"object {shorten(repr(key))} is not a decodable image ({reason}); remove or "
            "replace it, or pass on_error='skip' to train on the rest and report it"
        ) from None
