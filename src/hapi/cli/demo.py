"""`hapi demo`: baseline vs pushdown on a synthetic dataset, through an emulated link."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

if TYPE_CHECKING:
    from hapi.cli.demo_run import DemoRun


def register(app: typer.Typer) -> None:
    """Add `demo` to `app`."""
    app.command()(demo)


def demo(
    epochs: int = typer.Option(2, help="Training epochs per run."),
    link: str = typer.Option("50mbit", help="The emulated storage link, e.g. 50mbit, 1gbit."),
    image_size: int = typer.Option(112, help="The model's input side."),
    per_class: int = typer.Option(48, help="Training images per class."),
    wire_dtype: str = typer.Option("fp16", help="Feature dtype on the wire: fp32, fp16, bf16."),
) -> None:
    """Fine-tune EfficientNet-Lite0 twice, baseline and pushdown, and compare."""
    from hapi.cli.demo_run import DemoConfig, run_demo

    config = DemoConfig(
        epochs=epochs,
        link=link,
        image_size=image_size,
        train_per_class=per_class,
        wire_dtype=wire_dtype,
    )
    console = Console()
    console.print(
        f"[bold]hapi demo[/]: fine-tune {config.model} ({config.weights} weights) on "
        f"{config.classes * config.train_per_class} synthetic images through a {link} link"
    )
    with Progress(
        TextColumn("{task.description:<24}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    ) as bars:
        tasks: dict[str, TaskID] = {}

        def progress(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bars.add_task(phase, total=total)
            bars.update(tasks[phase], completed=done, total=total)

        base, push = run_demo(config, progress)
    console.print(_table(base, push, link))
    ratio_bytes = base.bytes_per_epoch / max(push.bytes_per_epoch, 1)
    ratio_time = base.seconds_per_epoch / max(push.seconds_per_epoch, 1e-9)
    console.print(
        f"Pushdown at cut {push.cut} ({push.cut_name}) moved [bold]{ratio_bytes:.1f}x[/] fewer "
        f"bytes and ran epochs [bold]{ratio_time:.1f}x[/] faster; accuracy "
        f"{push.evaluation.accuracy:.1%} vs {base.evaluation.accuracy:.1%} for the baseline."
    )


def _table(base: DemoRun, push: DemoRun, link: str) -> Table:
    table = Table(title=f"baseline vs pushdown through a {link} link")
    for column in ("", "baseline (raw bytes)", "pushdown", "ratio"):
        table.add_column(column, justify="right")
    rows = [
        ("cut", "raw", f"{push.cut} ({push.cut_name})", ""),
        (
            "MB moved / epoch",
            f"{base.bytes_per_epoch / 1e6:.2f}",
            f"{push.bytes_per_epoch / 1e6:.2f}",
            f"{base.bytes_per_epoch / max(push.bytes_per_epoch, 1):.1f}x",
        ),
        (
            "epoch time (s)",
            f"{base.seconds_per_epoch:.2f}",
            f"{push.seconds_per_epoch:.2f}",
            f"{base.seconds_per_epoch / max(push.seconds_per_epoch, 1e-9):.1f}x",
        ),
        (
            "final train loss",
            f"{base.epochs[-1].loss:.3f}",
            f"{push.epochs[-1].loss:.3f}",
            "",
        ),
        (
            "eval accuracy",
            f"{base.evaluation.accuracy:.1%}",
            f"{push.evaluation.accuracy:.1%}",
            "",
        ),
    ]
    for row in rows:
        table.add_row(*row)
    return table
