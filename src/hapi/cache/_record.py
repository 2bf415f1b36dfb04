"""One cache entry's bytes in a segment: a small header (dtype, shape) and the tensor's
bytes, padded to 8 so every payload is aligned; its CRC-32 lives in the index record."""

from __future__ import annotations

import functools
import struct
import zlib
from typing import NamedTuple

import numpy as np
import torch

from hapi.errors import InvalidRequest

__all__ = ["ALIGN", "Layout", "decode_block", "encode", "header"]

ALIGN = 8

_CODES: dict[torch.dtype, tuple[int, type[np.generic]]] = {
    torch.float32: (1, np.float32),
    torch.float16: (2, np.float16),
    # bf16 has no numpy dtype: its bytes travel as int16's.
    torch.bfloat16: (3, np.int16),
    torch.float64: (4, np.float64),
}
_BY_CODE = {code: (dtype, np_dtype) for dtype, (code, np_dtype) in _CODES.items()}


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def encode(tensor: torch.Tensor) -> tuple[bytes, int]:
    """The record of a contiguous CPU tensor, and the CRC-32 of its bytes.

    Raises:
        InvalidRequest: not a floating-point tensor of a kept dtype.
    """
    found = _CODES.get(tensor.dtype)
    if found is None:
        raise InvalidRequest(f"a cached feature must be floating point, got {tensor.dtype}")
    code, _ = found
    shape = tuple(tensor.shape)
    header = struct.pack(f"<BBxx{len(shape)}I", code, len(shape), *shape)
    header += bytes(_padded(len(header)) - len(header))
    view = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
    payload = view.numpy().tobytes()
    record = header + payload + bytes(_padded(len(payload)) - len(payload))
    return record, zlib.crc32(record)


class Layout(NamedTuple):
    """What a record's header says: where its payload starts and what it holds."""

    start: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    np_dtype: type[np.generic]
    nbytes: int


@functools.lru_cache(maxsize=256)
def _layout(head: bytes) -> Layout | None:
    try:
        code, ndim = struct.unpack_from("<BB", head)
        dtype, np_dtype = _BY_CODE[code]
        shape = tuple(struct.unpack_from(f"<{ndim}I", head, 4))
    except (KeyError, struct.error):
        return None
    count = 1
    for n in shape:
        count *= n
    return Layout(
        _padded(4 + 4 * ndim), shape, dtype, np_dtype, count * np.dtype(np_dtype).itemsize
    )


def header(record: memoryview) -> Layout | None:
    """The layout a record's header gives (the same few headers recur: parsed once each),
    or None where it is not a header or the record is shorter than it says."""
    if len(record) < 4:
        return None
    layout = _layout(bytes(record[: _padded(4 + 4 * record[1])]))
    if layout is None or layout.start + layout.nbytes > len(record):
        return None
    return layout


def decode_block(block: np.ndarray, crcs: np.ndarray) -> list[torch.Tensor | None]:
    """Records of one length, gathered as the rows of an array of 8-byte words (a record
    is padded to 8 and begins at a multiple of 8): each one's tensor, or None where it
    fails its CRC or its header.

    The rows whose header is the first intact row's (a space's entries are alike) are
    decoded together - one copy and one array, each tensor a row of it; the rest one by
    one. So a batch costs a CRC and a list slot per entry in Python, nothing more.
    """
    raw = block.view(np.uint8)
    out: list[torch.Tensor | None] = [None] * len(raw)
    sums = np.fromiter((zlib.crc32(row) for row in raw), np.uint32, len(raw))
    intact = np.flatnonzero(sums == crcs)
    if not len(intact):
        return out
    first = header(memoryview(raw[intact[0]]))
    alike = intact[:0]
    if first is not None:
        words = first.start // ALIGN
        alike = intact[(block[intact, :words] == block[intact[0], :words]).all(axis=1)]
        payload = raw[alike, first.start : first.start + first.nbytes]
        for i, tensor in zip(alike.tolist(), _tensors(payload, first), strict=True):
            out[i] = tensor
    for i in np.setdiff1d(intact, alike).tolist() if len(alike) < len(intact) else ():
        layout = header(memoryview(raw[i]))
        if layout is not None:
            out[i] = _tensors(raw[i : i + 1, layout.start : layout.start + layout.nbytes], layout)[
                0
            ]
    return out


def _tensors(payload: np.ndarray, layout: Layout) -> list[torch.Tensor]:
    """Rows of payload bytes (one per entry) as tensors of `layout`, rows of one tensor."""
    array = np.ascontiguousarray(payload).view(layout.np_dtype)
    batch = torch.from_numpy(array.reshape((len(payload), *layout.shape)))
    if layout.dtype == torch.bfloat16:
        batch = batch.view(torch.bfloat16)
    return list(batch.unbind(0))
