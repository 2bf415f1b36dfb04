"""`hapi demo`: the baseline and hapi on a synthetic dataset, through an emulated link."""

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
    epochs: int = typer.Option(3, help="Training epochs per run."),
    link: str = typer.Option("50mbit", help="The emulated storage link, e.g. 50mbit, 1gbit."),
    image_size: int = typer.Option(112, help="The model's input side."),
    per_class: int = typer.Option(48, help="Training images per class."),
    wire_dtype: str = typer.Option("fp16", help="Feature dtype on the wire: fp32, fp16, bf16."),
    plot: str = typer.Option("hapi-demo.png", help="Where to write the picture of hapi's run."),
) -> None:
    """Fine-tune EfficientNet-Lite0 twice, as the baseline and with hapi, and compare."""
    from hapi.cli.demo_run import DemoConfig, run_demo

    config = DemoConfig(
        epochs=epochs,
        link=link,
        image_size=image_size,
        train_per_class=per_class,
        wire_dtype=wire_dtype,
        picture=plot,
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

        base, hapi = run_demo(config, progress)
    console.print(_table(base, hapi, link))
    for line in _story(base, hapi):
        console.print(line)
    console.print(
        "The whole run counts what you wait for: building the job, planning, every epoch "
        "and the evaluation."
    )


def _table(base: DemoRun, hapi: DemoRun, link: str) -> Table:
    table = Table(title=f"baseline ({base.route}) and hapi through a {link} link")
    table.add_column("")
    for column in ("baseline", "hapi", "baseline / hapi"):
        table.add_column(column, justify="right")
    epochs = len(base.epochs)
    spans = [(1, 1, "epoch 1")]
    if epochs > 1:
        spans.append((2, epochs, f"epochs 2-{epochs}" if epochs > 2 else "epoch 2"))
    for first, last, name in spans:
        (base_bytes, base_s), (hapi_bytes, hapi_s) = (
            base.moved(first, last),
            hapi.moved(first, last),
        )
        table.add_row(
            f"{name}: MB",
            f"{base_bytes / 1e6:.2f}",
            f"{hapi_bytes / 1e6:.2f}",
            _times(base_bytes, hapi_bytes),
        )
        table.add_row(f"{name}: seconds", f"{base_s:.2f}", f"{hapi_s:.2f}", _times(base_s, hapi_s))
    table.add_row(
        "whole run: seconds",
        f"{base.whole_s:.2f}",
        f"{hapi.whole_s:.2f}",
        _times(base.whole_s, hapi.whole_s),
    )
    table.add_row(
        "final train loss", f"{base.epochs[-1].loss:.3f}", f"{hapi.epochs[-1].loss:.3f}", ""
    )
    table.add_row(
        "eval accuracy", f"{base.evaluation.accuracy:.1%}", f"{hapi.evaluation.accuracy:.1%}", ""
    )
    return table


def _times(before: float, after: float) -> str:
    """`3.2x`, or `none crossed` where hapi moved no bytes at all."""
    return "none crossed" if after <= 0 else f"{before / after:.1f}x"


def _story(base: DemoRun, hapi: DemoRun) -> list[str]:
    """What to read from the table, a sentence a line."""
    from hapi.cli.demo_run import ACCURACY_TOLERANCE
    from hapi.graph.cut_point import RAW

    lines = []
    if hapi.plan is not None:
        plan = hapi.plan
        others = [
            f"{name} {o.epoch_s:.2f} s"
            for name, o in (
                ("raw bytes", plan.option(RAW)),
                ("the freeze cut", plan.option(plan.freeze)),
            )
            if o is not None and o is not plan.chosen
        ]
        lines.append(
            f"The planner weighed {len(plan.options)} options (cuts, local shares) and chose "
            f"[bold]{plan.chosen.label}[/]: {plan.epoch_s:.2f} s an epoch predicted, held by "
            f"the {plan.binding}" + (f"; {', '.join(others)}." if others else ".")
        )
    later = hapi.epochs[1:]
    if later:
        cached = sum(e.cached for e in later)
        span = f"Epochs 2-{len(hapi.epochs)}" if len(later) > 1 else "Epoch 2"
        lines.append(
            f"{span} took {cached} of {sum(e.samples for e in later)} "
            "samples from the trainer's feature cache: the transforms are deterministic "
            "(augment=False), so a sample's features are the same every epoch. With "
            "augment=True each epoch draws fresh crops and flips, and the server computes "
            "every feature again."
        )
    gap = abs(hapi.evaluation.accuracy - base.evaluation.accuracy)
    accuracy = f"accuracy {hapi.evaluation.accuracy:.1%} against {base.evaluation.accuracy:.1%}"
    if gap > ACCURACY_TOLERANCE:
        lines.append(
            f"The runs drifted apart: {accuracy}, beyond fp16's rounding. Please report it."
        )
    else:
        lines.append(f"Both trained the same model: {accuracy}.")
    if hapi.picture is not None:
        lines.append(f"Wrote a picture of hapi's run to {hapi.picture}.")
    return lines
