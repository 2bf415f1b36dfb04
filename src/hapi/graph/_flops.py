"""Forward FLOPs of each head: what the server computes per sample at each cut."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.utils.flop_counter import FlopCounterMode

from hapi.graph.model_graph import ModelGraph

__all__ = ["head_flops"]


def head_flops(graph: ModelGraph, x: torch.Tensor) -> list[int]:
    """FLOPs of the head up to each cut 0..n for the batch `x` (torch's FlopCounterMode:
    matrix products and convolutions, counted as 2 per multiply-add)."""
    modes = {m: m.training for m in graph.model.modules()}
    graph.model.eval()
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            totals = _run(graph, x, counter)
    finally:
        for m, mode in modes.items():
            m.training = mode
    return [0, *totals]


def _run(graph: ModelGraph, x: torch.Tensor, counter: FlopCounterMode) -> list[int]:
    gm, nodes = graph._traced_graph()
    if gm is None:
        totals = []
        for child in list(graph.model.children())[: graph.num_cuts]:
            x = child(x)
            totals.append(counter.get_total_flops())
        return totals
    return _Counting(gm, set(nodes), counter).totals(x)


class _Counting(fx.Interpreter):
    """Runs a graph and notes the FLOPs counted so far after each cut node."""

    def __init__(self, gm: fx.GraphModule, cuts: set[fx.Node], counter: FlopCounterMode):
        super().__init__(gm)
        self.cuts = cuts
        self.counter = counter
        self.seen: list[int] = []

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if n in self.cuts:
            self.seen.append(self.counter.get_total_flops())
        return result

    def totals(self, x: torch.Tensor) -> list[int]:
        self.run(x)
        return self.seen
