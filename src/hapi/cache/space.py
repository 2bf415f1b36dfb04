"""What a cached feature is a function of, and whether a job's features can be cached."""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from hapi.data import Transforms

__all__ = ["Cacheability", "FeatureSpace", "cacheability", "entry_name"]


@dataclass(frozen=True)
class Cacheability:
    """Whether a job's features repeat between epochs, and if not, why."""

    cacheable: bool
    why: str
    """One line for the plan and the summary."""


def cacheability(transforms: Transforms) -> Cacheability:
    """Whether the features of a pipeline repeat between epochs.

    A pipeline without random ops gives each sample the same input every epoch; with
    `views=K`, each of K views repeats every K epochs. Random ops drawing afresh every
    epoch make every sample new: nothing after the first of them can be cached.
    """
    random = transforms.random_ops
    if not random:
        return Cacheability(True, "cacheable: the transforms are deterministic")
    if transforms.views is not None:
        return Cacheability(
            True,
            f"cacheable: {', '.join(random)} draw from {transforms.views} seeded view(s) per "
            f"sample, so epoch e repeats epoch e - {transforms.views}",
        )
    names = [op.op for op in transforms.ops]
    first = names.index(random[0])
    before = f" ({', '.join(names[:first])} before it are deterministic)" if first else ""
    return Cacheability(
        False,
        f"not cacheable: {', '.join(random)} draw afresh every epoch{before}; pass views=K "
        "to draw from K seeded views, or deterministic transforms (augment=False)",
    )


@dataclass(frozen=True)
class FeatureSpace:
    """Everything a feature depends on besides its sample: two jobs whose spaces are equal
    compute the same feature for the same object, and share cache entries.

    Args:
        head: the frozen head's content digest (its program and weights).
        cut: the cut the features are at.
        transforms: the pipeline's `to_dict` (decode settings and `views` included).
        wire_dtype: the dtype features are kept in (as they cross the wire).
        exact: per-sample heads (bit for bit) or batched (equal to tolerance).
        seed: the job seed where the features depend on it (random ops with `views`);
            None otherwise, so jobs of a sweep with different seeds share entries.
    """

    head: str
    cut: int
    transforms: dict[str, Any]
    wire_dtype: str
    exact: bool
    seed: int | None = None

    @functools.cached_property
    def id(self) -> str:
        """A short digest of the space: its directory name in a cache (made once: every
        lookup names its space)."""
        text = json.dumps(self.describe(), sort_keys=True)
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()

    def describe(self) -> dict[str, Any]:
        return {
            "head": self.head,
            "cut": self.cut,
            "transforms": self.transforms,
            "wire_dtype": self.wire_dtype,
            "exact": self.exact,
            "seed": self.seed,
        }


def entry_name(key: str, version: str, view: int) -> str:
    """A sample's entry in a space: its key, the object's version and the view drawn.
    Without a version (a listing that gave none) the key alone names it, and a rewritten
    object would be a stale hit: hapi's own listings always give one."""
    text = f"{key}\0{version}\0{view}"
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
