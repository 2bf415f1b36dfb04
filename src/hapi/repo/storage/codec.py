"""Compressed tensor blobs: byte-grouped zstd, and XOR deltas against a base tensor.

A tensor's bytes are split into planes (byte 0 of every element, byte 1, ...), as ZipNN
does, each zstd-compressed on its own or stored raw; a delta stores the XOR of the
tensor's bit patterns with a base tensor's (ZipLLM's BitX). A compressed blob is still a
safetensors file: one `U8` tensor (`hapi.payload`) and `__metadata__` naming the codec,
dtype, shape, planes and, for a delta, its base and depth. The format, and why:
docs/repo-format.md, "Compressed".
"""

from __future__ import annotations

import functools
import json
import math
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias, cast

import numpy as np
import torch

from hapi.errors import IntegrityError, UnknownCodec

__all__ = [
    "DELTA",
    "PLAIN",
    "ZSTD",
    "Base",
    "BlobInfo",
    "compresses",
    "decode",
    "decode_planes",
    "encode_compressed",
    "planes_of",
    "read_info",
]

PLAIN = "safetensors"
"""A plain one-tensor safetensors file (no `hapi.codec` in its metadata)."""
ZSTD = "bytegroup-zstd/1"
DELTA = "xor-bytegroup-zstd/1"
_KNOWN = (ZSTD, DELTA)
_PAYLOAD = "hapi.payload"
# Level 1 measured both faster and smaller than level 3 on weight exponent planes
# (0.37 vs 0.42 of raw for a normal fp32 tensor); higher levels buy little on planes
# that are mostly noise.
_LEVEL = 1
_MIN_PLANE_SAVING = 0.1
# Headers larger than this are not ours (a one-tensor header is a few hundred bytes).
_MAX_HEADER = 1 << 20
_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}

Base: TypeAlias = "torch.Tensor | Sequence[np.ndarray[Any, np.dtype[np.uint8]]]"
"""A delta's decoded base: its tensor, or its byte planes (`decode_planes`)."""


@dataclass(frozen=True, kw_only=True)
class BlobInfo:
    """What a blob's header says about it."""

    codec: str
    """`PLAIN`, `ZSTD` or `DELTA`."""
    dtype: str = ""
    """The tensor's dtype (compressed blobs only)."""
    shape: tuple[int, ...] = ()
    """The tensor's shape (compressed blobs only)."""
    planes: tuple[int, ...] = ()
    """Stored bytes of each byte plane; a plane stored raw has its raw size."""
    base: str | None = None
    """The content hash of the base tensor, for a delta."""
    depth: int = 0
    """Blobs read beyond this one to decode it: 0, or the base's depth + 1 for a delta."""
    offset: int = 0
    """Where the payload starts in the blob."""

    @property
    def is_delta(self) -> bool:
        return self.codec == DELTA


def compresses(dtype: torch.dtype) -> bool:
    """Whether `encode_compressed` takes tensors of `dtype`."""
    return str(dtype).removeprefix("torch.") in _DTYPES


def read_info(data: bytes | memoryview) -> BlobInfo:
    """Parse a blob's safetensors header.

    Raises:
        IntegrityError: the header cannot be parsed (truncated or not a blob).
        UnknownCodec: the blob is compressed with a codec this version of hapi lacks.
    """
    try:
        (size,) = struct.unpack_from("<Q", data, 0)
        if size > min(_MAX_HEADER, len(data) - 8):
            raise ValueError(f"header of {size} bytes in a blob of {len(data)}")
        header = json.loads(bytes(data[8 : 8 + size]))
        meta = header.get("__metadata__") or {}
        codec = meta.get("hapi.codec")
        if codec is None:
            return BlobInfo(codec=PLAIN)
        if codec not in _KNOWN:
            raise UnknownCodec(
                f"tensor codec {codec!r} is unknown to this version of hapi (it reads "
                f"{', '.join(_KNOWN)}): upgrade hapi on this machine (pip install -U hapi)"
            )
        payload = header[_PAYLOAD]
        start, end = payload["data_offsets"]
        info = BlobInfo(
            codec=codec,
            dtype=str(meta["hapi.dtype"]),
            shape=tuple(int(d) for d in json.loads(meta["hapi.shape"])),
            planes=tuple(int(p) for p in json.loads(meta["hapi.planes"])),
            base=meta.get("hapi.base"),
            depth=int(meta.get("hapi.depth", 0)),
            offset=8 + size + int(start),
        )
        if info.dtype not in _DTYPES:
            raise ValueError(f"dtype {info.dtype!r} is not one hapi compresses")
        if sum(info.planes) != end - start or info.offset + sum(info.planes) > len(data):
            raise ValueError(f"payload of {end - start} bytes, planes of {sum(info.planes)}")
        if info.is_delta and not isinstance(info.base, str):
            raise ValueError("a delta without a base")
        return info
    except UnknownCodec:
        raise
    except (ValueError, KeyError, TypeError, struct.error) as exc:
        raise IntegrityError(f"unreadable blob header: {type(exc).__name__}: {exc}") from exc


def encode_compressed(
    tensor: torch.Tensor, base: tuple[str, torch.Tensor, int] | None = None
) -> bytes:
    """`tensor` as a compressed blob, or as a delta against `base` = (hash, tensor, depth).

    Raises:
        ValueError: a dtype hapi does not compress, or a base of another dtype or shape.
    """
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype {name} is not one hapi compresses")
    raw = _raw(tensor)
    meta = {"hapi.codec": ZSTD, "hapi.dtype": name, "hapi.shape": json.dumps(list(tensor.shape))}
    if base is not None:
        digest, other, depth = base
        if other.dtype != tensor.dtype or other.shape != tensor.shape:
            raise ValueError("a delta's base must have the tensor's dtype and shape")
        raw = _xor(raw, _raw(other))
        meta.update({"hapi.codec": DELTA, "hapi.base": digest, "hapi.depth": str(depth + 1)})
    planes = _group(raw, tensor.element_size())
    stored = []
    for plane in planes:
        packed = _zstd().compress(plane, asbytes=True) if plane.size else b""
        # Raw unless zstd saves a tenth (a raw plane's size tells a reader not to inflate):
        # inflating costs a reader about 1 ms a MB, so a plane that barely shrinks (a low
        # mantissa byte) is not worth it.
        small = len(packed) <= (1.0 - _MIN_PLANE_SAVING) * plane.size
        stored.append(packed if small else plane.tobytes())
    meta["hapi.planes"] = json.dumps([len(p) for p in stored])
    total = sum(len(p) for p in stored)
    header = json.dumps(
        {
            "__metadata__": meta,
            _PAYLOAD: {"dtype": "U8", "shape": [total], "data_offsets": [0, total]},
        },
        separators=(",", ":"),
    ).encode()
    header += b" " * (-len(header) % 8)  # safetensors aligns the data to 8 bytes
    return b"".join([struct.pack("<Q", len(header)), header, *stored])


def decode(data: bytes | memoryview, info: BlobInfo, base: Base | None = None) -> torch.Tensor:
    """The tensor a compressed blob holds (`base`: the decoded base of a delta).

    Each plane is written into its column as soon as it is inflated (XOR-ed with the
    base's first, for a delta), so a reader holds one inflated plane at a time.

    Raises:
        IntegrityError: a plane does not inflate to its size, or the base does not fit.
    """
    base_planes = _base_planes(info, base)
    # A plain base is one contiguous tensor: XOR-ed once after the interleave, in wide
    # words, rather than plane by plane through its strided byte views.
    whole = isinstance(base, torch.Tensor)
    if len(info.planes) == 2 and (base_planes is None or whole):
        low, high = (plane for _, plane in _stored_planes(data, info))
        flat = _interleave_pair(low, high)
    else:
        rows = np.empty((_count(info), len(info.planes)), np.uint8)
        # Column writes are numpy's fastest interleave of 4 and 8 planes (about 2.5 GB/s
        # on one core; shifts into wider words, transposed copies and torch's strided
        # copies measured slower), and with inflating the exponent plane most of what a
        # compressed blob costs a reader.
        for i, plane in _stored_planes(data, info):
            rows[:, i] = plane if base_planes is None or whole else _xor(plane, base_planes[i])
        flat = rows.reshape(-1)
    if whole:
        _xor_into(flat, _raw(cast(torch.Tensor, base)))
    return torch.from_numpy(flat).view(_DTYPES[info.dtype]).reshape(info.shape)


def decode_planes(
    data: bytes | memoryview, info: BlobInfo, base: Base | None = None
) -> list[np.ndarray[Any, np.dtype[np.uint8]]]:
    """A compressed blob's byte planes, XOR-ed with the base's for a delta.

    For a base only needed under deltas: raw planes are views of `data`, not copies, and
    a delta is undone plane by plane, so such a base is never interleaved into a tensor.

    Raises:
        IntegrityError: a plane does not inflate to its size, or the base does not fit.
    """
    base_planes = _base_planes(info, base)
    planes = []
    for i, plane in _stored_planes(data, info):
        planes.append(plane if base_planes is None else _xor(plane, base_planes[i]))
    return planes


def _interleave_pair(low: np.ndarray[Any, Any], high: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The bytes of a 2-byte dtype (bf16, fp16, int16), from its two byte planes.

    As little-endian words `low | high << 8`: each ufunc widens its byte plane in
    cache-sized chunks as it goes, so this writes each word twice at memory speed, where two
    byte column writes cost a third more (4.5 against 6.5 ms for 8.5 M elements on one
    core). Both planes are held at once, at most the tensor's size when both are inflated.
    """
    words = np.empty(low.shape[0], "<u2")
    np.left_shift(high, 8, out=words, dtype=words.dtype)
    np.bitwise_or(words, low, out=words, dtype=words.dtype)
    return words.view(np.uint8)


def _base_planes(info: BlobInfo, base: Base | None) -> Sequence[np.ndarray[Any, Any]] | None:
    """A delta's base as byte planes (None for a blob that is no delta)."""
    dtype = _DTYPES[info.dtype]
    if len(info.planes) != _itemsize(dtype):
        raise IntegrityError(f"a {info.dtype} blob with {len(info.planes)} byte planes")
    if not info.is_delta:
        return None
    planes = planes_of(base) if isinstance(base, torch.Tensor) else base
    if planes is None or len(planes) != len(info.planes) or not _fits(base, dtype, info):
        got = "nothing" if base is None else _describe(base)
        raise IntegrityError(f"a delta of {info.dtype}{list(info.shape)} over {got}")
    return planes


def _stored_planes(
    data: bytes | memoryview, info: BlobInfo
) -> Iterator[tuple[int, np.ndarray[Any, np.dtype[np.uint8]]]]:
    """(index, plane) for each byte plane as stored: raw ones are views of `data`."""
    count = _count(info)
    view = memoryview(data)
    at = info.offset
    for i, stored in enumerate(info.planes):
        chunk = view[at : at + stored]
        at += stored
        if stored == count:
            yield i, np.frombuffer(chunk, np.uint8)
            continue
        try:
            inflated = _zstd().decompress(chunk, decompressed_size=count, asbytes=False)
        except Exception as exc:  # pyarrow raises OSError or ArrowException subclasses
            raise IntegrityError(f"byte plane {i} does not inflate: {exc}") from exc
        yield i, np.frombuffer(inflated, np.uint8)


def planes_of(tensor: torch.Tensor) -> list[np.ndarray[Any, np.dtype[np.uint8]]]:
    """A decoded tensor's byte planes, as strided views (no copy)."""
    rows = _raw(tensor).reshape(-1, tensor.element_size())
    return [rows[:, i] for i in range(rows.shape[1])]


def _fits(base: Base | None, dtype: torch.dtype, info: BlobInfo) -> bool:
    if isinstance(base, torch.Tensor):
        return base.dtype == dtype and tuple(base.shape) == info.shape
    count = _count(info)
    return base is not None and all(p.shape == (count,) for p in base)


def _describe(base: Base) -> str:
    if isinstance(base, torch.Tensor):
        return f"{base.dtype}{list(base.shape)}"
    return f"{len(base)} planes of {[p.shape[0] for p in base]} bytes"


def _count(info: BlobInfo) -> int:
    return math.prod(info.shape)


@functools.cache
def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _raw(tensor: torch.Tensor) -> np.ndarray[Any, np.dtype[np.uint8]]:
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    # A uint8 view works for every dtype, including the ones numpy lacks (bfloat16).
    return flat.view(torch.uint8).numpy()


def _group(raw: np.ndarray[Any, Any], itemsize: int) -> list[np.ndarray[Any, Any]]:
    # Column copies into planes run at memory speed; a transposed copy is 3-4x slower.
    rows = raw.reshape(-1, itemsize)
    planes = [np.empty(rows.shape[0], np.uint8) for _ in range(itemsize)]
    for i, plane in enumerate(planes):
        plane[:] = rows[:, i]
    return planes


def _xor_into(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> None:
    """a ^= b, for contiguous byte arrays of one length."""
    if a.size % 8 == 0:
        np.bitwise_xor(a.view(np.uint64), b.view(np.uint64), out=a.view(np.uint64))
    else:
        np.bitwise_xor(a, b, out=a)


def _xor(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    # Wide words when both are contiguous and the length allows: 8 bytes per operation.
    if a.size % 8 == 0 and a.flags.c_contiguous and b.flags.c_contiguous:
        return np.bitwise_xor(a.view(np.uint64), b.view(np.uint64)).view(np.uint8)
    return np.bitwise_xor(a, b)


@functools.cache
def _zstd() -> Any:
    # One codec for all threads: Arrow's zstd calls keep no state between calls.
    import pyarrow as pa

    return pa.Codec("zstd", compression_level=_LEVEL)
