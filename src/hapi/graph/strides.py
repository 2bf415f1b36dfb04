"""Memory layout of activations: the standard (C-contiguous) strides the wire assumes.

`standard_layout` gives every tensor the strides of a fresh C-contiguous tensor of its
shape, copying only when the memory order differs (`contiguous()` is not enough for
size-1 dimensions). A tail lays its input out again as the model had it
(`with_sample_strides`), so `tail(head(x))` is `model(x)` bit for bit. Why: docs/graph.md,
"The memory layout of activations".
"""

from __future__ import annotations

import torch

__all__ = [
    "dense_sample_strides",
    "is_standard_layout",
    "standard_layout",
    "with_sample_strides",
]


def standard_strides(shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
    """The strides of a C-contiguous tensor of `shape`, as torch computes them.

    The first dimension's size is never read, so a symbolic batch size (under
    torch.export) stays symbolic.
    """
    dims = tuple(shape)
    if not dims:
        return ()
    strides = []
    step = 1
    for size in reversed(dims[1:]):
        strides.append(step)
        step *= max(int(size), 1)
    strides.append(step)
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


def with_sample_strides(t: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor:
    """`t` laid out as the model laid out this activation: batch outermost, then each
    sample with `strides` (as traced), so the tail's kernels see what they saw in the model.

    A view when only size-1 dimensions differ, else a copy.
    """
    if tuple(t.stride()[1:]) == strides:
        return t
    per_sample = 1
    for size in t.shape[1:]:
        per_sample *= int(size)
    target = (per_sample, *strides)
    if all(a == b for a, b, n in zip(t.stride(), target, t.shape, strict=True) if n != 1):
        return t.as_strided(t.shape, target)
    out = torch.empty_strided(t.shape, target, dtype=t.dtype, device=t.device)
    return out.copy_(t)


def dense_sample_strides(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether per-sample `strides` lay out a sample of `shape` densely (some permutation of
    a contiguous layout), so a batch can be laid out the same way."""
    dims = sorted(((s, n) for s, n in zip(strides, shape, strict=True) if n != 1), reverse=True)
    step = 1
    for stride, size in reversed(dims):
        if stride != step:
            return False
        step *= size
    return True
