"""Memory layout of activations: the standard (C-contiguous) strides the wire assumes.

A model may leave an activation channels-last or permuted: ConvNeXt and Swin end in
`(N, C, 1, 1)` tensors whose strides come from an `(N, 1, 1, C)` one. `Tensor.contiguous()`
does nothing to those (size-1 dimensions make any stride contiguous), yet numpy and Arrow
read the strides as a permutation. `standard_layout` gives every tensor the strides of a
fresh C-contiguous tensor of its shape, copying only when the memory order differs.
"""

from __future__ import annotations

import torch

__all__ = ["is_standard_layout", "standard_layout"]


def standard_strides(shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
    """The strides of a C-contiguous tensor of `shape`, as torch computes them."""
    strides = []
    step = 1
    for size in reversed(tuple(shape)):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))


def is_standard_layout(t: torch.Tensor) -> bool:
    """Whether `t` has exactly the strides of a C-contiguous tensor of its shape."""
    return tuple(t.stride()) == standard_strides(t.shape)


def standard_layout(t: torch.Tensor) -> torch.Tensor:
    """`t` with standard C-contiguous strides: itself, a view of it, or a copy.

    A view when only size-1 dimensions have other strides (the memory order is the same);
    a copy when the memory order differs (channels-last, a transpose).
    """
    if is_standard_layout(t):
        return t
    if t.is_contiguous():
        return t.as_strided(t.shape, standard_strides(t.shape))
    return t.clone(memory_format=torch.contiguous_format)
