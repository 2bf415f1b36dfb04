"""`Transforms`: a serialisable image pipeline whose randomness comes only from a seed.

A `Transforms` is data (a tuple of frozen ops, `hapi.data.ops`) that travels as JSON;
random ops draw from a `random.Random` seeded by `sample_seed(job seed, epoch, key)`, so a
sample is bit-identical wherever it is transformed. The image becomes a float32 CHW tensor
in [0, 1] right before the first `Normalize` (or at the end): `prepare` runs the image ops,
and `finish` converts and normalizes a batch of them at once. `reduced_decode` (on by
default) decodes a JPEG at a reduced size when the first op shrinks it. Details and
measurements: docs/data.md, "Transforms".
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np
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
    reduced_decode: bool = True
    """Decode a JPEG no larger than the first op's output needs (see the module's note)."""
    views: int | None = None
    """Draw each sample's random ops from one of this many seeded views, the view of epoch
    e being e mod `views`: from epoch `views` on, every sample repeats one seen before, so
    its features can be cached ("data echoing"). None: fresh draws every epoch."""

    def __post_init__(self) -> None:
        if not isinstance(self.reduced_decode, bool):
            raise InvalidRequest(
                f"reduced_decode must be true or false, got {shorten(repr(self.reduced_decode))}"
            )
        if self.views is not None and (
            isinstance(self.views, bool) or not isinstance(self.views, int) or self.views < 1
        ):
            raise InvalidRequest(
                f"views must be a whole number >= 1 (or None for fresh augmentation every "
                f"epoch), got {shorten(repr(self.views))}"
            )
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

    @property
    def random_ops(self) -> tuple[str, ...]:
        """The names of the ops that draw from the seed."""
        return tuple(op.op for op in self.ops if isinstance(op, RandomResizedCrop | HorizontalFlip))

    def view(self, epoch: int) -> int | None:
        """Which of the sample's views `epoch` draws: None where every epoch draws afresh
        (random ops, no `views`); 0 for a pipeline without random ops."""
        if not self.is_random:
            return 0
        return None if self.views is None else epoch % self.views

    def seed(self, job_seed: int, epoch: int, key: str) -> int:
        """The seed of one sample's random ops in `epoch` (its view's, with `views`)."""
        view = self.view(epoch)
        return sample_seed(job_seed, epoch if view is None else view, key)

    def decode_size(self, width: int, height: int, *, seed: int) -> tuple[int, int]:
        """The smallest (width, height) an image of that size may be decoded at for the
        sample of `seed`: smaller than its size only where the first op shrinks it."""
        first = self.ops[0] if self.ops else None
        if not self.reduced_decode or not isinstance(first, Resize | RandomResizedCrop):
            return width, height
        # The first op draws first: the same draws `__call__` makes.
        return first.decode_size(width, height, random.Random(seed))

    def __call__(
        self, image: Image.Image, *, seed: int, full_size: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """Transform one decoded image, drawing randomness only from `seed`.

        Args:
            full_size: the stored image's (width, height) where `image` was decoded smaller,
                at 1/2, 1/4 or 1/8 of it (`decode_size`): the first op then takes its
                geometry from the full size.
        """
        return self.finish([self.prepare(image, seed=seed, full_size=full_size)])[0]

    def prepare(
        self, image: Image.Image, *, seed: int, full_size: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """One image through the image ops (`__call__`'s arguments): its 8-bit pixels as an
        HWC uint8 tensor, which `finish` turns into the model's input with others of the
        batch; or, for an image of another mode, its CHW float32 tensor already."""
        rng = random.Random(seed)
        value: Any = image
        ops = self.ops
        if full_size is not None and full_size != image.size:
            first = ops[0] if ops else None
            if not isinstance(first, Resize | RandomResizedCrop):
                raise ValueError(f"{image.size} is not {full_size}, and no first op shrinks it")
            value = first.reduced(image, full_size, _scale(full_size, image.size), rng)
            ops = ops[1:]
        for op in ops:
            if isinstance(op, Normalize):
                break  # only Normalize follows one (`__post_init__`): `finish`'s
            value = op(value, rng)
        return _pixels(value)

    def finish(self, prepared: Sequence[torch.Tensor]) -> torch.Tensor:
        """A batch of `prepare`'s tensors (of one size) as the model's input: float32 NCHW,
        in [0, 1] and normalized by the `Normalize` ops - the same values `__call__` gives
        each, bit for bit (elementwise arithmetic, in the same order). A batch of 8-bit
        images is converted in one pass, not a handful of small torch calls a sample."""
        if all(p.dtype == torch.uint8 for p in prepared):
            # torchvision's `to_dtype(scale=True)`: the same multiply.
            batch = torch.stack(list(prepared)).permute(0, 3, 1, 2).to(torch.float32)
            batch = batch.mul_(1.0 / 255)
        else:
            batch = torch.stack([_float(p) for p in prepared])
        for op in self.ops:
            if isinstance(op, Normalize):
                batch = op(batch, _NO_DRAWS)
        return batch.contiguous()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe description; `from_dict` rebuilds the same pipeline."""
        return {
            "ops": [{"op": op.op, **_jsonable(asdict(op))} for op in self.ops],
            "reduced_decode": self.reduced_decode,
            # Only when set: a server from before `views` still reads every other pipeline.
            **({"views": self.views} if self.views is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Transforms:
        """Rebuild a pipeline from `to_dict` output.

        Raises:
            InvalidRequest: an unknown op or bad parameters, naming them.
        """
        if not isinstance(data, dict) or not isinstance(data.get("ops", []), list):
            raise InvalidRequest(f"transforms must be {{'ops': [...]}}, got {shorten(repr(data))}")
        unknown_keys = set(data) - {"ops", "reduced_decode", "views"}
        if unknown_keys:
            raise InvalidRequest(
                f"transforms have no field(s) {shorten(repr(sorted(unknown_keys)))}; they take "
                "'ops', 'reduced_decode' and 'views'"
            )
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
        return cls(
            tuple(ops), reduced_decode=data.get("reduced_decode", True), views=data.get("views")
        )


def _scale(full: tuple[int, int], decoded: tuple[int, int]) -> int:
    """The factor a decoder scaled `full` down by to `decoded` (it rounds up)."""
    for scale in (1, 2, 4, 8):
        if all(-(-f // scale) == d for f, d in zip(full, decoded, strict=True)):
            return scale
    raise ValueError(f"{decoded} is not {full} scaled by 1/2, 1/4 or 1/8")


def _pixels(image: Image.Image) -> torch.Tensor:
    """An 8-bit image's pixels as an HWC uint8 tensor (a copy: PIL's buffer is read-only);
    an image of another mode as a float32 CHW tensor in [0, 1], through torchvision's
    `to_image` and `to_dtype(scale=True)`."""
    array = np.array(image)
    if array.dtype != np.uint8:
        return F.to_dtype(F.to_image(image), torch.float32, scale=True).as_subclass(torch.Tensor)
    return torch.from_numpy(array).view(image.height, image.width, -1)


def _float(prepared: torch.Tensor) -> torch.Tensor:
    """One `prepare`d tensor as a float32 CHW tensor in [0, 1] (`finish`, a mixed batch)."""
    if prepared.dtype != torch.uint8:
        return prepared
    return prepared.permute(2, 0, 1).to(torch.float32).mul_(1.0 / 255)


_NO_DRAWS = random.Random(0)
"""What `Normalize` is called with in `finish`: it draws nothing."""


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}
