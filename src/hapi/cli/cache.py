"""`hapi cache`: what a feature cache directory holds, and emptying it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from hapi.cache import FeatureCache

__all__ = ["register"]

cache_app = typer.Typer(
    help="List, total and clear a feature cache directory (the trainer's or a server's).",
    no_args_is_help=True,
)

_DIR_HELP = "The cache directory (default: $HAPI_CACHE_DIR/features, ~/.cache/hapi/features)."


def register(app: typer.Typer) -> None:
    """Add the `cache` group to `app`."""
    app.add_typer(cache_app, name="cache", help="Inspect or clear a feature cache.")


@cache_app.command("ls")
def ls(directory: str | None = typer.Argument(None, help=_DIR_HELP)) -> None:
    """One line per feature space: its head, cut, transforms, dtype, entries and bytes."""
    from hapi._sizes import format_bytes

    cache = _open(directory)
    usage = cache.usage()
    if not usage:
        typer.echo(f"{cache.root}: empty")
        return
    typer.echo(f"{cache.root}:")
    for space in usage:
        d = space.described
        ops = "+".join(op.get("op", "?") for op in d.get("transforms", {}).get("ops", []))
        views = d.get("transforms", {}).get("views")
        typer.echo(
            f"  {space.id}  {space.entries:,} entries  {format_bytes(space.bytes)}  "
            f"cut {d.get('cut', '?')}  {ops}{f' (views={views})' if views else ''}  "
            f"{d.get('wire_dtype', '?')}  head {str(d.get('head', '?'))[:12]}"
        )


@cache_app.command()
def stats(directory: str | None = typer.Argument(None, help=_DIR_HELP)) -> None:
    """The directory's totals: spaces, entries, bytes."""
    from hapi._sizes import format_bytes

    cache = _open(directory)
    usage = cache.usage()
    entries = sum(u.entries for u in usage)
    held = sum(u.bytes for u in usage)
    typer.echo(
        f"{cache.root}: {len(usage)} feature space(s), {entries:,} entries, {format_bytes(held)}"
    )


@cache_app.command()
def clear(
    directory: str | None = typer.Argument(None, help=_DIR_HELP),
    space: str | None = typer.Option(None, help="Clear only this space (an id `ls` shows)."),
) -> None:
    """Remove the entries (of one space); running jobs then miss and compute again."""
    from hapi._sizes import format_bytes
    from hapi.errors import InvalidRequest

    cache = _open(directory)
    if space is not None and space not in {u.id for u in cache.usage()}:
        raise InvalidRequest(
            f"no feature space {space!r} in {cache.root}: `hapi cache ls` lists them"
        )
    freed = cache.clear(space)
    typer.echo(f"{cache.root}: cleared {format_bytes(freed)}")


def _open(directory: str | None) -> FeatureCache:
    from hapi.cache import FeatureCache, default_cache_root
    from hapi.errors import InvalidRequest

    root = Path(directory) if directory is not None else default_cache_root()
    if not root.exists():
        raise InvalidRequest(f"no feature cache at {root}: pass the directory a job or server uses")
    return FeatureCache(root)
