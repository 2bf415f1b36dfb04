"""The trainer's tier of the feature cache: one loop's features at the freeze point.

Features are kept at the freeze point, whatever cut they crossed at: they are what the
trainable tail takes, so a hit costs the trainer the tail alone. A sample's entry is
named by its key, its object's version as listed for the epoch, and the view the epoch
draws (`Transforms.view`); its space by the frozen head's content, the freeze point, the
transforms, the wire dtype and exactness (`FeatureSpace`). The versions are listed again
at the start of every epoch, so an object rewritten between epochs is a miss.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from hapi.cache import FeatureCache, FeatureSpace, entry_name
from hapi.data import Transforms
from hapi.data.columns import Column, Versions
from hapi.wire import WireDtype
from hapi.wire.dtypes import decoded_dtype

__all__ = ["Places", "TrainerCache", "head_content_digest", "loop_space"]

Places = tuple[Column[str], np.ndarray]
"""Keys' places in a manifest's key column: the column and their indices in it."""

_HELD_BATCH = 65536
"""Keys whose entry names `holds` makes at a time."""


def head_content_digest(head: nn.Module) -> str:
    """A digest of a frozen head's program and weights: equal heads, equal digests."""
    h = hashlib.blake2b(digest_size=16)
    code = getattr(head, "code", None)
    h.update((code if isinstance(code, str) else repr(head)).encode())
    for name, tensor in sorted(head.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def loop_space(
    head: nn.Module | str,
    freeze: int,
    transforms: Transforms,
    *,
    wire_dtype: WireDtype,
    exact: bool,
    seed: int,
) -> FeatureSpace:
    """The feature space of a loop over a dataset with `transforms`; `head` is the frozen
    head or its content digest (`head_content_digest`)."""
    return FeatureSpace(
        head=head if isinstance(head, str) else head_content_digest(head),
        cut=freeze,
        transforms=transforms.to_dict(),
        wire_dtype=wire_dtype,
        exact=exact,
        # Deterministic transforms do not depend on the seed: a sweep's jobs share entries.
        seed=seed if transforms.is_random else None,
    )


class TrainerCache:
    """Lookups and writes of one loop's features.

    Args:
        cache: the directory (shared by the job's loops and by other jobs).
        space: the loop's feature space (`loop_space`).
        transforms: the loop's transforms: which view an epoch draws.
        wire_dtype: the wire's dtype: entries are kept as features arrive in it.
    """

    def __init__(
        self,
        cache: FeatureCache,
        space: FeatureSpace,
        transforms: Transforms,
        wire_dtype: WireDtype,
    ) -> None:
        self.cache, self.space, self.transforms = cache, space, transforms
        self.dtype = decoded_dtype(wire_dtype)
        self._versions: dict[int, Versions] = {}
        self._lock = threading.Lock()

    @property
    def cut(self) -> int:
        """The cut entries are at: the freeze point."""
        return self.space.cut

    def set_versions(self, epoch: int, versions: Versions | None) -> None:
        """The objects' versions as listed for `epoch` (None: not listed, so nothing of
        the epoch is looked up or kept)."""
        with self._lock:
            self._versions = {e: v for e, v in self._versions.items() if e >= epoch - 1}
            if versions is not None:
                self._versions[epoch] = versions

    def versions(self, epoch: int) -> Versions | None:
        with self._lock:
            return self._versions.get(epoch)

    def repeats(self, epoch: int, later: int) -> bool:
        """Whether `later` draws the view `epoch` does: its entries are `epoch`'s."""
        view = self.transforms.view(epoch)
        return view is not None and view == self.transforms.view(later)

    def lookup(
        self, epoch: int, keys: Sequence[str], where: Places | None = None
    ) -> tuple[list[str], torch.Tensor | None]:
        """The epoch's cached entries of `keys`: their keys in order, and their features
        stacked in that order (None when none is cached). `where`: the keys' places in the
        manifest's key column, if known (their versions are then taken by place)."""
        names = self._names(epoch, keys, where)
        if names is None:
            return [], None
        found, rows = self.cache.get_batch(self.space, names)
        return [keys[i] for i in found], rows

    def holds(self, epoch: int, keys: Column[str]) -> bool:
        """Whether every one of `keys` (a manifest's key column) has an entry for `epoch`
        (not read: a corrupt or evicted one is a miss when its chunk comes)."""
        # In batches: the names of a million keys at once would take about 200 MB.
        for start in range(0, len(keys), _HELD_BATCH):
            part = keys[start : start + _HELD_BATCH]
            names = self._names(epoch, part, (keys, np.arange(start, start + len(part))))
            if names is None or not self.cache.contains_all(self.space, names):
                return False
        return True

    def store(self, epoch: int, keys: Sequence[str], features: torch.Tensor) -> None:
        """Keep the epoch's features of `keys` (one row each)."""
        names = self._names(epoch, keys)
        if names is None:
            return
        self.cache.put_many(self.space, names, list(features.to(self.dtype).unbind(0)))

    def _names(
        self, epoch: int, keys: Sequence[str], where: Places | None = None
    ) -> list[str] | None:
        view = self.transforms.view(epoch)
        versions = self.versions(epoch)
        if view is None or versions is None:
            return None
        # A key the listing lacks (gone since) has no version: its entry can never hit.
        unlisted = f"unlisted:{epoch}"
        listed = versions.at(*where, unlisted) if where else versions.of(keys, unlisted)
        return [entry_name(k, v, view) for k, v in zip(keys, listed, strict=True)]
