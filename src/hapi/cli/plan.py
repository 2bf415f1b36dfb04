"""`hapi plan`: the options of a job on a server, predicted, and the one chosen."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.table import Table

from hapi.cli._job_flags import Own, job_command, job_options

if TYPE_CHECKING:
    from hapi.client import TransferJob
    from hapi.client.job.compare import OptionRun
    from hapi.plan import Plan


def register(app: typer.Typer) -> None:
    """Add `plan` to `app`: its own options, then the job's (but the plan's own choice)."""
    app.command(name="plan")(job_command(plan, _OWN, skip=("cut", "local_share", "mode")))


_OWN: list[Own] = [
    ("model", str, typer.Argument(..., help="A zoo model (resnet18, efficientnet_lite0...).")),
    (
        "server",
        str,
        typer.Option(
            ..., help="The hapi server beside the data (host:port; several, comma-separated)."
        ),
    ),
    ("dataset", str, typer.Option(..., help="The training set's prefix in the server's store.")),
    ("link", str, typer.Option(None, help="Plan for this link rate instead (e.g. 100mbit).")),
    ("measure", bool, typer.Option(False, help="Also train each top option for real.")),
    ("top", int, typer.Option(4, help="With --measure: the fastest options to run.")),
    ("epochs", int, typer.Option(1, help="With --measure: epochs per option (the last timed).")),
    (
        "plot",
        Path,
        typer.Option(
            None,
            help="Write a picture of the plan here (PNG): each option's stage times and "
            "bytes a sample, the choice marked; with --measure, the measured epochs beside.",
        ),
    ),
    ("as_json", bool, typer.Option(False, "--json", help="Print JSON instead of tables.")),
]
"""`hapi plan`'s own options; the job's follow, one per `hapi.client.config.flags.Flag`."""


def plan(
    *,
    model: str,
    server: str,
    dataset: str,
    link: str | None,
    measure: bool,
    top: int,
    epochs: int,
    plot: Path | None,
    as_json: bool,
    **given: Any,
) -> None:
    """Measure the server, the link and this trainer; print every option and the choice."""
    from hapi.client import TransferJob
    from hapi.client.job.compare import pick_options, run_options
    from hapi.graph import ModelSpec

    options = job_options(given)
    spec = ModelSpec(name=model)
    job = TransferJob(spec, dataset, server, **options)
    chosen = job.plan
    assert chosen is not None  # cut="auto"
    if link is not None:
        chosen = _for_link(chosen, link)
    runs: list[OptionRun] = []
    if measure:
        runs = run_options(
            pick_options(chosen, top),
            lambda o: TransferJob(spec, dataset, server, cut=o.cut, local_share=o.share, **options),
            epochs=epochs,
        )
    if plot is not None:
        from hapi.plan.picture import plot_plan

        size = job.config.data.image_size
        plot_plan(
            chosen,
            plot,
            measured=[(r.option, r.epoch_s) for r in runs],
            title=f"{model} at {size} px on {dataset}",
        )
    if as_json:
        typer.echo(json.dumps({**chosen.to_dict(), "measured": [_run_row(r) for r in runs]}))
        return
    _print(job, chosen, runs, plot)


def _for_link(chosen: Plan, link: str) -> Plan:
    """The plan chosen again for the link rate `link` (e.g. 100mbit), at the probed latency."""
    from hapi.plan import LinkProfile, choose_plan
    from hapi.server import parse_rate

    rate = LinkProfile(bytes_per_s=parse_rate(link), latency_s=chosen.link.latency_s)
    return choose_plan(
        chosen.server, chosen.trainer, rate, chosen.workload,
        freeze=chosen.freeze, names=chosen.names,
    )  # fmt: skip


def _print(job: TransferJob, chosen: Plan, runs: list[OptionRun], plot: Path | None) -> None:
    """Print the job's plan line, every option (measured beside, if run) and the choice."""
    console = Console(width=max(Console().width, 120))
    console.print(job.summary().splitlines()[1])
    console.print(_table(chosen, runs))
    console.print(f"[bold]chosen[/]: {chosen.reason}")
    if plot is not None:
        console.print(f"wrote {plot}")


def _table(chosen: Plan, runs: list[OptionRun]) -> Table:
    measured = {(r.option.cut, r.option.share): r for r in runs}
    link = chosen.link.bytes_per_s
    table = Table(
        title=f"{chosen.workload.samples} samples, link {link * 8 / 1e6:.1f} Mbit/s; "
        "stage times are busy seconds per epoch"
    )
    columns = ["", "option", "server s", "link s", "trainer s", "epoch s", "MB", "held by"]
    if runs:
        columns += ["measured s", "held by (measured)"]
    for column in columns:
        table.add_column(column, justify="left" if column in ("option", "held by") else "right")
    for o in chosen.options:
        run = measured.get((o.cut, o.share))
        if runs and run is None and o is not chosen.chosen:
            continue
        row = [
            "*" if o is chosen.chosen else "",
            o.label,
            f"{o.server_s:.2f}",
            f"{o.link_s:.2f}",
            f"{o.trainer_s:.2f}",
            f"{o.epoch_s:.2f}",
            f"{o.bytes / 1e6:.2f}",
            o.binding,
        ]
        if runs:
            row += [f"{run.epoch_s:.2f}", run.binding] if run is not None else ["", ""]
        table.add_row(*row)
    return table


def _run_row(run: OptionRun) -> dict[str, object]:
    return {
        "option": run.option.label,
        "cut": run.option.cut,
        "share": run.option.share,
        "predicted_s": run.option.epoch_s,
        "measured_s": run.epoch_s,
        "server_s": run.server_s,
        "transfer_s": run.transfer_s,
        "trainer_s": run.trainer_s,
        "binding": run.binding,
    }
