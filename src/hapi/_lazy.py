"""Lazy exports for package `__init__`s: names load on first use.

Importing torch takes seconds, so `hapi --help`, the CLI's error paths and the server's
configuration must not import it; a package's `__init__` names where each export lives
and this module loads it when first asked for.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, namespace: dict[str, Any], where: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module `__getattr__` and `__dir__` of `package`.

    Args:
        package: the package's `__name__`.
        namespace: the package's `globals()`; a loaded name is cached there, so later
            lookups skip `__getattr__`.
        where: exported name -> the module defining it (absolute, or relative to `package`
            when it starts with a dot).
    """

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(where)

    return __getattr__, __dir__
