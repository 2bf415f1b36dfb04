"""`hapi profile`: every cut point of a model, what it would send, and what the head costs."""

from __future__ import annotations

import json
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from hapi.errors import InvalidRequest


def register(app: typer.Typer) -> None:
    """Add `profile` to `app`."""
    app.command()(profile)


def profile(
    model: str = typer.Argument(
        ...,
        help="A torchvision name (resnet18), efficientnet_lite0, timm:NAME or "
        "hf:CONFIG_NAME_OR_CLASS (hf:ViTConfig, hf:vit).",
    ),
    image_size: int = typer.Option(224, help="Input height and width."),
    weights: str = typer.Option(None, help="Pre-trained weights (imagenet for lite0)."),
    num_classes: int = typer.Option(None, help="Replace the classifier with this many classes."),
    config: str = typer.Option(
        None,
        help="The builder's options as JSON: '{\"drop_path_rate\": 0.1}' for timm, a config's "
        'fields for hf (\'{"image_size": 64, "num_hidden_layers": 4}\').',
    ),
    flops: bool = typer.Option(True, help="Count forward FLOPs per cut (one forward pass)."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list instead of a table."),
) -> None:
    """List the cut points of MODEL: each activation's size, and the parameters and
    forward FLOPs of the head up to it (what the server holds and computes per sample)."""
    from hapi.graph import ModelSpec, build_model, profile_rows, trace

    spec = ModelSpec(name=model, weights=weights, num_classes=num_classes, config=_config(config))
    graph = trace(build_model(spec), input_shape=(3, image_size, image_size))
    rows = profile_rows(graph, flops=flops)
    if as_json:
        typer.echo(json.dumps(rows))
        return
    table = Table(
        title=f"{model} at {image_size}x{image_size}: {graph.num_cuts} cut points, "
        + _how(graph.method, graph.fallback_reason),
        caption="\n".join([*graph.notes, _CAPTION if flops else _CAPTION.split(";")[0]]),
    )
    columns = ["cut", "after", "shape", "bytes", "vs input", "params"]
    columns += ["FLOPs"] if flops else []
    for column in columns:
        if column == "after":
            # Names are what `cut=` and `freeze=` take: folded when narrow, never cut short.
            table.add_column(column, overflow="fold")
        else:
            table.add_column(column, justify="left" if column == "shape" else "right", no_wrap=True)
    for row in rows:
        cells = [
            str(row["cut"]),
            row["name"],
            "x".join(map(str, row["shape"])),
            _human(row["bytes_per_sample"]),
            f"{row['ratio']:.3f}",
            _count(row["params"]),
        ]
        cells += [_count(row["flops"])] if flops else []
        table.add_row(*cells)
    Console().print(table)


_CAPTION = (
    "bytes: one sample's activation in fp32 (fp16 and bf16 send half); params and FLOPs: "
    "the head up to the cut, FLOPs for one sample's forward pass"
)


def _config(text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise InvalidRequest(f"--config must be a JSON object, got {text!r}: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidRequest(
            f"--config must be a JSON object like '{{\"depth\": 4}}', got {text!r}"
        )
    return value


def _how(method: str, reason: str | None) -> str:
    if method == "fx":
        return "traced with torch.fx"
    if method == "export":
        return "traced with torch.export (torch.fx cannot trace it)"
    return f"NOT traced ({reason}); cut between top-level children"


def _count(n: float) -> str:
    for unit in ("", "K", "M", "G", "T"):
        if abs(n) < 1000 or unit == "T":
            return f"{n:.0f}" if unit == "" else f"{n:.1f}{unit}"
        n /= 1000
    return f"{n}"


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
