"""`Transforms`: a serialisable image pipeline whose randomness comes only from a seed.

A `Transforms` is data (a tuple of small frozen ops, see `hapi.data.ops`), so it travels in
a session request as JSON and the server builds exactly the pipeline the trainer asked
for. Random ops draw from a `random.Random` seeded by `sample_seed(job seed, epoch, key)`,
never from the global RNG, so a sample is bit-identical wherever it is transformed: on the
server, in the trainer, or on a retry.

Where the tensor appears: ops before the first `Normalize` act on the PIL image; right
before it (or at the end when there is none) the image becomes a float32 CHW tensor in
[0, 1] (torchvision's `ToImage` + `ToDtype(float32, scale=True)`).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from PIL import Image
from torchvision.transforms.v2 import functional as F

from hapi.data.ops import (
    OPS,
    CenterCrop,
    HorizontalFlip,
    Normalize,
    Op,
    RandomResizedCrop,
    Resize,
)
from hapi.errors import InvalidRequest, shorten

__all__ = ["Transforms", "sample_seed"]


def sample_seed(job_seed: int, epoch: int, key: str) -> int:
    """The seed of one sample's random transforms, in [0, 2**63).

    A keyed hash (not `hash()`, which is salted per process), so it is the same in every
    process, on every machine and in every Python version.
    """
    digest = hashlib.blake2b(f"{job_seed}:{epoch}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass(frozen=True)
class Transforms:
    """A pipeline of ops from a decoded RGB image to a float32 CHW tensor.

    Raises:
        InvalidRequest: an element is not an op, or an image op follows `Normalize`.
    """

    ops: tuple[Op, ...] = ()

    def __post_init__(self) -> None:
        ops = tuple(self.ops)
        normalized = False
        for op in ops:
            if not isinstance(op, tuple(OPS.values())):
                raise InvalidRequest(
                    f"not a transform op: {shorten(repr(op))}; known ops are {sorted(OPS)}"
                )
            if normalized and not isinstance(op, Normalize):
                raise InvalidRequest(
                    f"{type(op).__name__} after Normalize: image ops act on the image, so put "
                    "them before Normalize"
                )
            normalized = normalized or isinstance(op, Normalize)
        object.__setattr__(self, "ops", ops)

    @classmethod
    def train(cls, size: int) -> Transforms:
        """ImageNet-style training augmentation at `size`: random crop, flip, normalize."""
        return cls((RandomResizedCrop(size), HorizontalFlip(), Normalize()))

    @classmethod
    def eval(cls, size: int) -> Transforms:
        """ImageNet-style evaluation: shorter side to 8/7 of `size`, center crop, normalize.

        8/7 gives torchvision's reference 256 -> 224, the ratio pre-trained weights expect.
        """
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
                value = _to_tensor(value)
            value = op(value, rng)
        if isinstance(value, Image.Image):
            value = _to_tensor(value)
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
            raise InvalidRequest(f"transforms must be {{'ops': [...]}}, got {shorten(repr(data))}")
        ops: list[Op] = []
        for spec in data.get("ops", []):
            if not isinstance(spec, dict) or spec.get("op") not in OPS:
                raise InvalidRequest(
                    f"unknown transform {shorten(repr(spec))}: known ops are {sorted(OPS)}"
                )
            op_cls = OPS[spec["op"]]
            params = {k: v for k, v in spec.items() if k != "op"}
            unknown = set(params) - {f.name for f in fields(op_cls)}
            if unknown:
                raise InvalidRequest(
                    f"transform {shorten(repr(spec['op']))} has no parameter(s) "
                    f"{shorten(repr(sorted(unknown)))}; it takes "
                    f"{sorted(f.name for f in fields(op_cls))}"
                )
            try:
                ops.append(op_cls(**params))
            except TypeError as exc:
                raise InvalidRequest(
                    f"transform {shorten(repr(spec['op']))}: {shorten(str(exc))}"
                ) from None
        return cls(tuple(ops))


def _to_tensor(image: Image.Image) -> torch.Tensor:
    return F.to_dtype(F.to_image(image), torch.float32, scale=True)


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}
