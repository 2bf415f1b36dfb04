"""Tracing a model with torch.fx, recording which modules each node ran inside."""

from __future__ import annotations

import inspect
from typing import Any

from torch import fx, nn

from hapi.graph._training import reads_training, training_as_graph_input

__all__ = ["ScopeTracer", "is_container", "trace_in_mode", "trace_scoped"]


class ScopeTracer(fx.Tracer):
    """An fx tracer that stores in `node.meta["scopes"]` the module calls a node ran inside.

    The scopes are qualified names from the outermost to the innermost module, e.g.
    `("layer1", "layer1.0", "layer1.0.relu")` for the ReLU of ResNet's first block. A
    module whose forward reads `self.training` is a leaf (see `hapi.graph._training`).
    """

    def __init__(self) -> None:
        super().__init__()
        self._stack: list[str] = []
        self._reads_training: dict[type, bool] = {}

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if super().is_leaf_module(m, module_qualified_name):
            return True
        cls = type(m)
        if cls not in self._reads_training:
            self._reads_training[cls] = reads_training(m)
        return self._reads_training[cls]

    def call_module(
        self, m: nn.Module, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        name = self.path_of_module(m)
        self._stack.append(name)
        try:
            return super().call_module(m, forward, args, kwargs)
        finally:
            self._stack.pop()

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        node = super().create_node(*args, **kwargs)
        node.meta["scopes"] = tuple(self._stack)
        return node


def trace_scoped(model: nn.Module) -> tuple[fx.GraphModule, bool]:
    """Trace `model` into a GraphModule whose nodes carry their module scopes.

    The forward's first argument is the input; the others keep their defaults (an
    optional `attn_mask=None` is a constant, not a second input). A model that returns a
    tuple or a dict computes its first element or its `logits` in the graph.

    Returns:
        The graph module, and whether the root's forward branches on `self.training` in
        Python: then the graph is the one of the root's current mode, and
        `trace_in_mode` gives the other.

    Raises:
        Exception: whatever torch.fx raises for a model it cannot trace.
    """
    tracer = ScopeTracer()
    try:
        with training_as_graph_input(model, tracer):
            graph = tracer.trace(model, concrete_args=_defaults_after_first(model))
    except Exception:
        # Traced again with `training` a constant: when that fails too, its error is the
        # one that says what torch.fx cannot follow.
        return trace_in_mode(model, model.training), True
    return _finish(model, tracer, graph), False


def trace_in_mode(model: nn.Module, training: bool) -> fx.GraphModule:
    """Trace `model` with its root's `self.training` a constant, `training`: the graph of
    one mode of a root whose forward branches on it in Python. Only the root's flag is
    set while tracing: a submodule that reads its own is a leaf (see `ScopeTracer`)."""
    tracer = ScopeTracer()
    was = model.training
    model.training = training
    try:
        graph = tracer.trace(model, concrete_args=_defaults_after_first(model))
    finally:
        model.training = was
    return _finish(model, tracer, graph)


def _finish(model: nn.Module, tracer: ScopeTracer, graph: fx.Graph) -> fx.GraphModule:
    _drop_constant_inputs(graph)
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    _one_output(gm)
    return gm


def _defaults_after_first(model: nn.Module) -> dict[str, Any]:
    params = list(inspect.signature(type(model).forward).parameters.values())[2:]
    return {
        p.name: p.default
        for p in params
        if p.default is not inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }


def _drop_constant_inputs(graph: fx.Graph) -> None:
    # fx keeps a placeholder per concrete argument, read only by checks that it has its
    # traced value; the head and tail take the input alone.
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for ph in placeholders[1:]:
        reached: list[fx.Node] = []
        frontier = [ph]
        while frontier:
            n = frontier.pop()
            reached.append(n)
            frontier.extend(n.users)
        erased = True
        while erased:
            erased = False
            for n in reached:
                if not n.users and n.op != "output":
                    graph.erase_node(n)
                    reached.remove(n)
                    erased = True
                    break


def _one_output(gm: fx.GraphModule) -> None:
    # The output tensor a model stands for, as `hapi.graph.model_output` picks it: a dict's
    # `logits`, or a tuple's first element. What only the rest needed is dropped.
    output = next(n for n in gm.graph.nodes if n.op == "output")
    value = output.args[0]
    value = _named_tuple_fields(value) or value
    if isinstance(value, dict) and isinstance(value.get("logits"), fx.Node):
        picked = value["logits"]
    elif isinstance(value, (tuple, list)) and value and isinstance(value[0], fx.Node):
        picked = value[0]
    else:
        return
    output.args = (picked,)
    gm.graph.eliminate_dead_code()
    gm.delete_all_unused_submodules()
    gm.recompile()


def _named_tuple_fields(value: object) -> tuple[object, ...] | None:
    """The fields of a namedtuple the graph constructs, or None for another value.

    torch.fx records a namedtuple's construction as a call (GoogLeNet's outputs with its
    auxiliary heads, in train mode): its fields are the call's arguments.
    """
    if not (
        isinstance(value, fx.Node)
        and value.op == "call_function"
        and isinstance(value.target, type)
        and issubclass(value.target, tuple)
    ):
        return None
    fields = getattr(value.target, "_fields", ())
    return tuple(value.args) or tuple(value.kwargs[f] for f in fields if f in value.kwargs)


def is_container(module: nn.Module) -> bool:
    """Plain containers group blocks; their children are the blocks (not their subclasses)."""
    return type(module) in (nn.Sequential, nn.ModuleList, nn.ModuleDict)
