"""An optional dependency, imported with an error that names the fix when it is missing
or too old (`hapi[lightning]`, `hapi[hf]`)."""

from __future__ import annotations

import importlib
from types import ModuleType

from hapi.errors import InvalidRequest

__all__ = ["framework"]


def framework(
    name: str, *, minimum: tuple[int, int], user: str, extra: str, why: str = ""
) -> ModuleType:
    """The module `name`, at least version `minimum`, for the module `user`.

    Raises:
        InvalidRequest: not installed (install `hapi[extra]`), or older than `minimum`.
    """
    try:
        module = importlib.import_module(name)
    except ImportError:
        raise InvalidRequest(f"{user} needs {name}: pip install 'hapi[{extra}]'") from None
    found = str(module.__version__)
    version = tuple(int(p) for p in found.split(".")[:2] if p.isdigit())
    if version < minimum:
        raise InvalidRequest(
            f"{user} needs {name} >= {'.'.join(map(str, minimum))}{why}, found {found}: "
            f"pip install -U {name}"
        )
    return module
