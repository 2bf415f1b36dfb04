"""How a push stores each new tensor: a plain safetensors blob, compressed, or a delta.

A push hands each blob it must write to its encoder. `PlainEncoder`, the default, writes
plain safetensors files any tool reads. `CompressingEncoder` (`RepoConfig.compress`)
tries, for tensors of 16 KiB and more, the byte-grouped zstd blob and, for a tensor that
changed from the parent's tensor of the same name, dtype and shape (`RepoConfig.deltas`),
the XOR delta against it; it keeps the smallest, and falls back to the plain blob unless
that saves `min_saving` of it. With `RepoConfig.compress_whole` off it tries only deltas:
tensors stored whole stay plain.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from hapi.data.store import ObjectStore
from hapi.errors import IntegrityError, UnknownCodec
from hapi.repo.storage.blobs import read_blobs
from hapi.repo.storage.codec import compresses, encode_compressed
from hapi.repo.storage.manifest import VersionManifest
from hapi.repo.storage.repo_config import RepoConfig
from hapi.repo.storage.tensors import encode_blob

__all__ = [
    "BlobEncoder",
    "CompressingEncoder",
    "EncodedBlob",
    "PlainEncoder",
    "delta_bases",
    "encoder_for",
]

log = logging.getLogger("hapi.repo")

# Smaller tensors stay plain: compressed, a BatchNorm vector of a few KB saves a few hundred
# bytes, and decoding it costs a reader three times a plain blob's Python overhead (about
# 0.1 ms more per tensor, a ResNet-50 holds some 200 such; the GIL is held for it).
_MIN_BYTES = 16 << 10


@dataclass(frozen=True)
class EncodedBlob:
    """A blob to write."""

    data: bytes
    base: str | None = None
    """The content hash of the tensor it is a delta against, or None."""


class BlobEncoder(Protocol):
    """Turns a tensor into the blob stored under its content hash.

    Given the hash as well as the tensor because a delta's base is chosen by what the
    tensor is (which parent tensor it replaces), and the manifest speaks in hashes.
    """

    def encode(self, digest: str, tensor: torch.Tensor) -> EncodedBlob: ...


class PlainEncoder:
    """Every tensor as a plain one-tensor safetensors file."""

    def encode(self, digest: str, tensor: torch.Tensor) -> EncodedBlob:
        return EncodedBlob(encode_blob(tensor))


PLAIN_ENCODER = PlainEncoder()


class CompressingEncoder:
    """Compressed blobs and deltas against the parent's tensors, when they save enough."""

    def __init__(
        self,
        store: ObjectStore,
        *,
        bases: Mapping[str, str],
        min_saving: float,
        max_depth: int,
        whole: bool = True,
    ) -> None:
        self.store = store
        self.bases = bases
        self.min_saving = min_saving
        self.max_depth = max_depth
        self.whole = whole

    def encode(self, digest: str, tensor: torch.Tensor) -> EncodedBlob:
        plain = encode_blob(tensor)
        if (
            tensor.numel() * tensor.element_size() < _MIN_BYTES
            or not compresses(tensor.dtype)
            or not (self.whole or digest in self.bases)
        ):
            return EncodedBlob(plain)
        candidates = [EncodedBlob(encode_compressed(tensor))] if self.whole else []
        base = self._base(digest)
        if base is not None:
            candidates.append(EncodedBlob(encode_compressed(tensor, base), base[0]))
        # The first of equals: a delta only when it is smaller than the tensor compressed.
        best = min(candidates, key=lambda blob: len(blob.data), default=None)
        if best is None or len(best.data) > (1.0 - self.min_saving) * len(plain):
            return EncodedBlob(plain)
        return best

    def _base(self, digest: str) -> tuple[str, torch.Tensor, int] | None:
        """The parent's tensor this one may be a delta against: (hash, tensor, depth)."""
        base = self.bases.get(digest)
        if base is None:
            return None
        try:
            found = read_blobs(
                self.store, [base], what=lambda d: f"delta base {d[:12]}", concurrency=1
            )[base]
        except (IntegrityError, UnknownCodec) as exc:
            # Not fatal: the tensor is then stored whole, and fsck reports the base.
            log.warning("storing tensor %s whole: %s", digest[:12], exc)
            return None
        if found.depth >= self.max_depth:
            return None
        return base, found.tensor, found.depth


def delta_bases(manifest: VersionManifest, parent: VersionManifest) -> dict[str, str]:
    """For each tensor of `manifest` that replaces a parent's tensor of the same key,
    dtype and shape, that tensor's hash: content hash -> base content hash."""
    bases: dict[str, str] = {}
    for key, entry in manifest.tensors.items():
        old = parent.tensors.get(key)
        if (
            old is not None
            and old.hash != entry.hash
            and old.dtype == entry.dtype
            and old.shape == entry.shape
        ):
            bases.setdefault(entry.hash, old.hash)
    return bases


def encoder_for(
    config: RepoConfig,
    store: ObjectStore,
    manifest: VersionManifest,
    parent: VersionManifest | None,
) -> BlobEncoder:
    """The encoder `config` asks for, for a push of `manifest` derived from `parent`."""
    if not config.compress:
        return PLAIN_ENCODER
    bases = delta_bases(manifest, parent) if config.deltas and parent is not None else {}
    return CompressingEncoder(
        store,
        bases=bases,
        min_saving=config.min_saving,
        max_depth=config.max_delta_depth,
        whole=config.compress_whole,
    )
