"""The precision a frozen head runs in: fp32, or bf16 where the job kept no more than bf16.

A session whose features cross the wire as bf16 or fp8 keeps at most bf16's 8 significant
bits of each value, so its head may compute in bf16 as well: under autocast (convolutions
and matrix products in bf16 with fp32 accumulation, normalisations and reductions in
fp32), on a device with bf16 kernels - AMX or AVX512-BF16 CPUs, GPUs that have them. On
this project's CPU (AMX) a ResNet-18 head runs 3x faster than in fp32; its features lie
within 0.8% of the fp32 head's largest value. fp32, fp16 and int8 wires (int8 promises
range/510), `exact=True`, and devices that would emulate bf16 keep fp32.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

__all__ = ["BF16_WIRES", "bf16_native", "head_dtype", "running_in"]

BF16_WIRES = frozenset({"bf16", "fp8"})
"""Wire dtypes that keep no more of a value than bf16 does."""


@functools.cache
def bf16_native(device_type: str) -> bool:
    """Whether devices of this type have bf16 kernels (not emulated, which is slower)."""
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device_type == "cpu":
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            return False
    return False


def head_dtype(
    wire_dtype: str, *, exact: bool, device: torch.device, allow: bool = True
) -> torch.dtype:
    """The dtype a head computes in for features that cross as `wire_dtype`.

    Args:
        exact: a job that asked for bit-for-bit features: always fp32.
        allow: the tier's own setting (`hapi serve --no-bf16-heads`).
    """
    if allow and not exact and wire_dtype in BF16_WIRES and bf16_native(device.type):
        return torch.bfloat16
    return torch.float32


@contextlib.contextmanager
def running_in(dtype: torch.dtype, device: torch.device) -> Iterator[None]:
    """Run the heads called inside in `dtype` (autocast for bf16; as they are for fp32)."""
    if dtype == torch.float32:
        yield
        return
    with torch.autocast(device.type, dtype=dtype):
        yield
