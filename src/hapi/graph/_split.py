"""Splitting a traced graph at a cut point into a head and a tail `GraphModule`."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import fx

from hapi.graph._cuts import is_batch_size, sample_shape, sample_strides, shared_values
from hapi.graph.strides import (
    dense_sample_strides,
    standard_layout,
    standard_strides,
    with_sample_strides,
)

__all__ = ["split"]


def split(gm: fx.GraphModule, at: fx.Node, *, head: bool) -> fx.GraphModule:
    """A GraphModule with the nodes up to `at` (head) or the ones after it (tail).

    The head returns its activation in standard layout; the tail lays it out again as the
    model had it (`hapi.graph.strides`), and copies it first if it would write into it.

    Both share `gm`'s submodules, parameters and buffers, which are the model's own. The
    tail computes again what the head computed from the batch size and constants alone
    (`hapi.graph._cuts.shared_values`), reading the batch size off its input.
    """
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    if head:
        for n in gm.graph.nodes:
            env[n] = graph.node_copy(n, lambda a: env[a])
            if n is at:
                # The wire and the tail get standard strides whatever the model left.
                out = graph.call_function(standard_layout, (env[n],))
                out.meta = dict(env[n].meta)
                graph.output(out)
                break
        return _module(gm, graph, "Head")
    nodes = list(gm.graph.nodes)
    shared = shared_values(gm, nodes)
    again: list[fx.Node] = []
    before = True
    for n in nodes:
        if not before or n.op == "get_attr":
            env[n] = graph.node_copy(n, env.__getitem__)
        elif n in shared:
            again.append(n)
        if n is at:
            x = graph.placeholder("x")
            env[n] = _entry(gm, graph, x, at)
            for m in again:
                # A batch size reads its tensor's first dimension: the activation's will do.
                env[m] = graph.node_copy(m, _to(x) if is_batch_size(m) else env.__getitem__)
            before = False
    return _module(gm, graph, "Tail")


def _entry(gm: fx.GraphModule, graph: fx.Graph, x: fx.Node, at: fx.Node) -> fx.Node:
    """The tail's input as the model had it: laid out as traced, and never changed."""
    entry = x
    shape, strides = sample_shape(at), sample_strides(at)
    if (
        shape is not None
        and strides is not None
        and strides != standard_strides(shape)
        and dense_sample_strides(shape, strides)
    ):
        entry = graph.call_function(with_sample_strides, (entry, strides))
    if any(_writes(gm, n) for n in _after(at)):
        # The caller's batch stays as it was (a loader may keep it, a test compares it).
        # Any in-place step may reach it: an identity or an eval-mode dropout passes the
        # input itself on, and a view shares its memory.
        entry = graph.call_function(torch.clone, (entry,))
    return entry


def _after(at: fx.Node) -> list[fx.Node]:
    nodes: list[fx.Node] = []
    n = at.next
    while n.op != "output" and n is not at:
        nodes.append(n)
        n = n.next
    return nodes


def _writes(gm: fx.GraphModule, user: fx.Node) -> bool:
    """Whether `user` may write in place into an activation (not into a buffer)."""
    target = user.target
    if isinstance(target, torch._ops.OpOverload):
        return any(
            arg.alias_info is not None
            and arg.alias_info.is_write
            and isinstance(given, fx.Node)
            and given.op != "get_attr"
            for arg, given in zip(target._schema.arguments, user.args, strict=False)
        )
    if not user.args or not isinstance(user.args[0], fx.Node) or user.args[0].op == "get_attr":
        return False  # modules, functions and methods write into their first argument
    if user.op == "call_module":
        return getattr(gm.get_submodule(str(target)), "inplace", False) is True
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    inplace_operator = name in ("iadd", "isub", "imul", "itruediv", "ipow", "iand", "ior")
    return name.endswith("_") or inplace_operator or user.kwargs.get("inplace") is True


def _to(x: fx.Node) -> Callable[[fx.Node], fx.Node]:
    return lambda _: x


def _module(gm: fx.GraphModule, graph: fx.Graph, side: str) -> fx.GraphModule:
    part = fx.GraphModule(gm, graph, f"{gm.__class__.__name__}{side}")
    # Drop what only the other side reads, so a head holds only the modules it runs.
    part.graph.eliminate_dead_code()
    part.delete_all_unused_submodules()
    part.recompile()
    return part
