"""References to model versions, as users write them.

- `name`: the newest version of `name`;
- `name@3`: version 3 of `name` (all digits: a version number);
- `name@9f2c1e`: the version of `name` whose id starts with `9f2c1e` (4+ hex digits);
- a full 64-digit id, or a unique id prefix of 8+ digits;
- any of these after `repo://` (`repo://resnet50-flowers@2`), the form sessions use.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hapi.errors import InvalidRequest, RefNotFound

__all__ = ["SCHEME", "Ref", "check_name", "is_repo_ref", "parse_ref"]

SCHEME = "repo://"

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_HEX = re.compile(r"[0-9a-f]+")


@dataclass(frozen=True)
class Ref:
    """A parsed reference: a name with an optional version or id prefix, or an id prefix."""

    text: str
    """What the user wrote."""
    name: str | None = None
    """The model name, when the reference has one."""
    version: int | None = None
    """`name@<n>`."""
    id_prefix: str | None = None
    """`name@<hex>`, or a bare id (prefix)."""


def check_name(name: str) -> str:
    """Return `name` if it can name a model.

    Raises:
        InvalidRequest: it is empty, too long, or has characters other than letters,
            digits, `.`, `_` and `-` (a name is one segment of a store key).
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidRequest(
            f"invalid model name {name!r}: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


def is_repo_ref(text: str) -> bool:
    """Whether a model given as text names a repository version (`repo://x`, `x@3`)
    rather than a model of the zoo (`resnet18`)."""
    return text.startswith(SCHEME) or "@" in text


def parse_ref(text: str) -> Ref:
    """Parse a reference (see the module docstring).

    Raises:
        RefNotFound: it is not a reference in any of the accepted forms.
    """
    if not isinstance(text, str):
        raise RefNotFound(f"a model reference is a string like 'resnet50@2', got {text!r}")
    body = text.removeprefix(SCHEME).strip()
    name, at, suffix = body.partition("@")
    if at:
        if not _NAME.fullmatch(name) or not suffix:
            raise RefNotFound(_bad(text))
        if suffix.isdigit():
            # Digits are a version number, and from four on may also be an id prefix
            # (one id in ~16 starts with six digits): the repository tries the version first.
            id_prefix = suffix if len(suffix) >= 4 else None
            return Ref(text, name=name, version=int(suffix), id_prefix=id_prefix)
        if len(suffix) >= 4 and _HEX.fullmatch(suffix):
            return Ref(text, name=name, id_prefix=suffix)
        raise RefNotFound(_bad(text))
    if _NAME.fullmatch(body):
        # A bare word may be a name or an id prefix; the repository tries the name first.
        id_prefix = body if len(body) >= 8 and _HEX.fullmatch(body) else None
        return Ref(text, name=body, id_prefix=id_prefix)
    raise RefNotFound(_bad(text))


def _bad(text: str) -> str:
    return (
        f"invalid model reference {text!r}: use NAME, NAME@VERSION, NAME@ID-PREFIX, "
        "an id, or repo://NAME[@VERSION]"
    )
