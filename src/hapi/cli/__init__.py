"""The `hapi` command: a thin shell over the library, one library call per command."""

from __future__ import annotations

import sys

import typer

from hapi._gc import freeze_long_lived

__all__ = ["app", "main"]

app = typer.Typer(
    name="hapi",
    help="Near-data transfer learning: run the frozen front of a model next to the data.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _register() -> None:
    # Each command group lives in its own module and adds itself to `app`, once: tests
    # call main() many times in one process.
    if app.registered_commands:
        return
    from hapi.cli import cache, data, demo, plan, profile, repo, serve, train

    for module in (serve, demo, profile, plan, data, repo, train, cache):
        module.register(app)


def main() -> None:
    """Entry point of the console script: errors are one `error:` line (see `_errors`)."""
    from hapi.cli._errors import run

    _register()
    code = run(app, sys.argv[1:])
    freeze_long_lived()  # the exit need not walk torch's objects (most of a second)
    sys.exit(code)
