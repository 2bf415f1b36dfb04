"""Keeping a model's training behaviour in its traced graph.

A submodule whose forward reads `self.training` is traced as a leaf (`reads_training`);
the root's own reads become a read of the traced graph's `training` attribute
(`training_as_graph_input`), and a root that branches on it in Python is traced once per
mode (`trace_in_mode`, `hapi.graph._fx_modes`). Why: docs/graph.md, "Keeping a model's
training behaviour in its traced graph".
"""

from __future__ import annotations

import contextlib
import inspect
import types
from collections.abc import Iterator
from typing import Any

from torch import fx, nn

__all__ = ["reads_training", "training_as_graph_input"]

_MAX_DEPTH = 4


def reads_training(module: nn.Module) -> bool:
    """Whether `module`'s forward, or a method of its class that the forward calls, reads
    the attribute `training`."""
    cls = type(module)
    if cls.forward is nn.Module.forward:
        return False
    forward = inspect.unwrap(cls.forward)  # a decorated forward: the function it wraps
    code = getattr(forward, "__code__", None)
    return code is not None and _code_reads(cls, code, set(), 0)


def _code_reads(cls: type, code: types.CodeType, seen: set[types.CodeType], depth: int) -> bool:
    if code in seen or depth > _MAX_DEPTH:
        return False
    seen.add(code)
    if "training" in code.co_names:
        return True
    for const in code.co_consts:  # lambdas, comprehensions, nested functions
        if isinstance(const, types.CodeType) and _code_reads(cls, const, seen, depth + 1):
            return True
    for name in code.co_names:
        method = _own_method(cls, name)
        if method is not None and _code_reads(cls, method.__code__, seen, depth + 1):
            return True
    return False


def _own_method(cls: type, name: str) -> types.FunctionType | None:
    # Methods the model's author wrote, not nn.Module's machinery (`__call__`, `train`).
    for klass in cls.__mro__:
        if klass is nn.Module:
            return None
        value = klass.__dict__.get(name)
        if value is not None:
            return value if isinstance(value, types.FunctionType) else None
    return None


@contextlib.contextmanager
def training_as_graph_input(root: nn.Module, tracer: fx.Tracer) -> Iterator[None]:
    """While tracing `root`, its `self.training` reads give a proxy of the graph's own
    `training` attribute (a `get_attr` node) instead of a constant bool."""
    cls = type(root)
    proxies: list[Any] = []

    def get(self: nn.Module) -> Any:
        if self is not root:
            return self.__dict__["training"]
        if not proxies:
            proxies.append(tracer.create_proxy("get_attr", "training", (), {}))
        return proxies[0]

    def set_(self: nn.Module, value: bool) -> None:
        self.__dict__["training"] = value

    # A subclass made for this trace only: its `training` property wins over the
    # instance attribute. Same name, so the graph module is named as the model is.
    patched = type(cls.__name__, (cls,), {"training": property(get, set_)})
    patched.__module__ = cls.__module__
    patched.__qualname__ = cls.__qualname__
    root.__class__ = patched
    try:
        yield
    finally:
        root.__class__ = cls
