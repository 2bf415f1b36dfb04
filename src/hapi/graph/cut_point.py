"""`CutPoint`: one place a model can be split, and the two cuts before any of them."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["INPUT", "RAW", "CutPoint"]

RAW = -1
"""Cut: the store sends the objects' bytes; the trainer does everything."""
INPUT = 0
"""Cut: the store sends transformed input tensors (input-pipeline offload)."""


@dataclass(frozen=True)
class CutPoint:
    """One place a model can be split: cut `index` sends the activation after it."""

    index: int
    """1..n; cut k sends the activation after this point."""
    name: str
    """The block this cut follows (`layer2`, `features.3`, `flatten`)."""
    shape: tuple[int, ...]
    """Per-sample shape of the activation (no batch dimension)."""
    aliases: tuple[str, ...] = ()
    """Every other module name whose output this is (`layer1` and `layer1.1` end together)."""
    params_before: int = 0
    """Parameter elements the head up to this cut uses (its weights' memory, in numbers)."""

    @property
    def numel(self) -> int:
        """Elements of the activation per sample."""
        return math.prod(self.shape)

    @property
    def bytes_per_sample(self) -> int:
        """Bytes of the activation per sample in fp32."""
        return 4 * self.numel
