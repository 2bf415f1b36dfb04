"""Splitting a traced graph at a cut point into a head and a tail `GraphModule`."""

from __future__ import annotations

from collections.abc import Callable

from torch import fx

from hapi.graph._cuts import is_batch_size, shared_values
from hapi.graph.layout import standard_layout

__all__ = ["split"]


def split(gm: fx.GraphModule, at: fx.Node, *, head: bool) -> fx.GraphModule:
    """A GraphModule with the nodes up to `at` (head) or the ones after it (tail).

    The head returns its activation in standard layout (`hapi.graph.layout`).

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
            x = env[n] = graph.placeholder("x")
            for m in again:
                # A batch size reads its tensor's first dimension: the activation's will do.
                env[m] = graph.node_copy(m, _to(x) if is_batch_size(m) else env.__getitem__)
            before = False
    return _module(gm, graph, "Tail")


def _to(x: fx.Node) -> Callable[[fx.Node], fx.Node]:
    return lambda _: x


def _module(gm: fx.GraphModule, graph: fx.Graph, side: str) -> fx.GraphModule:
    part = fx.GraphModule(gm, graph, f"{gm.__class__.__name__}{side}")
    # Drop what only the other side reads, so a head holds only the modules it runs.
    part.graph.eliminate_dead_code()
    part.delete_all_unused_submodules()
    part.recompile()
    return part
