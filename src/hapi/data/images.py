"""Decoding objects into images, and images into model inputs."""

from __future__ import annotations

import io

import simplejpeg
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


def load_sample(
    data: Blob, key: str, transforms: Transforms, seed: int, *, finish: bool = True
) -> torch.Tensor:
    """Decode and transform one object into a float32 CHW tensor; a JPEG no larger than
    the transforms need (`Transforms.reduced_decode`). `finish=False`: the tensor
    `Transforms.prepare` gives, for `Transforms.finish` to convert with its batch.

    Raises:
        CorruptObject: the bytes are not a decodable image, naming the key.
    """
    image, full = _decode(data, key, transforms, seed)
    if not finish:
        return transforms.prepare(image, seed=seed, full_size=full)
    return transforms(image, seed=seed, full_size=full)


def decoded_size(data: Blob, transforms: Transforms, seed: int) -> tuple[int, int] | None:
    """The (width, height) `load_sample` decodes the object at, from its header alone;
    None when the bytes are not an image or one over `MAX_PIXELS`: `load_sample` then
    refuses it, before decoding, saying why.

    A JPEG's or PNG's header is read here, without PIL: opening the image took a server
    as long as decoding a 32 px one (`docs/server-profile.md`); others go through PIL.
    """
    header = _header_size(data)
    if header is None:
        try:
            return _open(data, transforms, seed)[0].size
        except Exception:  # PIL raises many types for what is not an image
            return None
    kind, full = header
    if full[0] * full[1] > MAX_PIXELS:
        return None
    wanted = transforms.decode_size(*full, seed=seed)
    return full if kind != "jpeg" else _draft_size(full, wanted)


def _draft_size(full: tuple[int, int], wanted: tuple[int, int]) -> tuple[int, int]:
    """The size PIL's JPEG draft decodes a `full`-sized JPEG at for `wanted`: the largest
    scale of 1/8, 1/4, 1/2, 1/1 that keeps `wanted`'s size."""
    if wanted == full:
        return full
    ratio = min(full[0] // wanted[0], full[1] // wanted[1])
    scale = next(s for s in (8, 4, 2, 1) if ratio >= s)
    return (full[0] + scale - 1) // scale, (full[1] + scale - 1) // scale


_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
"""JPEG markers whose segment gives the frame's size (start of frame, every coding)."""


def _header_size(data: Blob) -> tuple[str, tuple[int, int]] | None:
    """("jpeg" or "png", (width, height)) from a JPEG's frame header or a PNG's IHDR;
    None for anything else, or a header that does not parse (PIL then decides)."""
    view = memoryview(data)
    if view[:8] == b"\x89PNG\r\n\x1a\n" and view[12:16] == b"IHDR" and len(view) >= 24:
        return "png", (int.from_bytes(view[16:20], "big"), int.from_bytes(view[20:24], "big"))
    if view[:2] != b"\xff\xd8":
        return None
    at = 2
    while at + 9 <= len(view):
        if view[at] != 0xFF:
            return None
        marker = view[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # markers without a segment
            at += 2
            continue
        if marker in _SOF:
            height = int.from_bytes(view[at + 5 : at + 7], "big")
            width = int.from_bytes(view[at + 7 : at + 9], "big")
            return ("jpeg", (width, height)) if width and height else None
        if marker == 0xDA:  # scan data before a frame header: not a JPEG PIL reads
            return None
        at += 2 + int.from_bytes(view[at + 2 : at + 4], "big")
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
        fast = _turbo(data, transforms, seed)
        if fast is not None:
            return fast
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


def _turbo(
    data: Blob, transforms: Transforms | None, seed: int
) -> tuple[Image.Image, tuple[int, int]] | None:
    """A JPEG decoded by libjpeg-turbo through simplejpeg, at the size `_open` sets, and
    its stored size; None for what it does not take (not a JPEG, over `MAX_PIXELS`, CMYK,
    a file libjpeg-turbo warns about): PIL then decodes it, or says why it cannot.

    Why: the same pixels as PIL's draft (both run libjpeg-turbo's scaled accurate IDCT and
    smooth upsampling, which `exact=True` relies on; `tests/unit/test_jpeg_decoder.py` holds
    them equal) in 0.64-0.73x its time on ~100 KB photos (`benchmarks/decoders.py`): PIL
    feeds its decoder through Python-level buffers and copies the image to convert it.
    """
    if memoryview(data)[:2] != b"\xff\xd8":
        return None
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    full = width, height
    # CMYK and YCCK: PIL converts them to RGB its own way (values 1 apart).
    if colorspace not in ("YCbCr", "Gray") or width * height > MAX_PIXELS:
        return None
    size = full
    if transforms is not None:
        size = _draft_size(full, transforms.decode_size(*full, seed=seed))
    try:
        pixels = simplejpeg.decode_jpeg(
            data, colorspace="RGB", min_width=size[0], min_height=size[1]
        )
    except ValueError:  # strict: libjpeg-turbo's warnings (a truncated file) raise too
        return None
    if (pixels.shape[1], pixels.shape[0]) != size:
        return None  # a scale PIL's draft would not take: its pixels, not these
    return Image.fromarray(pixels), full
