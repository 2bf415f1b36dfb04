"""Typed reads of a stored manifest's JSON: a manifest in the store is input like any other.

A manifest's digest proves only that it was not altered after it was written, not that
whoever wrote it was hapi: a crafted one hashes correctly too. So every field is checked
for its type, and the ones that become store keys (content hashes) for their exact form,
before anything uses them; a violation is a `ValueError` that `from_json` reports as a
malformed manifest.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from reprlib import Repr
from typing import Any

__all__ = ["check_tensor_key", "digest", "mapping", "optional", "required", "strings"]

_MISSING: Any = object()
_DIGEST = re.compile(r"[0-9a-f]{64}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_short = Repr()
_short.maxstring = _short.maxother = 60
_short.maxlist = _short.maxdict = 4


def _shown(value: Any) -> str:
    return _short.repr(value)


def _kinds(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {
        str: "a string",
        int: "an integer",
        float: "a number",
        list: "a list",
        dict: "an object",
    }
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _is(value: Any, kind: type | tuple[type, ...]) -> bool:
    # JSON's true/false arrive as bool, which Python counts as an int: not a number here.
    return isinstance(value, kind) and not isinstance(value, bool)


def mapping(value: Any, what: str) -> Mapping[str, Any]:
    """`value` if it is a JSON object, else a ValueError naming `what`."""
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be an object, got {_shown(value)}")
    return value


def required(data: Mapping[str, Any], name: str, kind: type | tuple[type, ...], what: str) -> Any:
    """`data[name]`, which must be present and of `kind`."""
    if name not in data:
        raise ValueError(f"{what} has no {name!r}")
    return optional(data, name, kind, what, default=_MISSING)


def optional(
    data: Mapping[str, Any],
    name: str,
    kind: type | tuple[type, ...],
    what: str,
    *,
    default: Any = None,
) -> Any:
    """`data[name]` of `kind`; `default` when absent or null (null is accepted only then)."""
    value = data.get(name)
    if value is None and default is not _MISSING:
        return default
    if not _is(value, kind):
        raise ValueError(f"{name!r} of {what} must be {_kinds(kind)}, got {_shown(value)}")
    return value


def strings(values: list[Any], what: str) -> tuple[str, ...]:
    """A list of strings as a tuple."""
    for v in values:
        if not isinstance(v, str):
            raise ValueError(f"{what} must hold only strings, got {_shown(v)}")
    return tuple(values)


def digest(value: Any, what: str) -> str:
    """A SHA-256 in lowercase hex: content hashes and manifest ids name store keys, so
    nothing else may pass (a `..` or a `/` would reach outside the repository's prefix)."""
    if not isinstance(value, str) or not _DIGEST.fullmatch(value):
        raise ValueError(
            f"{what} must be a SHA-256 in 64 lowercase hex digits, got {_shown(value)}"
        )
    return value


def check_tensor_key(key: Any) -> str:
    """A state-dict key as `nn.Module.state_dict` makes them: non-empty `.`-separated parts
    (so no `..`), no leading `/`, no control characters.

    Raises:
        ValueError: `key` is not such a string (the message says why).
    """
    if (
        not isinstance(key, str)
        or any(not part for part in key.split("."))
        or key.startswith("/")
        or _CONTROL.search(key)
    ):
        raise ValueError(
            f"invalid tensor key {_shown(key)}: a state-dict key is a string of non-empty "
            "'.'-separated parts (no '..'), not starting with '/', without control characters"
        )
    return key
