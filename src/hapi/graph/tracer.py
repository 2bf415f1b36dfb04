"""Tracing a model with torch.fx, recording which modules each node ran inside."""

from __future__ import annotations

from typing import Any

from torch import fx, nn

__all__ = ["ScopeTracer", "is_container", "trace_scoped"]


def _leaf_types() -> tuple[type, ...]:
    # Modules whose forward branches on `self.training` stay leaves, so the traced tail
    # keeps their training behaviour instead of baking in the mode seen while tracing.
    types: list[type] = []
    try:
        from torchvision.ops import StochasticDepth

        types.append(StochasticDepth)
    except ImportError:  # pragma: no cover - torchvision is a dependency
        pass
    return tuple(types)


class ScopeTracer(fx.Tracer):
    """An fx tracer that stores in `node.meta["scopes"]` the module calls a node ran inside.

    The scopes are qualified names from the outermost to the innermost module, e.g.
    `("layer1", "layer1.0", "layer1.0.relu")` for the ReLU of ResNet's first block.
    """

    def __init__(self) -> None:
        super().__init__()
        self._stack: list[str] = []
        self._leaves = _leaf_types()

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, self._leaves) or super().is_leaf_module(m, module_qualified_name)

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


def trace_scoped(model: nn.Module) -> fx.GraphModule:
    """Trace `model` into a GraphModule whose nodes carry their module scopes.

    Raises:
        Exception: whatever torch.fx raises for a model it cannot trace.
    """
    tracer = ScopeTracer()
    graph = tracer.trace(model)
    return fx.GraphModule(tracer.root, graph, type(model).__name__)


def is_container(module: nn.Module) -> bool:
    """Plain containers group blocks; their children are the blocks (not their subclasses)."""
    return type(module) in (nn.Sequential, nn.ModuleList, nn.ModuleDict)
