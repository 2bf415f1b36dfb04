"""`hapi data`: make, import and list datasets in an object store."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

if TYPE_CHECKING:
    from hapi.data import DatasetManifest, Store

__all__ = ["register"]

data_app = typer.Typer(
    help="Make, import and list datasets (ImageFolder, WebDataset, Parquet) in an object store.",
    no_args_is_help=True,
)

_URI_HELP = "The dataset's root: a directory, file:///dir or s3://bucket/prefix."
_ENDPOINT_HELP = "S3 endpoint URL (default: AWS_ENDPOINT_URL); keys from the AWS variables."


def register(app: typer.Typer) -> None:
    """Add the `data` group to `app`."""
    app.add_typer(data_app, name="data", help="Make, import and list datasets.")


@data_app.command()
def synth(
    uri: str = typer.Argument(..., help=_URI_HELP),
    classes: int = typer.Option(4, help="Number of classes."),
    per_class: int = typer.Option(32, help="Images per class."),
    size: int = typer.Option(112, help="Image side in pixels."),
    seed: int = typer.Option(0, help="The same seed writes the same images."),
    endpoint: str | None = typer.Option(None, help=_ENDPOINT_HELP),
) -> None:
    """Write a synthetic labelled JPEG dataset to URI (for a val split, use another seed)."""
    from hapi.data import synth_dataset

    store = _store(uri, endpoint)
    with _bar("writing images", classes * per_class) as progress:
        manifest = synth_dataset(
            store, classes=classes, per_class=per_class, size=size, seed=seed, progress=progress
        )
    _summary(store, manifest)


@data_app.command("import")
def import_(
    directory: str = typer.Argument(..., help="A local ImageFolder tree: DIR/<class>/<image>."),
    uri: str = typer.Argument(..., help=_URI_HELP),
    format: str = typer.Option(
        "imagefolder",
        "--format",
        help="imagefolder (one object per image), webdataset (.tar shards) or parquet.",
    ),
    shard_size: str = typer.Option("256MB", help="Shards up to this size (webdataset, parquet)."),
    endpoint: str | None = typer.Option(None, help=_ENDPOINT_HELP),
) -> None:
    """Upload the images of a local ImageFolder tree to URI: as they are (keeping the class
    folders), or as WebDataset or Parquet shards."""
    from hapi._sizes import parse_bytes
    from hapi.data import import_folder, local_images
    from hapi.data.shard_writer import import_shards

    if format not in ("imagefolder", "webdataset", "parquet"):
        raise typer.BadParameter(
            f"{format!r} is not a format: use imagefolder, webdataset or parquet",
            param_hint="--format",
        )
    total = len(local_images(directory))
    store = _store(uri, endpoint)
    with _bar("uploading images", total) as progress:
        if format == "imagefolder":
            manifest = import_folder(directory, store, progress=progress)
        else:
            manifest = import_shards(
                directory,
                store,
                format=format,  # type: ignore[arg-type]
                shard_size=parse_bytes(shard_size),
                progress=progress,
            )
    _summary(store, manifest)


@data_app.command("ls")
def ls(
    uri: str = typer.Argument(..., help=_URI_HELP),
    dataset: str = typer.Option(
        "",
        help="The dataset in the store: a prefix, a shard pattern (train-{000..015}.tar) "
        "or a key list (.csv, .jsonl); default the store's root.",
    ),
    endpoint: str | None = typer.Option(None, help=_ENDPOINT_HELP),
) -> None:
    """Print a dataset's image count, classes with their counts, size and shards (an
    ImageFolder tree, WebDataset or Parquet shards, or a key list)."""
    from hapi.cli._stores import existing_store, store_options
    from hapi.data import DatasetManifest

    hint = f"make a dataset there first (`hapi data synth {uri}` or `hapi data import DIR {uri}`)"
    store = existing_store(uri, store_options(endpoint), hint)
    _summary(store, DatasetManifest.from_store(store, dataset))


def _store(uri: str, endpoint: str | None) -> Store:
    from hapi.cli._stores import store_options
    from hapi.data import open_store

    return open_store(uri, store_options(endpoint))


@contextmanager
def _bar(label: str, total: int) -> Iterator[Callable[[int], None]]:
    # Progress goes to stderr, so stdout holds only the summary line.
    with Progress(
        TextColumn(label),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bars:
        task = bars.add_task(label, total=total)
        yield lambda n: bars.update(task, completed=n)


def _summary(store: Store, manifest: DatasetManifest) -> None:
    from hapi.data import summarize

    Console().print(f"{store.uri}: {summarize(store, manifest)}", highlight=False, soft_wrap=True)
