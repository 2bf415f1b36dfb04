"""The job's options as a command line and a job file see them: one `Flag` for each flat
keyword of `JobConfig`'s parts that text can give (a bool, a number, a word), with the help
its field's docstring gives - so `hapi train`'s flags and TOML keys follow the config tree."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
import textwrap
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hapi.client.config.job import PARTS, flat_names
from hapi.errors import InvalidRequest
from hapi.graph import Cut

__all__ = ["Flag", "job_flags", "nested_options"]


@dataclass(frozen=True)
class Flag:
    """One job option as text gives it."""

    name: str
    """Its flat keyword (`cache_dir`): the flag `--cache-dir`, the TOML key `cache_dir`."""
    part: str
    """The part of `JobConfig` it belongs to (`cache`)."""
    field: str
    """Its field in that part (`dir`)."""
    kind: type
    """What text gives for it: bool, int, float or str."""
    help: str
    """The first sentence of the field's docstring."""
    default: Any


@functools.cache
def job_flags() -> tuple[Flag, ...]:
    """Every option of `JobConfig`'s parts that a command line can give, in the parts'
    order. Options of other types (transforms, store options, a replan config) are the
    Python API's alone."""
    flags = []
    for part, config in PARTS.items():
        hints = typing.get_type_hints(config)
        docs = field_docs(config)
        names = flat_names(part)
        for f in dataclasses.fields(config):
            kind = _text_kind(hints[f.name])
            if kind is not None:
                flags.append(
                    Flag(names[f.name], part, f.name, kind, docs.get(f.name, ""), f.default)
                )
    return tuple(flags)


def nested_options(table: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A job file's `[part]` table (`[cache]` with `dir = ...`) as flat keywords
    (`cache_dir`).

    Raises:
        InvalidRequest: a key that is no field of the part, naming them.
    """
    flat: dict[str, Any] = {}
    for part, values in table.items():
        names = flat_names(part)
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise InvalidRequest(
                f"{where} has unknown key(s) {', '.join(unknown)} in [{part}]: its keys are "
                f"{', '.join(names)}"
            )
        flat.update({names[name]: value for name, value in values.items()})
    return flat


def field_docs(config: type) -> dict[str, str]:
    """The first sentence of each field's docstring (the string after its line)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(config)))
    body = tree.body[0].body if isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            text = " ".join(after.value.value.split())
            docs[node.target.id] = text.split(". ")[0].rstrip(".") + "."
    return docs


def _text_kind(hint: Any) -> type | None:
    """What a command line gives for a field of type `hint`: a bool for a bool (or a bool
    or a config), a number for a number, text for words, names and sizes; None for a type
    text cannot give."""
    args = (
        typing.get_args(hint)
        if typing.get_origin(hint) in (typing.Union, types.UnionType)
        else (hint,)
    )
    kinds = set()
    for arg in args:
        if arg is type(None):
            continue
        if typing.get_origin(arg) is typing.Literal:
            kinds.add(str)
        elif arg in (bool, int, float, str):
            kinds.add(arg)
        elif arg is Cut:
            kinds.add(str)
        elif dataclasses.is_dataclass(arg) and bool in args:
            continue  # replan: True, False or a ReplanConfig - the flag gives the bool
        else:
            return None
    if len(kinds) == 1:
        return kinds.pop()
    return str if kinds and kinds <= {int, str} else None
