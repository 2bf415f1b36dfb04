"""`hapi data`: make, import and list datasets in an object store."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Callable

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

data_app = typer.Typer(help="Make, import and list datasets in an object store.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    """Add the `data` group to `app`."""
    app.add_typer(data_app, name="data")


def _store(uri: str, endpoint: str | None):  # type: ignore[no-untyped-def]
    from hapi.data import StoreOptions, open_store

    return open_store(uri, StoreOptions(endpoint=endpoint) if endpoint else None)


@contextmanager
def _bar(label: str, total: int) -> Iterator[Callable[[int], None]]:
    with Progress(
        TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
    ) as bars:
        task = bars.add_task(label, total=total)
        yield lambda n: bars.update(task, completed=n)


@data_app.command()
def synth(
    uri: str = typer.Argument(..., help="Where to write: a directory or s3://bucket/prefix."),
    classes: int = typer.Option(4, help="Number of classes."),
    per_class: int = typer.Option(32, help="Images per class."),
    size: int = typer.Option(112, help="Image side in pixels."),
    seed: int = typer.Option(0, help="The same seed writes the same images."),
    endpoint: str = typer.Option(None, help="S3 endpoint URL (default: AWS_ENDPOINT_URL)."),
) -> None:
    """Write a synthetic labelled image dataset (ImageFolder layout) to URI."""
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
    uri: str = typer.Argument(..., help="Where to upload: a directory or s3://bucket/prefix."),
    endpoint: str = typer.Option(None, help="S3 endpoint URL (default: AWS_ENDPOINT_URL)."),
) -> None:
    """Upload a local ImageFolder tree to URI."""
    from pathlib import Path

    from hapi.data import IMAGE_EXTENSIONS, import_folder

    total = sum(1 for p in Path(directory).glob("*/**/*") if p.suffix.lower() in IMAGE_EXTENSIONS)
    store = _store(uri, endpoint)
    with _bar("uploading images", total) as progress:
        manifest = import_folder(directory, store, progress=progress)
    _summary(store, manifest)


@data_app.command("ls")
def ls(
    uri: str = typer.Argument(..., help="A dataset: a directory or s3://bucket/prefix."),
    endpoint: str = typer.Option(None, help="S3 endpoint URL (default: AWS_ENDPOINT_URL)."),
) -> None:
    """List a dataset's classes and image counts."""
    from hapi.data import Manifest

    store = _store(uri, endpoint)
    _summary(store, Manifest.from_store(store))


def _summary(store, manifest) -> None:  # type: ignore[no-untyped-def]
    from collections import Counter

    counts = Counter(manifest.labels)
    nbytes = sum(store.size(k) for k in manifest.keys)
    per_class = ", ".join(f"{c}: {counts[i]}" for i, c in enumerate(manifest.classes))
    Console().print(
        f"{store.uri}: [bold]{len(manifest)}[/] images, {len(manifest.classes)} classes "
        f"({per_class}), {nbytes / 1e6:.2f} MB"
    )
