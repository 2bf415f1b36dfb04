"""`hapi profile`: every cut point of a model, and what it would send."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.table import Table


def register(app: typer.Typer) -> None:
    """Add `profile` to `app`."""
    app.command()(profile)


def profile(
    model: str = typer.Argument(..., help="A torchvision model name or efficientnet_lite0."),
    image_size: int = typer.Option(224, help="Input height and width."),
    weights: str = typer.Option(None, help="Pre-trained weights (imagenet for lite0)."),
    num_classes: int = typer.Option(None, help="Replace the classifier with this many classes."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list instead of a table."),
) -> None:
    """List the cut points of MODEL with the size of each cut's activation."""
    from hapi.graph import ModelSpec, build_model, profile_rows, trace

    spec = ModelSpec(name=model, weights=weights, num_classes=num_classes)
    graph = trace(build_model(spec), input_shape=(3, image_size, image_size))
    rows = profile_rows(graph)
    if as_json:
        typer.echo(json.dumps(rows))
        return
    how = (
        "traced with torch.fx"
        if graph.traced
        else f"NOT traced ({graph.fallback_reason}); cut between top-level children"
    )
    table = Table(title=f"{model} at {image_size}x{image_size}: {graph.num_cuts} cut points, {how}")
    for column in ("cut", "after", "shape", "fp32 / sample", "fp16 / sample", "vs input"):
        table.add_column(column, justify="left" if column in ("after", "shape") else "right")
    for row in rows:
        table.add_row(
            str(row["cut"]),
            row["name"],
            "x".join(map(str, row["shape"])),
            _human(row["bytes_per_sample"]),
            _human(row["bytes_fp16"]),
            f"{row['ratio']:.3f}",
        )
    Console().print(table)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
