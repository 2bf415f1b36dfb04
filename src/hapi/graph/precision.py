"""The precision a frozen head runs in: fp32, or bf16 where the job allows it.

A job that sets `head_dtype="bf16"` lets its heads compute in bf16: under autocast
(convolutions and matrix products in bf16 with fp32 accumulation, normalisations and
reductions in fp32), on a device with bf16 kernels - AMX or AVX512-BF16 CPUs, GPUs that
have them. On this project's CPU (AMX) a ResNet-18 head runs 2x faster than in fp32, and
its features lie within 0.5-3.6% of the fp32 head's largest value depending on the model
(`benchmarks/heads.py`): lossy, so a job asks for it. `exact=True`, and devices that
would emulate bf16 (slower), keep fp32.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

__all__ = ["bf16_native", "head_dtype", "running_in"]


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


def head_dtype(asked: str, *, exact: bool, device: torch.device, allow: bool = True) -> torch.dtype:
    """The dtype a head computes in for a job that asked for `asked` (`fp32`, `bf16`).

    Args:
        exact: a job that asked for bit-for-bit features: always fp32.
        allow: the tier's own setting (`hapi serve --no-bf16-heads`).
    """
    if allow and not exact and asked == "bf16" and bf16_native(device.type):
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
