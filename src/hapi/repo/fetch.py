"""Reading a version's tensors from the store, checked against the manifest."""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

from hapi.data.store import ObjectStore
from hapi.errors import IntegrityError, ObjectNotFound
from hapi.repo.layout import tensor_key
from hapi.repo.manifest import VersionManifest
from hapi.repo.tensors import decode_blob, dtype_name

__all__ = ["fetch_tensors"]

# Below this many bytes in all, decoding inline beats starting a pool of threads.
_INLINE_BYTES = 1 << 20


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
    """
    keys = list(keys)
    by_hash: dict[str, list[str]] = {}
    for key in keys:
        by_hash.setdefault(manifest.tensors[key].hash, []).append(key)
    digests = list(by_hash)
    blobs = store.get_many(tensor_key(d) for d in digests)

    def decode(item: tuple[str, bytes | BaseException]) -> torch.Tensor:
        digest, data = item
        what = f"{by_hash[digest][0]!r} of {label}"
        if isinstance(data, ObjectNotFound):
            raise IntegrityError(
                f"tensor {what} is missing from the store (blob {digest[:12]}): the repository "
                "lost it; push the model again to restore it"
            )
        if isinstance(data, BaseException):
            raise data
        tensor = decode_blob(data, digest, what, verify=verify)
        entry = manifest.tensors[by_hash[digest][0]]
        if dtype_name(tensor) != entry.dtype or tuple(tensor.shape) != entry.shape:
            raise IntegrityError(
                f"tensor {what} is {dtype_name(tensor)}{list(tensor.shape)} in the store but "
                f"{entry.dtype}{list(entry.shape)} in the manifest"
            )
        return tensor

    items = list(zip(digests, blobs, strict=True))
    total = sum(len(b) for _, b in items if isinstance(b, bytes))
    if len(items) <= 1 or concurrency == 1 or total < _INLINE_BYTES:
        tensors = [decode(item) for item in items]
    else:
        # Hashing and safetensors parsing release the GIL on large buffers.
        with ThreadPoolExecutor(min(concurrency, len(items)), "hapi-repo-decode") as pool:
            tensors = list(pool.map(decode, items))
    by_digest = dict(zip(digests, tensors, strict=True))
    return {key: by_digest[manifest.tensors[key].hash] for key in keys}
