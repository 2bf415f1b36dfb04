"""Wire codecs: lossless buffer compression of feature streams, and 8-bit features.

Two independent choices, both named by strings so that a cache key or a plan can hold
them: a `Compression` ("none", "lz4", "zstd": Arrow IPC buffer compression, lossless, so
`exact=True` keeps its guarantee), and the wire dtype, of which "int8" (a scale and an
offset per sample and channel) and "fp8" (E4M3, a scale per sample and channel) are lossy,
opt-in and refused with `exact=True`. More: `docs/architecture.md`, "Datasets and wire
codecs".
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple, get_args

import pyarrow as pa
import torch

from hapi.errors import InvalidRequest, shorten
from hapi.wire.dtypes import WireDtype, check_wire_dtype, dtype_width, torch_dtype

__all__ = [
    "COMPRESSIONS",
    "FP8_MAX",
    "LOSSY_DTYPES",
    "MIN_CHANNEL_ELEMENTS",
    "Compression",
    "Fp8",
    "Quantized",
    "check_compression",
    "dequantize",
    "dequantize_fp8",
    "int8_groups",
    "ipc_options",
    "is_lossy",
    "quantize",
    "quantize_fp8",
    "round_trip",
    "sample_bytes",
]

Compression = Literal["none", "lz4", "zstd"]
"""Arrow IPC buffer compression of a feature stream: none, LZ4 (frame) or ZSTD."""

COMPRESSIONS: tuple[Compression, ...] = get_args(Compression)

LOSSY_DTYPES = frozenset({"fp16", "bf16", "int8", "fp8"})
"""Wire dtypes whose features differ from the head's fp32 output (refused by `exact`)."""

MIN_CHANNEL_ELEMENTS = 64
"""A sample is quantized per channel (its first dimension) when each channel has at least
this many elements: a channel's scale and offset are 8 bytes, at most 1/8 of its data."""

# Arrow names LZ4's frame format "lz4" in IpcWriteOptions; IPC has no other LZ4.
_ARROW_CODEC = {"lz4": "lz4", "zstd": "zstd"}


def check_compression(value: object) -> Compression:
    """`value` as a `Compression`.

    Raises:
        InvalidRequest: it is not one, saying which are.
    """
    for name in COMPRESSIONS:
        if value == name:
            return name
    raise InvalidRequest(f"unknown wire compression {shorten(repr(value))}: use none, lz4 or zstd")


def is_lossy(wire_dtype: str) -> bool:
    """Whether features sent as `wire_dtype` differ from the head's fp32 output."""
    return wire_dtype in LOSSY_DTYPES


def ipc_options(compression: Compression) -> pa.ipc.IpcWriteOptions | None:
    """Arrow IPC write options that compress with `compression` (None: uncompressed).

    On the calling thread: the codec's CPU lands where the planner charges it (the thread
    that sends the chunk), and a thread's CPU clock sees it (Arrow's pool hid it).
    """
    compression = check_compression(compression)
    if compression == "none":
        return None
    return pa.ipc.IpcWriteOptions(compression=_ARROW_CODEC[compression], use_threads=False)


class Quantized(NamedTuple):
    """A batch of features as int8 sends it: `values` (uint8, the features' shape) and
    per sample and group a `scale` and `offset` (float32, (N, groups)), where a feature
    is `values * scale + offset`."""

    values: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor


def int8_groups(shape: tuple[int, ...] | list[int]) -> int:
    """Scale groups per sample of `shape`: its channels (first dimension) when each has at
    least `MIN_CHANNEL_ELEMENTS` elements, else 1 (the whole sample)."""
    if len(shape) >= 2 and math.prod(shape[1:]) >= MIN_CHANNEL_ELEMENTS:
        return int(shape[0])
    return 1


def quantize(x: torch.Tensor) -> Quantized:
    """Features (N, *shape) as 8-bit values with a scale and offset per sample and group.

    Asymmetric (min to max), so ReLU outputs, all >= 0, use all 256 levels. Each value is
    within half a step (`scale / 2`) of the feature, plus float32 rounding.

    Raises:
        InvalidRequest: a feature is not finite (8 bits cannot carry inf or NaN).
    """
    n = x.shape[0]
    groups = int8_groups(tuple(x.shape[1:]))
    flat = x.detach().to(device="cpu", dtype=torch.float32).reshape(n, groups, -1)
    if not bool(torch.isfinite(flat).all()):
        raise InvalidRequest(
            "the head's features hold inf or NaN, which int8 cannot carry: use "
            "wire_dtype='fp32' (or fp16) for this model"
        )
    lo = flat.amin(dim=2) if flat.numel() else torch.zeros(n, groups)
    hi = flat.amax(dim=2) if flat.numel() else torch.zeros(n, groups)
    # A constant group has no range: any scale gives its value back exactly from offset.
    scale = torch.where(hi > lo, (hi - lo) / 255.0, torch.ones_like(lo))
    q = torch.round((flat - lo.unsqueeze(2)) / scale.unsqueeze(2)).clamp_(0, 255)
    return Quantized(q.to(torch.uint8).reshape(x.shape), scale, lo)


def dequantize(q: Quantized) -> torch.Tensor:
    """The float32 features `q` stands for (N, *shape)."""
    n = q.values.shape[0]
    groups = q.scale.shape[1] if q.scale.dim() == 2 else 1
    flat = q.values.reshape(n, groups, -1).to(torch.float32)
    flat = flat * q.scale.reshape(n, groups, 1) + q.offset.reshape(n, groups, 1)
    return flat.reshape(q.values.shape)


FP8_MAX = 448.0
"""E4M3's largest finite value: a group's largest magnitude is scaled to it."""


class Fp8(NamedTuple):
    """A batch of features as fp8 sends it: `values` (uint8, E4M3's bits, the features'
    shape) and per sample and group a `scale` (float32, (N, groups)), where a feature is
    `float(values) * scale`."""

    values: torch.Tensor
    scale: torch.Tensor


def quantize_fp8(x: torch.Tensor) -> Fp8:
    """Features (N, *shape) as E4M3 floats with a scale per sample and group (the groups
    of int8, `int8_groups`).

    Symmetric: a group's largest magnitude maps to 448. Each value is within 2**-4 of
    itself relatively, or 2**-10 of its group's scale where it is that small
    (E4M3's subnormals), plus float32 rounding.

    Raises:
        InvalidRequest: a feature is not finite (the scale would be inf or NaN).
    """
    n = x.shape[0]
    groups = int8_groups(tuple(x.shape[1:]))
    flat = x.detach().to(device="cpu", dtype=torch.float32).reshape(n, groups, -1)
    if not bool(torch.isfinite(flat).all()):
        raise InvalidRequest(
            "the head's features hold inf or NaN, which fp8 cannot scale: use "
            "wire_dtype='fp32' (or fp16) for this model"
        )
    amax = flat.abs().amax(dim=2) if flat.numel() else torch.zeros(n, groups)
    # An all-zero group has no magnitude: any scale gives its zeros back exactly.
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    # Clamped: float32 rounding may put the largest a hair past 448, which E4M3 has not.
    scaled = (flat / scale.unsqueeze(2)).clamp_(-FP8_MAX, FP8_MAX)
    values = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
    return Fp8(values.reshape(x.shape), scale)


def dequantize_fp8(q: Fp8) -> torch.Tensor:
    """The float32 features `q` stands for (N, *shape)."""
    n = q.values.shape[0]
    groups = q.scale.shape[1] if q.scale.dim() == 2 else 1
    flat = q.values.reshape(n, groups, -1).view(torch.float8_e4m3fn).to(torch.float32)
    return (flat * q.scale.reshape(n, groups, 1)).reshape(q.values.shape)


def sample_bytes(shape: tuple[int, ...] | list[int], wire_dtype: WireDtype) -> int:
    """Feature bytes per sample of `shape` on the wire, uncompressed (int8's scales and
    offsets, fp8's scales included)."""
    wire_dtype = check_wire_dtype(wire_dtype)
    nbytes = dtype_width(wire_dtype) * math.prod(shape)
    if wire_dtype == "int8":
        nbytes += 8 * int8_groups(shape)
    elif wire_dtype == "fp8":
        nbytes += 4 * int8_groups(shape)
    return nbytes


def round_trip(x: torch.Tensor, wire_dtype: WireDtype) -> torch.Tensor:
    """`x` as the trainer receives it after crossing the wire as `wire_dtype`: what a
    trainer computing a chunk itself rounds its features through, so that a local sample
    equals a pushed-down one."""
    wire_dtype = check_wire_dtype(wire_dtype)
    if wire_dtype == "int8":
        return dequantize(quantize(x)).to(x.device)
    if wire_dtype == "fp8":
        return dequantize_fp8(quantize_fp8(x)).to(x.device)
    return x.to(torch_dtype(wire_dtype))
