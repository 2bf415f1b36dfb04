"""One cache entry's bytes in a segment: a small header (dtype, shape) and the tensor's
bytes, padded to 8 so every payload is aligned; its CRC-32 lives in the index record."""

from __future__ import annotations

import functools
import struct
import zlib
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from hapi.errors import InvalidRequest

__all__ = ["ALIGN", "Decoded", "Layout", "decode_block", "encode", "header"]

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


def decode_block(block: np.ndarray, crcs: np.ndarray) -> Decoded:
    """Records of one length, gathered as the rows of an array of 8-byte words (a record
    is padded to 8 and begins at a multiple of 8), decoded: those that pass their CRC and
    their header, and which rows failed.

    The rows whose header is the first intact row's (a space's entries are alike) are
    decoded together - one copy into one tensor, a row each; the rest one by one. So a
    batch costs a CRC per entry in Python, nothing more.
    """
    raw = block.view(np.uint8)
    sums = np.fromiter((zlib.crc32(row) for row in raw), np.uint32, len(raw))
    intact = np.flatnonzero(sums == crcs)
    parts: list[tuple[np.ndarray, torch.Tensor]] = []
    alike = intact[:0]
    first = header(memoryview(raw[intact[0]])) if len(intact) else None
    if first is not None:
        words = first.start // ALIGN
        alike = intact[(block[intact, :words] == block[intact[0], :words]).all(axis=1)]
        # Every row alike (the usual case): a view of their payloads, one copy in `_batch`.
        rows = slice(None) if len(alike) == len(raw) else alike
        parts.append((alike, _batch(raw[rows, first.start : first.start + first.nbytes], first)))
    for i in np.setdiff1d(intact, alike).tolist() if len(alike) < len(intact) else ():
        layout = header(memoryview(raw[i]))
        if layout is not None:
            payload = raw[i : i + 1, layout.start : layout.start + layout.nbytes]
            parts.append((np.array([i]), _batch(payload, layout)))
    decoded = np.zeros(len(raw), bool)
    for rows, _ in parts:
        decoded[rows] = True
    return Decoded(parts, np.flatnonzero(~decoded))


@dataclass(frozen=True)
class Decoded:
    """A block's records decoded: batches of its rows, and the rows that failed."""

    parts: list[tuple[np.ndarray, torch.Tensor]]
    """(rows of the block, their tensors stacked in that order): one for the rows alike,
    one a row for any other."""
    failed: np.ndarray
    """Rows whose CRC or header failed: corrupt."""


def _batch(payload: np.ndarray, layout: Layout) -> torch.Tensor:
    """Rows of payload bytes (one per entry) as one tensor of `layout`'s, a row each."""
    array = np.ascontiguousarray(payload).view(layout.np_dtype)
    batch = torch.from_numpy(array.reshape((len(payload), *layout.shape)))
    return batch.view(torch.bfloat16) if layout.dtype == torch.bfloat16 else batch
