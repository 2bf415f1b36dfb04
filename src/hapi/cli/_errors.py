"""How `hapi` ends: every error is one `error:` line on stderr and an exit code, no traceback.

Exit codes: 0, done; 130, interrupted;
    1: the command ran and failed: hapi refused a value (`--batch-size 0`, a bad rate, a store
       directory that does not exist), a store or server could not be reached, or a check
       found problems (`hapi repo fsck`);
    2: a usage mistake, found before the command ran: an unknown command or option, a missing
       argument, a value not of the option's type (`--port notaport`); with a hint naming the
       command's `--help`. `HAPI_DEBUG=1` prints the traceback of errors, same exit codes.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from hapi.errors import HapiError

try:
    # typer >= 0.2x carries its own copy of click; older releases depend on click itself.
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover - depends on the installed typer
    import click.exceptions as click_errors  # type: ignore[no-redef]

__all__ = ["FAILED", "INTERRUPTED", "USAGE", "run"]

FAILED = 1
USAGE = 2
INTERRUPTED = 130

# click >= 8.2 signals "no arguments: show the help" as a usage error; the help is the answer.
_NO_ARGS_IS_HELP: type[Exception] | None = getattr(click_errors, "NoArgsIsHelpError", None)

# An unexpected exception's message is quoted this far: enough to recognise it.
_MAX_INTERNAL = 200


def run(app: typer.Typer, args: Sequence[str]) -> int:
    """Run the command line `args` on `app`; return the exit code, having printed any error."""
    try:
        # Outside standalone mode click raises its errors and returns a `typer.Exit`'s code.
        code: Any = app(args=list(args), prog_name="hapi", standalone_mode=False)
    except HapiError as exc:
        _traceback_if_debugging()
        error(str(exc))
        return FAILED
    except typer.Abort:
        Console(stderr=True).print("[yellow]aborted[/]")
        return INTERRUPTED
    except KeyboardInterrupt:
        return INTERRUPTED
    except typer.Exit as exc:
        return int(exc.exit_code)
    except click_errors.UsageError as exc:
        if _NO_ARGS_IS_HELP is not None and isinstance(exc, _NO_ARGS_IS_HELP):
            exc.show()
            return int(exc.exit_code)
        error(_sentence(exc.format_message()))
        command = exc.ctx.command_path if exc.ctx is not None else "hapi"
        Console(stderr=True, highlight=False).print(
            escape(f"Try '{command} --help' for help."), soft_wrap=True
        )
        return USAGE
    except click_errors.ClickException as exc:
        error(_sentence(exc.format_message()))
        return int(exc.exit_code)
    except Exception as exc:
        _traceback_if_debugging()
        text = " ".join(str(exc).split())
        if len(text) > _MAX_INTERNAL:
            text = text[:_MAX_INTERNAL] + "..."
        detail = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
        hint = "" if _debugging() else "; run with HAPI_DEBUG=1 for the traceback"
        error(f"internal error ({detail}){hint}")
        return FAILED
    return code if isinstance(code, int) else 0


def error(message: str) -> None:
    """Print `message` as one `error:` line on stderr."""
    # Rich would wrap a long line at the terminal's width and read `[...]` as markup.
    line = " ".join(message.split())
    Console(stderr=True, highlight=False).print(
        f"[bold red]error:[/] {escape(line)}", soft_wrap=True
    )


def _sentence(message: str) -> str:
    # click capitalises its messages ("No such option"); hapi's errors read as `error: no ...`.
    if len(message) > 1 and message[0].isupper() and message[1].islower():
        return message[0].lower() + message[1:]
    return message


def _debugging() -> bool:
    return os.environ.get("HAPI_DEBUG", "") not in ("", "0")


def _traceback_if_debugging() -> None:
    if _debugging():
        traceback.print_exc(file=sys.stderr)
