"""The `hapi` command: a thin shell over the library, one library call per command."""

from __future__ import annotations

import sys

import typer
from rich.console import Console

from hapi.errors import HapiError

__all__ = ["app", "main"]

app = typer.Typer(
    name="hapi",
    help="Near-data transfer learning: run the frozen front of a model next to the data.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _register() -> None:
    # Each command group lives in its own module and adds itself to `app`.
    from hapi.cli import data, demo, profile, repo, serve

    for module in (serve, demo, profile, data, repo):
        module.register(app)


def main() -> None:
    """Entry point of the console script: domain errors print one line, no traceback."""
    _register()
    try:
        # Outside standalone mode click returns a `typer.Exit`'s code instead of exiting.
        code = app(standalone_mode=False)
    except HapiError as exc:
        Console(stderr=True).print(f"[bold red]error:[/] {exc}", highlight=False)
        sys.exit(1)
    except (typer.Abort, KeyboardInterrupt):
        Console(stderr=True).print("[yellow]aborted[/]")
        sys.exit(130)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except Exception as exc:  # click usage errors and the like
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        raise
    if isinstance(code, int) and code:
        sys.exit(code)
