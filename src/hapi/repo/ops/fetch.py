"""Reading a version's tensors from the store, checked against the manifest."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from hapi.data.store import ObjectStore
from hapi.errors import IntegrityError
from hapi.repo.storage.blobs import read_blobs
from hapi.repo.storage.manifest import VersionManifest
from hapi.repo.storage.tensors import dtype_name

__all__ = ["fetch_tensors"]


def fetch_tensors(
    store: ObjectStore,
    manifest: VersionManifest,
    keys: Iterable[str],
    *,
    label: str,
    verify: bool = True,
    concurrency: int = 16,
) -> dict[str, torch.Tensor]:
    """Read the tensors `keys` of `manifest`, each distinct blob once.

    Args:
        store: where the blobs are.
        manifest: the version they belong to.
        keys: state-dict keys to read (all of them must be in the manifest).
        label: names the version in errors (`resnet50@3`).
        verify: re-hash each tensor.
        concurrency: blobs decoded and hashed at once.

    Raises:
        IntegrityError: a blob is missing, corrupt, truncated, or not the dtype and shape
            the manifest records; the message names the tensor and the version.
        UnknownCodec: a blob is compressed with a codec this hapi cannot read.
    """
    keys = list(keys)
    by_hash: dict[str, list[str]] = {}
    for key in keys:
        by_hash.setdefault(manifest.tensors[key].hash, []).append(key)

    def what(digest: str) -> str:
        return f"{by_hash[digest][0]!r} of {label}"

    decoded = read_blobs(store, by_hash, what=what, verify=verify, concurrency=concurrency)
    for digest, found in decoded.items():
        tensor = found.tensor
        entry = manifest.tensors[by_hash[digest][0]]
        if dtype_name(tensor) != entry.dtype or tuple(tensor.shape) != entry.shape:
            raise IntegrityError(
                f"tensor {what(digest)} is {dtype_name(tensor)}{list(tensor.shape)} in the "
                f"store but {entry.dtype}{list(entry.shape)} in the manifest"
            )
    return {key: decoded[manifest.tensors[key].hash].tensor for key in keys}
