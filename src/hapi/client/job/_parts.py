"""`ModelParts`: a job's model as the trainer runs it - a tail per cut, frozen segments.

A plan may change its cut mid-epoch, so the trainer holds the tail from every cut it has
met, and the frozen segments that carry features from one cut to a later one. They all
share the model's modules: training any tail trains the model.
"""

from __future__ import annotations

import torch
from torch import nn

from hapi._fx_lock import TRACING
from hapi.graph import INPUT, ModelGraph

__all__ = ["ModelParts"]


class ModelParts:
    """Tails and frozen segments of a traced model, built once per cut.

    Args:
        graph: the model, traced.
        freeze: the freeze point: the head up to it is frozen (no gradients, eval mode).
        device: where the trainer runs them.
        exact: run the frozen segments per sample, as an exact job's server runs its head.
    """

    def __init__(
        self, graph: ModelGraph, freeze: int, device: torch.device, *, exact: bool = False
    ) -> None:
        self.graph, self.freeze, self.device, self.exact = graph, freeze, device, exact
        self.frozen = list(graph.head(freeze).modules()) if freeze > INPUT else []
        """The frozen part's modules."""
        for module in self.frozen:
            for p in module.parameters(recurse=False):
                p.requires_grad_(False)
        self._tails: dict[int, nn.Module] = {}
        self._segments: dict[tuple[int, int], nn.Module] = {}
        self._training = False

    def tail(self, cut: int) -> nn.Module:
        """The module from the activation at `cut` to the output."""
        if cut not in self._tails:
            tail = self.graph.tail(cut).to(self.device)
            # Only the root's flag: the model's modules are in their modes already, and a
            # frozen one may be running in the local worker at this moment (in eval mode).
            tail.training = self._training
            self._tails[cut] = tail
        return self._tails[cut]

    def trainable(self) -> list[nn.Parameter]:
        """The parameters after the freeze point that are not frozen."""
        return [p for p in self.tail(self.freeze).parameters() if p.requires_grad]

    def convert(self, features: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Carry features from cut `start` to `end` through the frozen layers between."""
        if (start, end) not in self._segments:
            self._segments[(start, end)] = self.graph.segment(start, end).to(self.device)
        segment = self._segments[(start, end)]
        x = features.to(self.device, torch.float32)
        with torch.no_grad(), TRACING.shared():
            if self.exact and len(x) > 1:
                out = torch.cat([segment(x[i : i + 1]) for i in range(len(x))])
            else:
                out = segment(x)
        return out.to("cpu")

    def train(self, mode: bool, cut: int) -> None:
        """Put the tails in train (or eval) mode, the tail from `cut` included; the frozen
        part stays in eval mode, as on the server: batch norm keeps its pre-trained
        statistics and dropout is off there."""
        self._training = mode
        self.tail(cut)
        for tail in self._tails.values():
            tail.train(mode)
        for module in self.frozen:
            module.eval()
