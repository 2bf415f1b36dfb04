"""One cache entry's bytes in a segment: a small header (dtype, shape) and the tensor's
bytes, padded to 8 so every payload is aligned; its CRC-32 lives in the index record."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import torch

from hapi.errors import InvalidRequest

__all__ = ["ALIGN", "decode", "encode"]

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


def decode(record: memoryview, crc: int) -> torch.Tensor | None:
    """The tensor of a record (a copy), or None where it is not whole and intact."""
    if len(record) < 4 or zlib.crc32(record) != crc:
        return None
    try:
        code, ndim = struct.unpack_from("<BB", record)
        dtype, np_dtype = _BY_CODE[code]
        shape = struct.unpack_from(f"<{ndim}I", record, 4)
        start = _padded(4 + 4 * ndim)
        count = int(np.prod(shape, dtype=np.int64))
        array = np.frombuffer(record, dtype=np_dtype, count=count, offset=start).reshape(shape)
    except (KeyError, ValueError, struct.error):
        return None
    tensor = torch.from_numpy(array.copy())
    return tensor.view(torch.bfloat16) if dtype == torch.bfloat16 else tensor
