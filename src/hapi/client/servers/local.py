"""`LocalCompute`: a local chunk's work in the trainer, from raw bytes to features at a cut.

A hybrid plan sends some chunks' raw bytes to the trainer, which decodes and transforms
them with the server's own sample pipeline and runs the frozen head up to the plan's cut
itself, so they join the pushed-down chunks' stream at the same cut with the same values.
The baseline (RAW) is the case where the head is empty: decoding only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from hapi._fx_lock import TRACING
from hapi.client.servers.decode import RawDecoder
from hapi.graph import INPUT
from hapi.wire import FeatureBatch, SkippedKey
from hapi.wire.codecs import round_trip

__all__ = ["LocalCompute"]


@dataclass
class LocalCompute:
    """Decode raw batches and run the frozen head to a cut, as the server would.

    Args:
        decoder: the sample pipeline with the loop's transforms and seed.
        head: the frozen head up to a cut (called once per cut, then cached).
        wire_dtype: features are rounded through it, so a local sample equals a pushed-
            down one exactly.
        device: where the head runs; features come back on the CPU, like the wire's.
        exact: run the head per sample, as an exact job's server does.
    """

    decoder: RawDecoder
    head: Callable[[int], nn.Module]
    wire_dtype: str = "fp32"
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    exact: bool = False
    _heads: dict[int, nn.Module] = field(default_factory=dict, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __call__(
        self, batch: FeatureBatch, epoch: int, cut: int
    ) -> tuple[FeatureBatch, list[SkippedKey]]:
        """`batch`'s raw bytes as features at `cut`, and the keys left out under `skip`.

        Raises:
            HapiError: a corrupt object under `on_error="raise"`, naming the key.
        """
        decoded, skipped = self.decoder(batch, epoch)
        if cut <= INPUT or not len(decoded):
            return decoded, skipped
        head = self._head(cut)
        with torch.inference_mode(), TRACING.shared():
            x = decoded.features.to(self.device)  # type: ignore[union-attr]
            y = _per_sample(head, x) if self.exact else head(x)
            y = round_trip(y, self.wire_dtype)  # type: ignore[arg-type]
        # Outside inference mode: a clone is an ordinary tensor, which the tail's autograd
        # may save for its backward pass.
        features = y.to("cpu").clone()
        return FeatureBatch(decoded.keys, decoded.labels, features=features), skipped

    def _head(self, cut: int) -> nn.Module:
        with self._lock:
            if cut not in self._heads:
                # Eval mode touches only modules before the cut: frozen, in eval already.
                self._heads[cut] = self.head(cut).eval()
            return self._heads[cut]


def _per_sample(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # Slices as the server's exact sessions take them, so the kernels see the same tensors.
    return torch.cat([module(x[i : i + 1]) for i in range(len(x))])
