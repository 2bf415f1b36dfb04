"""Tensors at rest: content hashes and one-tensor safetensors blobs.

A tensor's identity is a SHA-256 over its dtype, its shape and its raw bytes (in the
machine's native byte order, which is little-endian everywhere torch runs). Two models
holding equal tensors therefore share one blob, whatever the tensors are called and
whether or not they were frozen - sharing by content, not by a flag.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator

import torch

from hapi.errors import IntegrityError, UnknownCodec
from hapi.repo.storage import codec
from hapi.repo.storage.codec import Base, BlobInfo

__all__ = ["decode_base", "decode_blob", "dtype_name", "encode_blob", "tensor_bytes", "tensor_hash"]

# Bumping this prefix changes every hash: only for a change of the hashed encoding.
_DOMAIN = b"hapi.tensor/1\0"
_BLOB_NAME = "tensor"
_REPAIR = "Run `hapi repo fsck --repair` to drop corrupt blobs, then push the model again"


def dtype_name(tensor: torch.Tensor) -> str:
    """The dtype as manifests spell it (`float32`, `bfloat16`, `int64`)."""
    return str(tensor.dtype).removeprefix("torch.")


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's raw bytes, C-contiguous, without a copy when it is already so."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    # A uint8 view works for every dtype, including the ones numpy lacks (bfloat16).
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]


def tensor_hash(tensor: torch.Tensor) -> str:
    """The hex SHA-256 content hash of `tensor` (dtype, shape and bytes)."""
    h = hashlib.sha256(_DOMAIN)
    h.update(json.dumps([dtype_name(tensor), list(tensor.shape)]).encode())
    h.update(b"\0")
    h.update(tensor_bytes(tensor))
    return h.hexdigest()


def encode_blob(tensor: torch.Tensor) -> bytes:
    """A safetensors file holding just `tensor`."""
    from safetensors.torch import save

    return save({_BLOB_NAME: tensor.detach().cpu().contiguous()})


def decode_blob(
    data: bytes,
    digest: str,
    what: str,
    *,
    verify: bool = True,
    base: Base | None = None,
    info: BlobInfo | None = None,
) -> torch.Tensor:
    """Read a blob, plain or compressed (see `codec.py`), and check it against its hash.

    Args:
        data: the blob's bytes.
        digest: the content hash the blob is stored under.
        what: names the tensor in errors (`'layer4.0.conv1.weight' of resnet50@3'`).
        verify: re-hash the tensor; without it only the blob's structure is checked.
        base: for a delta blob, the decoded tensor (or byte planes) it is a delta against.
        info: the blob's header, when the caller has parsed it already.

    Raises:
        IntegrityError: the blob cannot be parsed (truncated) or its content hash differs.
        UnknownCodec: the blob is compressed with a codec this hapi cannot read.
    """
    with _reading(data, digest, what):
        info = codec.read_info(data) if info is None else info
        plain = info.codec == codec.PLAIN
        tensor = _load_plain(data) if plain else codec.decode(data, info, base)
    if not verify:
        return tensor
    actual = tensor_hash(tensor)
    if actual != digest:
        held = f"a delta on {info.base[:12]}, " if info.base else ""
        raise IntegrityError(
            f"tensor {what} is corrupt: blob {digest[:12]} ({held}{info.codec}) holds content "
            f"{actual[:12]}. " + _REPAIR
        )
    return tensor


def decode_base(
    data: bytes,
    digest: str,
    what: str,
    *,
    base: Base | None = None,
    info: BlobInfo | None = None,
) -> Base:
    """A blob read only as the base of deltas: a plain blob's tensor, a compressed blob's
    byte planes (never interleaved: the deltas on it undo themselves plane by plane).

    Not re-hashed: a delta over a wrong base cannot hash right, and it is.

    Raises:
        IntegrityError: the blob cannot be parsed (truncated).
        UnknownCodec: the blob is compressed with a codec this hapi cannot read.
    """
    with _reading(data, digest, what):
        info = codec.read_info(data) if info is None else info
        if info.codec == codec.PLAIN:
            return _load_plain(data)
        return codec.decode_planes(data, info, base)


def _load_plain(data: bytes) -> torch.Tensor:
    from safetensors.torch import load

    return load(data)[_BLOB_NAME]


@contextlib.contextmanager
def _reading(data: bytes, digest: str, what: str) -> Iterator[None]:
    try:
        yield
    except UnknownCodec as exc:
        raise UnknownCodec(f"tensor {what} (blob {digest[:12]}): {exc}") from None
    except Exception as exc:  # safetensors raises several types for bad headers
        raise IntegrityError(
            f"tensor {what} (blob {digest[:12]}, {len(data)} bytes) is corrupt: "
            f"{type(exc).__name__}: {exc}. {_REPAIR}"
        ) from exc
