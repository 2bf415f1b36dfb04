"""`WireDtype`: the dtypes features may travel in, and what each means on both ends.

The one place that knows the set: `JobConfig`, the session messages, the server's size
estimates and the batch encoder all read it from here.
"""

from __future__ import annotations

from typing import Literal, get_args

import pyarrow as pa
import torch

from hapi.errors import InvalidRequest, shorten

__all__ = [
    "WIRE_DTYPES",
    "WireDtype",
    "arrow_type",
    "check_wire_dtype",
    "decoded_dtype",
    "dtype_width",
    "torch_dtype",
]

WireDtype = Literal["fp32", "fp16", "bf16", "int8", "fp8"]
"""fp32 is exact; fp16 and bf16 halve the bytes (bf16 keeps fp32's range); int8 quarters
them, with a scale and offset per sample and channel, and fp8 (E4M3) with a scale per
sample and channel (`hapi.wire.codecs`); both arrive as fp32."""

WIRE_DTYPES: tuple[WireDtype, ...] = get_args(WireDtype)

_TORCH: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "int8": torch.uint8,
    "fp8": torch.uint8,  # E4M3's bits: Arrow and numpy have no 8-bit float
}
# Arrow has no bfloat16: bf16 travels as its raw 16 bits, and the schema says how to read them.
_ARROW: dict[str, pa.DataType] = {
    "fp32": pa.float32(),
    "fp16": pa.float16(),
    "bf16": pa.uint16(),
    "int8": pa.uint8(),
    "fp8": pa.uint8(),
}
_QUANTIZED = frozenset({"int8", "fp8"})


def check_wire_dtype(value: object) -> WireDtype:
    """`value` as a `WireDtype`.

    Raises:
        InvalidRequest: it is not one, saying which are.
    """
    for dtype in WIRE_DTYPES:
        if value == dtype:
            if dtype == "fp8" and not hasattr(torch, "float8_e4m3fn"):
                raise InvalidRequest(
                    f"wire_dtype='fp8' needs torch.float8_e4m3fn, which torch {torch.__version__} "
                    "lacks: upgrade torch (2.1 or later), or send int8"
                )
            return dtype
    raise InvalidRequest(
        f"unknown wire dtype {shorten(repr(value))}: use {', '.join(WIRE_DTYPES[:-1])} or "
        f"{WIRE_DTYPES[-1]}"
    )


def torch_dtype(dtype: WireDtype) -> torch.dtype:
    """The torch dtype features have on the wire (and when decoded, but for int8's and
    fp8's, whose bits travel as uint8)."""
    return _TORCH[check_wire_dtype(dtype)]


def decoded_dtype(dtype: WireDtype) -> torch.dtype:
    """The torch dtype features have once decoded on the trainer: int8's and fp8's are
    dequantized to float32."""
    return torch.float32 if check_wire_dtype(dtype) in _QUANTIZED else _TORCH[dtype]


def arrow_type(dtype: WireDtype) -> pa.DataType:
    """The Arrow value type of a feature column in `dtype`."""
    return _ARROW[check_wire_dtype(dtype)]


def dtype_width(dtype: WireDtype) -> int:
    """Bytes per feature element on the wire (int8's and fp8's scales aside)."""
    return torch_dtype(dtype).itemsize
