"""`hapi train`: fine-tune a model from the command line (or a TOML job file)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

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

from hapi.cli._job_flags import Own, job_command
from hapi.cli.train_run import TrainHooks

if TYPE_CHECKING:
    from hapi.cli.train_run import TrainResult
    from hapi.client import EpochStats, TransferJob


def register(app: typer.Typer) -> None:
    """Add `train` to `app`: its own options, then every job option of the config tree."""
    app.command(name="train")(job_command(train, _OWN))


def train(**given: Any) -> None:
    """Fine-tune MODEL on data beside a hapi server; write it (--out) or push it (--push)."""
    # The options given, by name: unset ones (None) leave the job file's or the default.
    options = {k: v for k, v in given.items() if v is not None}
    config = options.pop("config", None)
    from hapi.cli.train_run import TrainConfig, run_train

    if config is not None:
        job = TrainConfig.from_toml(config, **options)
    else:
        job = TrainConfig.from_options(**options)
    console = Console(highlight=False)
    with Progress(
        TextColumn("{task.description:<14}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    ) as bars:
        result = run_train(job, _Report(console, bars))
    console.print(_summary(result), soft_wrap=True)


_OWN: list[Own] = [
    (
        "model",
        str,
        typer.Argument(
            None, help="A zoo model (resnet18, efficientnet_lite0, timm:NAME) or repo://NAME."
        ),
    ),
    ("dataset", str, typer.Option(None, help="The training set's prefix in the server's store.")),
    (
        "server",
        str,
        typer.Option(
            None,
            help="The hapi server beside the data (grpc://host:port; several comma-separated).",
        ),
    ),
    ("epochs", int, typer.Option(None, help="Epochs to train. Default: 3.")),
    ("lr", float, typer.Option(None, help="Learning rate, SGD with momentum. Default: 0.01.")),
    ("weights", str, typer.Option(None, help="imagenet: the zoo model's pre-trained weights.")),
    ("out", str, typer.Option(None, help="Write the fine-tuned model here (.safetensors).")),
    ("plot", str, typer.Option(None, help="Write a picture of the run here (PNG).")),
    ("push", str, typer.Option(None, help="Push the fine-tuned model to --repo under this name.")),
    ("repo", str, typer.Option(None, envvar="HAPI_REPO", help="The model repository's URI.")),
    ("endpoint", str, typer.Option(None, help="The repository store's endpoint URL.")),
    (
        "config",
        Path,
        typer.Option(None, help="A TOML job file of these options; the command line wins."),
    ),
]
"""`hapi train`'s own options; the job's follow, one per `hapi.client.config.flags.Flag`."""


class _Report(TrainHooks):
    """Prints the plan and each epoch above the progress bars."""

    def __init__(self, console: Console, bars: Progress) -> None:
        self.console, self.bars = console, bars
        self.tasks: dict[str, TaskID] = {}

    def planned(self, job: TransferJob) -> None:
        self.console.print(f"[bold]hapi train[/]: {job.summary()}")
        from hapi.graph import Cut

        plan = job.plan if Cut.of(job.config.planning.cut).auto else None
        if plan is not None:  # its reason is in the summary: the table of options follows
            self.console.print("\n".join(plan.explain(limit=6).splitlines()[1:]))

    def progress(self, phase: str, done: int, total: int) -> None:
        if phase not in self.tasks:
            self.tasks[phase] = self.bars.add_task(phase, total=total)
        self.bars.update(self.tasks[phase], completed=done, total=total)

    def epoch(self, stats: EpochStats) -> None:
        where = "raw bytes" if stats.cut == -1 else f"cut {stats.cut}"
        self.console.print(
            f"epoch {stats.epoch + 1}: loss {stats.loss:.4f}, accuracy {stats.accuracy:.1%}, "
            f"{stats.samples} samples in {stats.seconds:.1f}s "
            f"({stats.samples / max(stats.seconds, 1e-9):.0f}/s), "
            f"{stats.bytes_received / 1e6:.2f} MB received, {where}{_cached(stats)}"
        )


def _cached(stats: EpochStats) -> str:
    """Where the epoch's features came from, when a cache gave some; what it could not keep."""
    refused = (
        f"; {stats.cache_write_failures} not cached (the cache's disk refused them)"
        if stats.cache_write_failures
        else ""
    )
    if not (stats.cached or stats.server_cached):
        return refused
    return (
        f"; {stats.cached} from the trainer's cache, {stats.server_cached} from the "
        f"server's, {stats.computed} computed{refused}"
    )


def _summary(result: TrainResult) -> str:
    # Plain lines, not a table: a table cuts a long path at the terminal's width.
    last = result.epochs[-1]
    received = sum(e.bytes_received for e in result.epochs)
    lines = [
        f"[bold]summary[/]: {len(result.epochs)} epoch(s) in {result.seconds:.1f}s, "
        f"{received / 1e6:.2f} MB received; final train loss {last.loss:.4f}, "
        f"train accuracy {last.accuracy:.1%}"
    ]
    if result.evaluation is not None:
        lines.append(
            f"eval accuracy {result.evaluation.accuracy:.1%} on {result.evaluation.samples} "
            f"images (loss {result.evaluation.loss:.4f})"
        )
    if result.out is not None:
        lines.append(f"wrote {result.out}")
    if result.pushed is not None:
        lines.append(f"pushed {result.pushed}")
    if result.plot is not None:
        lines.append(f"wrote the run's picture to {result.plot}")
    return "\n".join(lines)
