"""The ops a `Transforms` pipeline is made of: small frozen dataclasses, JSON-safe.

Geometric ops (`Resize`, `CenterCrop`, `RandomResizedCrop`, `HorizontalFlip`) act on PIL
images; `Normalize` acts on the float32 CHW tensor the pipeline converts the image into.
Random ops draw only from the `random.Random` they are given, never the global RNG.

The ops that shrink (`Resize`, `RandomResizedCrop`) also say how small the image may be
decoded (`decode_size`) and apply themselves to an image decoded that small (`reduced`):
a JPEG decoder scales by 1/2, 1/4 or 1/8 as it decodes, for a fraction of the work.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from PIL import Image
from torchvision.transforms.v2 import functional as F

from hapi.errors import InvalidRequest, shorten

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "OPS",
    "CenterCrop",
    "HorizontalFlip",
    "ImageOp",
    "Normalize",
    "Op",
    "RandomResizedCrop",
    "Resize",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class Resize:
    """Resize the shorter side to `size` (bilinear, antialiased)."""

    size: int
    op: ClassVar[str] = "resize"

    def __post_init__(self) -> None:
        _positive_int("Resize.size", self.size)

    def __call__(self, image: Image.Image, rng: random.Random) -> Image.Image:
        return F.resize(image, [self.size], antialias=True)

    def decode_size(self, width: int, height: int, rng: random.Random) -> tuple[int, int]:
        """The smallest (width, height) whose shorter side still has `size` pixels."""
        short = min(width, height)
        if short <= self.size:
            return width, height
        return math.ceil(width * self.size / short), math.ceil(height * self.size / short)

    def reduced(
        self, image: Image.Image, full: tuple[int, int], scale: int, rng: random.Random
    ) -> Image.Image:
        """Resize `image`, decoded at 1/`scale` of `full` (width, height), to the size the
        full image would have been resized to."""
        width, height = full
        # torchvision's rule for the longer side, from the full size: from the decoded
        # one (rounded up by the decoder) it could come out a pixel longer.
        if width <= height:
            size = (self.size, int(self.size * height / width))
        else:
            size = (int(self.size * width / height), self.size)
        box = _scaled((0, 0, width, height), scale)
        return image.resize(size, Image.Resampling.BILINEAR, box=box)


@dataclass(frozen=True)
class CenterCrop:
    """Crop the central `size` x `size` square (padding with black if the image is smaller)."""

    size: int
    op: ClassVar[str] = "center_crop"

    def __post_init__(self) -> None:
        _positive_int("CenterCrop.size", self.size)

    def __call__(self, image: Image.Image, rng: random.Random) -> Image.Image:
        return F.center_crop(image, [self.size, self.size])


@dataclass(frozen=True)
class RandomResizedCrop:
    """Crop a random area and aspect ratio, resized to `size` (torchvision's sampling)."""

    size: int
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    op: ClassVar[str] = "random_resized_crop"

    def __post_init__(self) -> None:
        _positive_int("RandomResizedCrop.size", self.size)
        scale = _float_pair("RandomResizedCrop.scale", self.scale)
        ratio = _float_pair("RandomResizedCrop.ratio", self.ratio)
        if not 0 < scale[0] <= scale[1] <= 1:
            raise InvalidRequest(f"RandomResizedCrop.scale must be 0 < a <= b <= 1, got {scale}")
        if not 0 < ratio[0] <= ratio[1]:
            raise InvalidRequest(f"RandomResizedCrop.ratio must be 0 < a <= b, got {ratio}")
        object.__setattr__(self, "scale", scale)
        object.__setattr__(self, "ratio", ratio)

    def __call__(self, image: Image.Image, rng: random.Random) -> Image.Image:
        top, left, h, w = self.params(image.height, image.width, rng)
        return F.resized_crop(image, top, left, h, w, [self.size, self.size], antialias=True)

    def decode_size(self, width: int, height: int, rng: random.Random) -> tuple[int, int]:
        """The smallest (width, height) in which the crop `rng` draws is still `size`
        pixels square."""
        _, _, h, w = self.params(height, width, rng)
        return (
            min(width, math.ceil(width * self.size / w)),
            min(height, math.ceil(height * self.size / h)),
        )

    def reduced(
        self, image: Image.Image, full: tuple[int, int], scale: int, rng: random.Random
    ) -> Image.Image:
        """Crop and resize `image`, decoded at 1/`scale` of `full` (width, height): the
        crop is drawn for the full size, as `__call__` would, and scaled onto `image`."""
        top, left, h, w = self.params(full[1], full[0], rng)
        box = _scaled((left, top, left + w, top + h), scale)
        return image.resize((self.size, self.size), Image.Resampling.BILINEAR, box=box)

    def params(self, height: int, width: int, rng: random.Random) -> tuple[int, int, int, int]:
        """The crop `(top, left, height, width)` for an image of that size."""
        area = height * width
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(10):
            target = area * rng.uniform(*self.scale)
            aspect = math.exp(rng.uniform(*log_ratio))
            w = round(math.sqrt(target * aspect))
            h = round(math.sqrt(target / aspect))
            if 0 < w <= width and 0 < h <= height:
                return rng.randint(0, height - h), rng.randint(0, width - w), h, w
        # Fall back to a central crop of the nearest allowed ratio, as torchvision does.
        in_ratio = width / height
        if in_ratio < self.ratio[0]:
            w, h = width, round(width / self.ratio[0])
        elif in_ratio > self.ratio[1]:
            h, w = height, round(height * self.ratio[1])
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w


@dataclass(frozen=True)
class HorizontalFlip:
    """Mirror the image with probability `p`."""

    p: float = 0.5
    op: ClassVar[str] = "horizontal_flip"

    def __post_init__(self) -> None:
        p = _finite("HorizontalFlip.p", self.p)
        if not 0 <= p <= 1:
            raise InvalidRequest(f"HorizontalFlip.p must be in [0, 1], got {p}")
        object.__setattr__(self, "p", p)

    def __call__(self, image: Image.Image, rng: random.Random) -> Image.Image:
        # Draw even when p is 0 or 1, so that p does not shift the draws of later ops.
        return F.horizontal_flip(image) if rng.random() < self.p else image


@dataclass(frozen=True)
class Normalize:
    """Subtract `mean` and divide by `std` per channel, on the float32 CHW tensor."""

    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    op: ClassVar[str] = "normalize"

    def __post_init__(self) -> None:
        mean = tuple(_finite("Normalize.mean", m) for m in _sequence("Normalize.mean", self.mean))
        std = tuple(_finite("Normalize.std", s) for s in _sequence("Normalize.std", self.std))
        # One value applies to every channel; three are per RGB channel.
        if len(mean) not in (1, 3) or len(std) != len(mean) or any(s <= 0 for s in std):
            raise InvalidRequest(
                f"Normalize needs 1 or 3 means, as many stds, and stds > 0; got "
                f"mean={shorten(repr(mean))}, std={shorten(repr(std))}"
            )
        object.__setattr__(self, "mean", mean)
        object.__setattr__(self, "std", std)

    def __call__(self, tensor: torch.Tensor, rng: random.Random) -> torch.Tensor:
        if tensor.dtype != torch.float32 or tensor.ndim < 3:
            return F.normalize(tensor, list(self.mean), list(self.std))
        # torchvision's own arithmetic (`normalize_image`: subtract, then divide, in the
        # tensor's dtype), without its dispatch: the same values, a third of the time on a
        # 32 px sample.
        mean, std = _channel_stats(self.mean, self.std)
        return tensor.sub(mean).div_(std)


@functools.lru_cache(maxsize=64)
def _channel_stats(
    mean: tuple[float, ...], std: tuple[float, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`Normalize`'s mean and std as float32 (C, 1, 1) tensors, made once."""
    as_column = lambda v: torch.as_tensor(v, dtype=torch.float32).view(-1, 1, 1)  # noqa: E731
    return as_column(mean), as_column(std)


ImageOp = Resize | CenterCrop | RandomResizedCrop | HorizontalFlip
"""Ops that act on the PIL image, before the conversion to a tensor."""
Op = ImageOp | Normalize
OPS: dict[str, type[Op]] = {
    cls.op: cls for cls in (Resize, CenterCrop, RandomResizedCrop, HorizontalFlip, Normalize)
}
"""Every op by its name in `Transforms.to_dict()`."""


def _scaled(box: tuple[int, int, int, int], scale: int) -> tuple[float, float, float, float]:
    # A decoder scaled by 1/scale maps pixel x of the full image to x / scale exactly (its
    # last pixel, rounded up, covers the rest); PIL resamples from a fractional box.
    left, top, right, bottom = box
    return left / scale, top / scale, right / scale, bottom / scale


def _positive_int(name: str, value: Any) -> None:
    # bool is an int in Python, but `size=True` is a mistake, not a size of 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequest(f"{name} must be a positive integer, got {shorten(repr(value))}")


def _finite(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidRequest(f"{name} must be a finite number, got {shorten(repr(value))}")
    return float(value)


def _sequence(name: str, value: Any) -> tuple[Any, ...]:
    if not isinstance(value, list | tuple):
        raise InvalidRequest(f"{name} must be a list of numbers, got {shorten(repr(value))}")
    return tuple(value)


def _float_pair(name: str, value: Any) -> tuple[float, float]:
    items = _sequence(name, value)
    if len(items) != 2:
        raise InvalidRequest(f"{name} must be two numbers (low, high), got {shorten(repr(value))}")
    return _finite(name, items[0]), _finite(name, items[1])
