"""Where the repository keeps things in the object store.

Everything lives under five prefixes of the store's root (`tensors/`, `manifests/`,
`refs/`, `locks/`, `deltas/`), so one store can hold datasets and a repository side by
side, and `reindex` needs nothing but these objects. What each holds, and why:
docs/repository.md, "Layout".
"""

from __future__ import annotations

__all__ = [
    "CHANGES",
    "DELTAS",
    "EPOCH",
    "LOCKS",
    "MANIFESTS",
    "REFS",
    "TENSORS",
    "delta_key",
    "hash_of_tensor_key",
    "id_of_manifest_key",
    "manifest_key",
    "parse_delta_key",
    "parse_ref_key",
    "ref_key",
    "tensor_key",
]

TENSORS = "tensors"
MANIFESTS = "manifests"
REFS = "refs"
LOCKS = "locks"
DELTAS = "deltas"
EPOCH = f"{REFS}/_epoch"
CHANGES = f"{REFS}/_changes"

_BLOB_SUFFIX = ".safetensors"
_MANIFEST_SUFFIX = ".json"


def tensor_key(digest: str) -> str:
    """The key of the blob holding the tensor with content hash `digest`."""
    return f"{TENSORS}/{digest[:2]}/{digest}{_BLOB_SUFFIX}"


def hash_of_tensor_key(key: str) -> str | None:
    """The content hash named by a blob key, or None for a key that is not a blob."""
    name = key.rsplit("/", 1)[-1]
    if not key.startswith(TENSORS + "/") or not name.endswith(_BLOB_SUFFIX):
        return None
    return name[: -len(_BLOB_SUFFIX)]


def manifest_key(manifest_id: str) -> str:
    """The key of a manifest."""
    return f"{MANIFESTS}/{manifest_id}{_MANIFEST_SUFFIX}"


def id_of_manifest_key(key: str) -> str | None:
    """The manifest id named by a manifest key, or None for another key."""
    name = key.rsplit("/", 1)[-1]
    if not key.startswith(MANIFESTS + "/") or not name.endswith(_MANIFEST_SUFFIX):
        return None
    return name[: -len(_MANIFEST_SUFFIX)]


def ref_key(name: str, version: int) -> str:
    """The key of version `version` of model `name`."""
    return f"{REFS}/{name}/{version}"


def parse_ref_key(key: str) -> tuple[str, int] | None:
    """`(name, version)` of a ref object's key, or None for any other key."""
    parts = key.split("/")
    if len(parts) != 3 or parts[0] != REFS or not parts[2].isdigit():
        return None
    return parts[1], int(parts[2])


def delta_key(digest: str, base: str) -> str:
    """The key saying that blob `digest` is a delta against tensor `base`."""
    return f"{DELTAS}/{digest}/{base}"


def parse_delta_key(key: str) -> tuple[str, str] | None:
    """`(digest, base)` of a delta key, or None for another key."""
    parts = key.split("/")
    if len(parts) != 3 or parts[0] != DELTAS:
        return None
    return parts[1], parts[2]
