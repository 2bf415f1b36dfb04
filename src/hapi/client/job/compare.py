"""Running a plan's options for real, to hold the predictions against measured epochs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hapi.graph import RAW
from hapi.plan import Estimate, Plan

if TYPE_CHECKING:
    from hapi.client.job.transfer import TransferJob

__all__ = ["OptionRun", "pick_options", "run_options"]


@dataclass(frozen=True)
class OptionRun:
    """One option, predicted and measured."""

    option: Estimate
    """The prediction."""
    epoch_s: float
    """The measured epoch (the last of the run)."""
    server_s: float
    transfer_s: float
    trainer_s: float
    binding: str
    """The stage that held the measured epoch."""


def pick_options(plan: Plan, top: int) -> list[Estimate]:
    """The `top` fastest predicted options, the chosen one, RAW and the freeze cut."""
    picked = list(plan.options[:top])
    for extra in (plan.chosen, plan.option(RAW), plan.option(plan.freeze)):
        if extra is not None and extra not in picked:
            picked.append(extra)
    return picked


def run_options(
    options: Sequence[Estimate],
    make_job: Callable[[Estimate], TransferJob],
    *,
    epochs: int = 1,
    lr: float = 0.01,
) -> list[OptionRun]:
    """Train a fresh job per option for `epochs` epochs; the last epoch is measured.

    Args:
        options: the options to run (`pick_options`).
        make_job: a job fixed to an option (`cut=o.cut, local_share=o.share`).
        epochs: epochs per option; more than one leaves the first's warm-up out.
        lr: the learning rate (the runs measure time, not accuracy).
    """
    runs = []
    for option in options:
        job = make_job(option)
        last = job.fit(epochs, lr=lr).epochs[-1]
        runs.append(
            OptionRun(
                option=option,
                epoch_s=last.seconds,
                server_s=last.server_s,
                transfer_s=last.transfer_s,
                trainer_s=last.trainer_s,
                binding=last.binding,
            )
        )
    return runs
