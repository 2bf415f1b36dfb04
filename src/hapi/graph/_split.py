"""Splitting a traced graph at a cut point into a head and a tail `GraphModule`."""

from __future__ import annotations

from torch import fx

from hapi.graph._cuts import is_batch_size

__all__ = ["split"]


def split(gm: fx.GraphModule, at: fx.Node, *, head: bool) -> fx.GraphModule:
    """A GraphModule with the nodes up to `at` (head) or the ones after it (tail).

    Both share `gm`'s submodules, parameters and buffers, which are the model's own.
    """
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    batch_sizes: list[fx.Node] = []
    before = True
    for n in gm.graph.nodes:
        if head:
            env[n] = graph.node_copy(n, lambda a: env[a])
            if n is at:
                graph.output(env[n])
                break
            continue
        if before:
            if n.op == "get_attr":
                env[n] = graph.node_copy(n, lambda a: env[a])
            elif is_batch_size(n):
                batch_sizes.append(n)
            if n is at:
                env[n] = graph.placeholder("x")
                for b in batch_sizes:
                    env[b] = graph.call_method("size", (env[n], 0))
                before = False
            continue
        env[n] = graph.node_copy(n, lambda a: env[a])
    part = fx.GraphModule(gm, graph, f"{gm.__class__.__name__}{'Head' if head else 'Tail'}")
    # Drop what only the other side reads, so a head holds only the modules it runs.
    part.graph.eliminate_dead_code()
    part.delete_all_unused_submodules()
    part.recompile()
    return part
