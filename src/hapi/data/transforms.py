"""Serialisable image transforms whose randomness comes only from a per-sample seed.

A `Transforms` is data (a tuple of small frozen ops), so it travels in a session request
as JSON and the server builds exactly the pipeline the trainer asked for. Random ops draw
from a generator seeded by `sample_seed(job seed, epoch, key)`, never from the global RNG,
so a sample is bit-identical wherever it is transformed: on the server, in the trainer,
or on a retry.

Ops before `Normalize` act on PIL images; the image becomes a float32 CHW tensor in [0, 1]
right before the first `Normalize` (or at the end when there is none).
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

import torch
from PIL import Image
from torchvision.transforms.v2 import functional as F

from hapi.errors import InvalidRequest

__all__ = [
    "CenterCrop",
    "HorizontalFlip",
    "Normalize",
    "RandomResizedCrop",
    "Resize",
    "Transforms",
    "sample_seed",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def sample_seed(job_seed: int, epoch: int, key: str) -> int:
    """The seed of one sample's random transforms: stable across processes and machines."""
    digest = hashlib.blake2b(f"{job_seed}:{epoch}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass(frozen=True)
class Resize:
    """Resize the shorter side to `size` (bilinear, antialiased)."""

    size: int
    op: ClassVar[str] = "resize"

    def __post_init__(self) -> None:
        _positive("Resize.size", self.size)

    def __call__(self, image: Image.Image, rng: random.Random) -> Image.Image:
        return F.resize(image, [self.size], antialias=True)


@dataclass(frozen=True)
class CenterCrop:
    """Crop the central `size` x `size` square."""

    size: int
    op: ClassVar[str] = "center_crop"

    def __post_init__(self) -> None:
        _positive("CenterCrop.size", self.size)

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
        _positive("RandomResizedCrop.size", self.size)
        object.__setattr__(self, "scale", tuple(self.scale))
        object.__setattr__(self, "ratio", tuple(self.ratio))
        if not (0 < self.scale[0] <= self.scale[1] <= 1):
            raise InvalidRequest(f"RandomResizedCrop.scale must be 0 < a <= b <= 1: {self.scale}")
        if not (0 < self.ratio[0] <= self.ratio[1]):
            raise InvalidRequest(f"RandomResizedCrop.ratio must be 0 < a <= b: {self.ratio}")

    def __call__(self, image: Image.Image, rng: random.Random) -> Image.Image:
        top, left, h, w = self._params(image.height, image.width, rng)
        return F.resized_crop(image, top, left, h, w, [self.size, self.size], antialias=True)

    def _params(self, height: int, width: int, rng: random.Random) -> tuple[int, int, int, int]:
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
        if not 0 <= self.p <= 1:
            raise InvalidRequest(f"HorizontalFlip.p must be in [0, 1], got {self.p}")

    def __call__(self, image: Image.Image, rng: random.Random) -> Image.Image:
        return F.horizontal_flip(image) if rng.random() < self.p else image


@dataclass(frozen=True)
class Normalize:
    """Subtract `mean` and divide by `std` per channel (on the float tensor)."""

    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    op: ClassVar[str] = "normalize"

    def __post_init__(self) -> None:
        object.__setattr__(self, "mean", tuple(float(m) for m in self.mean))
        object.__setattr__(self, "std", tuple(float(s) for s in self.std))
        if len(self.mean) != len(self.std) or any(s <= 0 for s in self.std):
            raise InvalidRequest(
                f"Normalize needs as many means as stds and positive stds: {self.mean}, {self.std}"
            )

    def __call__(self, tensor: torch.Tensor, rng: random.Random) -> torch.Tensor:
        return F.normalize(tensor, list(self.mean), list(self.std))


Op = Resize | CenterCrop | RandomResizedCrop | HorizontalFlip | Normalize
_OPS: dict[str, type[Op]] = {
    cls.op: cls for cls in (Resize, CenterCrop, RandomResizedCrop, HorizontalFlip, Normalize)
}


@dataclass(frozen=True)
class Transforms:
    """A pipeline of ops from decoded image to float32 CHW tensor."""

    ops: tuple[Op, ...] = ()

    @classmethod
    def train(cls, size: int) -> Transforms:
        """ImageNet-style training augmentation at `size`."""
        return cls((RandomResizedCrop(size), HorizontalFlip(), Normalize()))

    @classmethod
    def eval(cls, size: int) -> Transforms:
        """ImageNet-style evaluation: resize to 8/7 of `size`, center crop, normalize."""
        return cls((Resize(round(size * 8 / 7)), CenterCrop(size), Normalize()))

    @property
    def is_random(self) -> bool:
        """Whether the result depends on the seed."""
        return any(isinstance(op, RandomResizedCrop | HorizontalFlip) for op in self.ops)

    def __call__(self, image: Image.Image, *, seed: int) -> torch.Tensor:
        """Transform one decoded image, drawing randomness only from `seed`."""
        rng = random.Random(seed)
        value: Any = image
        for op in self.ops:
            if isinstance(op, Normalize) and isinstance(value, Image.Image):
                value = F.to_dtype(F.to_image(value), torch.float32, scale=True)
            value = op(value, rng)
        if isinstance(value, Image.Image):
            value = F.to_dtype(F.to_image(value), torch.float32, scale=True)
        return value.as_subclass(torch.Tensor).contiguous()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe description; `from_dict` rebuilds the same pipeline."""
        return {"ops": [{"op": op.op, **_jsonable(asdict(op))} for op in self.ops]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Transforms:
        """Rebuild a pipeline from `to_dict` output.

        Raises:
            InvalidRequest: an unknown op or bad parameters, naming them.
        """
        if not isinstance(data, dict) or not isinstance(data.get("ops", []), list):
            raise InvalidRequest(f"transforms must be {{'ops': [...]}}, got {data!r}")
        ops: list[Op] = []
        for spec in data.get("ops", []):
            if not isinstance(spec, dict) or spec.get("op") not in _OPS:
                raise InvalidRequest(
                    f"unknown transform {spec!r}: known ops are {sorted(_OPS)}"
                )
            cls_ = _OPS[spec["op"]]
            params = {k: v for k, v in spec.items() if k != "op"}
            allowed = {f.name for f in fields(cls_)}
            if set(params) - allowed:
                raise InvalidRequest(
                    f"transform {spec['op']!r} has no parameter(s) {sorted(set(params) - allowed)}"
                    f"; it takes {sorted(allowed)}"
                )
            try:
                ops.append(cls_(**params))
            except TypeError as exc:
                raise InvalidRequest(f"transform {spec['op']!r}: {exc}") from exc
        return cls(tuple(ops))


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise InvalidRequest(f"{name} must be a positive integer, got {value!r}")


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}
