"""`choose_plan`: weigh every option with the cost model and choose one, stably."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hapi.errors import InvalidRequest
from hapi.graph.cut_point import INPUT, RAW
from hapi.plan.cost import Estimate, Workload, best_share, estimate
from hapi.plan.plan import Plan
from hapi.plan.profiles import LinkProfile, ServerProfile, TrainerProfile

__all__ = ["PlannerConfig", "choose_plan"]


@dataclass(frozen=True, kw_only=True)
class PlannerConfig:
    """How the planner chooses among options."""

    tolerance: float = 0.02
    """When re-planning, an option within this fraction of the fastest is a tie, and the
    plan in force wins it, so noise in the measured rates does not flip the choice. A
    first plan takes the fastest: among near-ties no other rule did better in the
    benchmark (see `choose_plan`)."""
    hybrid: bool = True
    """Weigh hybrid options (a local share beside a pushed-down cut)."""
    raw: bool = True
    """Weigh RAW (the baseline)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.tolerance < 1.0:
            raise ValueError(f"tolerance must be in [0, 1), got {self.tolerance}")


def choose_plan(
    server: ServerProfile,
    trainer: TrainerProfile,
    link: LinkProfile,
    workload: Workload,
    *,
    freeze: int,
    names: Sequence[str] = (),
    config: PlannerConfig | None = None,
    current: Plan | None = None,
) -> Plan:
    """Choose the cut and local share that minimise the predicted epoch time.

    Weighs RAW, INPUT, every cut 1..freeze (as far as both profiles go) and, per cut, a
    hybrid with its best local share, and takes the fastest - or, when re-planning,
    `current`'s option if it is within `config.tolerance` of the fastest.

    Near-ties once went to the simplest option (a pure cut before a hybrid, a higher cut
    first). In the 256-image sweeps, of 20 configurations where that rule chose another
    option than the fastest prediction, it ran more than 1% slower in 8 (up to 5%) and
    more than 1% faster in 5 (mean +0.9%); a hybrid with one local chunk in 16 beat its
    pure cut in 3 of 5 and lost in none. Exact ties still go to the simplest, so a
    choice does not depend on the order the options were weighed in.

    Args:
        server, trainer, link: the profiles.
        workload: the epoch (samples, chunk size, chunks in flight).
        freeze: the freeze point; no cut past it is weighed.
        names: cut points' names, cut k at position k-1.
        config: tolerance and which kinds of option to weigh.
        current: the plan in force, when re-planning.

    Raises:
        InvalidRequest: the profiles cover no cut (not even INPUT).
    """
    config = config or PlannerConfig()
    last = min(freeze, server.last_cut, trainer.last_cut)
    if last < INPUT:
        raise InvalidRequest(f"cannot plan: freeze {freeze} or the profiles cover no cut")
    names = tuple(names)
    options = _options(server, trainer, link, workload, last=last, names=names, config=config)
    options.sort(key=lambda o: (o.epoch_s, _simplicity(o)))
    fastest = options[0]
    ties = [o for o in options if o.epoch_s <= fastest.epoch_s * (1 + config.tolerance)]
    kept = _same(current, ties) if current is not None else None
    chosen = kept or fastest
    return Plan(
        chosen=chosen,
        options=tuple(options),
        reason=_reason(chosen, fastest, options, freeze=last),
        server=server,
        trainer=trainer,
        link=link,
        workload=workload,
        freeze=freeze,
        names=names,
        # A re-plan keeps the codec: its profiles' sizes are that codec's.
        compression=current.compression if current is not None else "none",
    )


def _options(
    server: ServerProfile,
    trainer: TrainerProfile,
    link: LinkProfile,
    workload: Workload,
    *,
    last: int,
    names: tuple[str, ...],
    config: PlannerConfig,
) -> list[Estimate]:
    """Every option weighed: RAW, each cut from INPUT to `last`, and each cut's hybrid
    with its best local share, as `config` allows."""

    def name(cut: int) -> str:
        if cut == RAW:
            return "raw"
        if cut == INPUT:
            return "input"
        return names[cut - 1] if cut <= len(names) else str(cut)

    def weigh(cut: int, share: float) -> Estimate:
        return estimate(cut, share, server, trainer, link, workload, name=name(cut))

    options = [weigh(RAW, 0.0)] if config.raw else []
    for cut in range(INPUT, last + 1):
        options.append(weigh(cut, 0.0))
        if config.hybrid:
            share = best_share(cut, server, trainer, link, workload)
            if 0.0 < share < 1.0:
                options.append(weigh(cut, share))
    return options


def _simplicity(o: Estimate) -> tuple[bool, int, float]:
    # Pure before hybrid; a higher cut moves fewer bytes and leaves the trainer more room.
    # Only exact ties reach it.
    return (o.hybrid, -o.cut, o.share)


def _same(current: Plan, ties: list[Estimate]) -> Estimate | None:
    for o in ties:
        if o.cut == current.cut and abs(o.share - current.share) < 1e-9:
            return o
    return None


def _reason(chosen: Estimate, fastest: Estimate, options: list[Estimate], *, freeze: int) -> str:
    stages = chosen.stages
    others = ", ".join(f"{s} {stages[s]:.2f} s" for s in stages if s != chosen.binding)
    text = (
        f"{chosen.label}: predicted {chosen.epoch_s:.2f} s per epoch, held by the "
        f"{chosen.binding} ({stages[chosen.binding]:.2f} s; {others})"
    )
    for ref in (RAW, freeze):
        other = next((o for o in options if o.cut == ref and not o.hybrid), None)
        if other is not None and other is not chosen:
            text += f"; {other.label} {other.epoch_s:.2f} s ({other.epoch_s / chosen.epoch_s:.2f}x)"
    if chosen is not fastest:
        text += (
            f"; chosen over {fastest.label} ({fastest.epoch_s:.2f} s): within tolerance, "
            "the plan in force"
        )
    return text
