"""Finding the cut points of a traced graph (torch.fx's, or torch.export's made into one).

A node is a candidate when exactly one tensor value flows across it (parameters, the
batch size and what is computed from those alone do not count: `shared_values`).
Candidates are collapsed to block boundaries - the last node of a child block of the model
or of a plain container, or a functional step at the top level - and named after the
outermost block that ends there (`layer1`) or the module before a step and its operation
(`avgpool+flatten`). The rules in full: docs/graph.md, "Cut points".
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import TensorMetadata

from hapi.graph._module_tracer import is_container
from hapi.graph.cut_point import CutPoint

__all__ = [
    "Cuts",
    "find_cuts",
    "is_batch_size",
    "keep_cuts",
    "sample_shape",
    "sample_strides",
    "shared_values",
]

_RANDOM = re.compile(r"rand|bernoulli|normal|dropout|uniform|multinomial|poisson|exponential")


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
    """The cut points of `gm`, a scoped graph of `model` with shapes in its nodes' meta."""
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    last_use = {n: max((order[u] for u in n.users), default=-1) for n in nodes}
    shared = shared_values(gm, nodes)
    ends = _block_ends(model, nodes)
    live: set[fx.Node] = set()
    points: list[CutPoint] = []
    cut_nodes: list[fx.Node] = []
    used: set[str] = set()
    anchor = "input"
    for n in nodes:
        if n.op == "output":
            break
        scopes = n.meta.get("scopes", ())
        if n not in shared:
            live.add(n)
        live = {v for v in live if last_use[v] > order[n]}
        candidate = n.op != "placeholder" and n not in shared and live == {n}
        shape = sample_shape(n) if candidate else None
        if shape is not None and (n in ends or not scopes):
            if n in ends:
                names = sorted(ends[n], key=lambda s: (s.count("."), s))
            else:
                names = [_step_name(anchor, n, used), n.name]
            used.add(names[0])
            aliases = tuple(a for a in names[1:] if a != names[0])
            points.append(CutPoint(len(points) + 1, names[0], shape, aliases))
            cut_nodes.append(n)
        if scopes:
            anchor = scopes[0]
    return keep_cuts(model, gm, points, cut_nodes)


def keep_cuts(
    model: nn.Module, gm: fx.GraphModule, points: list[CutPoint], cut_nodes: list[fx.Node]
) -> Cuts:
    """The cuts of `gm` at `cut_nodes` only (a subset of its cut points, in graph order),
    numbered again from 1, with each parameter's first cut and each head's parameters."""
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    param_cut = _param_cuts(model, gm, nodes, [order[n] for n in cut_nodes])
    totals = [0] * (len(points) + 2)
    numels = dict(model.named_parameters())
    for name, cut in param_cut.items():
        totals[cut] += numels[name].numel()
    running = 0
    kept: list[CutPoint] = []
    for i, p in enumerate(points):
        running += totals[i + 1]
        kept.append(CutPoint(i + 1, p.name, p.shape, p.aliases, running))
    return Cuts(tuple(kept), tuple(cut_nodes), param_cut)


def is_batch_size(n: fx.Node) -> bool:
    """`x.size(0)`: the batch size, which the tail can read off its own input."""
    if n.op == "call_method" and n.target == "size":
        dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    elif n.op == "call_function" and n.target is torch.ops.aten.sym_size.int:
        dim = n.args[1]
    else:
        return False
    return isinstance(dim, int) and dim == 0


def shared_values(gm: fx.GraphModule, nodes: list[fx.Node]) -> set[fx.Node]:
    """The nodes whose values never flow across a cut: parameters, buffers and constants,
    batch sizes, and what is computed from them alone without parameters or randomness."""
    shared: set[fx.Node] = set()
    for n in nodes:
        derived = (
            n.op in ("call_function", "call_method")
            and all(a in shared for a in n.all_input_nodes)
            and not any(_is_parameter(gm, a) for a in n.all_input_nodes)
            and not _random_or_mutating(n)
        )
        if derived or n.op == "get_attr" or is_batch_size(n):
            shared.add(n)
    return shared


def sample_shape(n: fx.Node) -> tuple[int, ...] | None:
    """The per-sample shape of a tensor node's value, or None when it is not a tensor."""
    meta = n.meta.get("tensor_meta")
    if isinstance(meta, TensorMetadata):
        return tuple(meta.shape[1:])
    val = n.meta.get("val")
    if isinstance(val, torch.Tensor) and val.dim() >= 1:
        dims = tuple(val.shape[1:])
        if all(isinstance(d, int) for d in dims):
            return tuple(int(d) for d in dims)
    return None


def sample_strides(n: fx.Node) -> tuple[int, ...] | None:
    """The per-sample strides of a tensor node's value as traced, when known."""
    meta = n.meta.get("tensor_meta")
    if isinstance(meta, TensorMetadata):
        return tuple(int(s) for s in meta.stride[1:])
    val = n.meta.get("val")
    if isinstance(val, torch.Tensor) and val.dim() >= 1:
        strides = tuple(val.stride()[1:])
        if all(isinstance(s, int) for s in strides):
            return tuple(int(s) for s in strides)
    return None


def _step_name(anchor: str, n: fx.Node, used: set[str]) -> str:
    if n.op == "call_function":
        packet = getattr(n.target, "overloadpacket", None)
        op = getattr(packet or n.target, "__name__", str(n.target))
    else:
        op = str(n.target)
    name = f"{anchor}+{op}"
    k = 2
    while name in used:
        name = f"{anchor}+{op}#{k}"
        k += 1
    return name


def _is_parameter(gm: fx.GraphModule, n: fx.Node) -> bool:
    return n.op == "get_attr" and isinstance(_fetch(gm, str(n.target)), nn.Parameter)


def _random_or_mutating(n: fx.Node) -> bool:
    # A recomputed value must be the same on both sides and must not change state twice.
    target = n.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    inplace = n.kwargs.get("inplace") is True or "out" in n.kwargs
    return bool(_RANDOM.search(name)) or name.endswith("_") or inplace


def _block_ends(model: nn.Module, nodes: list[fx.Node]) -> dict[fx.Node, list[str]]:
    """The last node of each block's call -> the names of the blocks that end there."""
    scope_end: dict[str, fx.Node] = {}
    # What the output does not need does not end a block (a reshaped copy of a block's
    # output for a ModelOutput field that nobody reads).
    needed: set[fx.Node] = set()
    for n in reversed(nodes):
        computes = n.op in ("call_function", "call_method") and not n.is_impure()
        if not computes or any(u in needed for u in n.users):
            needed.add(n)
    for n in nodes:
        if n not in needed:
            continue
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
