"""Finding the cut points of a traced, shape-propagated graph.

A node is a *candidate* when exactly one value flows across it: of the values defined at
or before it (the input placeholder included), the only one used after it is its own, and
that value is a tensor. Two kinds of value never count as flowing:

- parameters, buffers and constants (`get_attr` nodes): both sides read them from the
  shared modules, so each belongs to the side that uses it;
- `x.size(0)`, the batch size: the tail reads it off the activation it receives.

Candidates are then collapsed to *block* boundaries, so that a ResNet has one cut per
residual block rather than one per ReLU. A candidate is kept when it is the last node of
a block's call, a block being a child of the model or of a plain container
(`nn.Sequential`, `nn.ModuleList`, `nn.ModuleDict`) at any depth, or when it is a
functional step at the model's top level (`torch.flatten` in a ResNet, `add` in a user's
forward). The cut is named after the outermost block that ends there; the inner ones are
its aliases (`layer1` and `layer1.1` end at the same node). Since the graph's output is
always a candidate and runs at the top level, the last cut point is the model's output
when the model returns one tensor.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import TensorMetadata

from hapi.graph.cut_point import CutPoint
from hapi.graph.tracer import is_container

__all__ = ["Cuts", "find_cuts", "is_batch_size"]


@dataclass(frozen=True)
class Cuts:
    """The cut points of a graph and where they are in it."""

    points: tuple[CutPoint, ...]
    """The cut points, index k at position k-1."""
    nodes: tuple[fx.Node, ...]
    """The node each cut point follows."""
    param_cut: dict[str, int]
    """Qualified parameter name -> the first cut whose head uses it (n+1: tail only)."""


def find_cuts(model: nn.Module, gm: fx.GraphModule) -> Cuts:
    """The cut points of `gm`, a scoped trace of `model` that `ShapeProp` has run over."""
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    last_use = {n: max((order[u] for u in n.users), default=-1) for n in nodes}
    ends = _block_ends(model, nodes)
    live: set[fx.Node] = set()
    points: list[CutPoint] = []
    cut_nodes: list[fx.Node] = []
    for n in nodes:
        if n.op == "output":
            break
        if n.op != "get_attr" and not is_batch_size(n):
            live.add(n)
        live = {v for v in live if last_use[v] > order[n]}
        if n.op in ("placeholder", "get_attr") or live != {n}:
            continue
        meta = n.meta.get("tensor_meta")
        if not isinstance(meta, TensorMetadata):
            continue
        if n not in ends and n.meta.get("scopes"):
            continue
        names = sorted(ends.get(n, []), key=lambda s: (s.count("."), s)) or [n.name]
        points.append(CutPoint(len(points) + 1, names[0], tuple(meta.shape[1:]), tuple(names[1:])))
        cut_nodes.append(n)

    param_cut = _param_cuts(model, gm, nodes, [order[n] for n in cut_nodes])
    totals = [0] * (len(points) + 2)
    numels = dict(model.named_parameters())
    for name, cut in param_cut.items():
        totals[cut] += numels[name].numel()
    running = 0
    for i, p in enumerate(points):
        running += totals[i + 1]
        points[i] = CutPoint(p.index, p.name, p.shape, p.aliases, running)
    return Cuts(tuple(points), tuple(cut_nodes), param_cut)


def is_batch_size(n: fx.Node) -> bool:
    """`x.size(0)`: the batch size, which the tail can read off its own input."""
    if n.op != "call_method" or n.target != "size":
        return False
    dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    return isinstance(dim, int) and dim == 0


def _block_ends(model: nn.Module, nodes: list[fx.Node]) -> dict[fx.Node, list[str]]:
    """The last node of each block's call -> the names of the blocks that end there."""
    scope_end: dict[str, fx.Node] = {}
    for n in nodes:
        for scope in n.meta.get("scopes", ()):
            scope_end[scope] = n
    ends: dict[fx.Node, list[str]] = {}
    for scope, n in scope_end.items():
        parent = scope.rpartition(".")[0]
        if parent == "" or is_container(model.get_submodule(parent)):
            ends.setdefault(n, []).append(scope)
    return ends


def _param_cuts(
    model: nn.Module, gm: fx.GraphModule, nodes: list[fx.Node], cut_positions: list[int]
) -> dict[str, int]:
    """Each parameter's first cut: the first cut point at or after the node that reads it."""
    names = {id(p): name for name, p in model.named_parameters()}
    first: dict[str, int] = {}
    for pos, n in enumerate(nodes):
        for p in _params_read(gm, n):
            name = names.get(id(p))
            if name is not None and name not in first:
                first[name] = pos
    # bisect_left: a parameter read by the cut node itself belongs to that cut's head.
    return {name: bisect.bisect_left(cut_positions, pos) + 1 for name, pos in first.items()}


def _params_read(gm: fx.GraphModule, n: fx.Node) -> list[torch.Tensor]:
    # A get_attr node is read where its users run, which may be on either side of a cut.
    if n.op == "call_module":
        return list(gm.get_submodule(str(n.target)).parameters())
    read: list[torch.Tensor] = []
    for arg in n.all_input_nodes:
        if arg.op == "get_attr":
            value = _fetch(gm, str(arg.target))
            if isinstance(value, nn.Parameter):
                read.append(value)
    return read


def _fetch(gm: fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value
