"""A command whose flags are its own options and then the job's, generated from the config
tree (`hapi.client.config.flags`): `hapi train` and `hapi plan` declare none of them again."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection
from typing import Any

import typer

__all__ = ["Own", "job_command", "job_options"]

Own = tuple[str, type, Any]
"""A command's own option: its name, its type and its `typer.Option` or `typer.Argument`."""

_ENVVARS = {"token": "HAPI_TOKEN"}


def job_command(
    run: Callable[..., None], own: list[Own], *, skip: Collection[str] = ()
) -> Callable[..., None]:
    """`run` with a signature typer reads: `own`, then a flag for every job option but those
    in `skip` (`--cut`, `--cache-dir`, `--wire-compression`...), with its field's help and
    default. Each flag left unset reaches `run` as None."""
    from hapi.client.config.flags import job_flags

    params = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=kind)
        for name, kind, default in own
    ]
    for flag in job_flags():
        if flag.name in skip:
            continue
        shown = "" if flag.default is None else f" Default: {_shown(flag.default)}."
        option = typer.Option(
            None, help=flag.help + shown, envvar=_ENVVARS.get(flag.name), rich_help_panel="Job"
        )
        params.append(
            inspect.Parameter(
                flag.name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=flag.kind
            )
        )

    def command(**given: Any) -> None:
        run(**given)

    command.__doc__ = run.__doc__
    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}
    return command


def job_options(given: dict[str, Any]) -> dict[str, Any]:
    """The job options set among a command's `given` options."""
    from hapi.client.config.flags import job_flags

    names = {flag.name for flag in job_flags()}
    return {k: v for k, v in given.items() if k in names and v is not None}


def _shown(default: Any) -> str:
    if isinstance(default, bool):
        return "yes" if default else "no"
    return str(default)
