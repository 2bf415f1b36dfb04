"""`ReplanConfig`: when a `Replanner` re-plans.

Its thresholds are the hysteresis that keeps a plan from following noise, and the shares
below which a stage is too idle to measure (docs/replanning.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hapi.plan.choose import PlannerConfig

__all__ = ["ReplanConfig"]


@dataclass(frozen=True, kw_only=True)
class ReplanConfig:
    """When to re-plan."""

    threshold: float = 0.15
    """Re-plan when the predicted epoch or a stage's rate moves by more than this."""
    min_chunks: int = 3
    """Chunks in a row that must show a drift before the plan changes (and that then set
    the rates it is re-planned from)."""
    weight: float = 0.3
    """Weight of the newest chunk in each stage's moving average."""
    min_stage_share: float = 0.1
    """A stage whose measured time is below this share of the busiest stage's keeps its
    profiled rate: a link that carries a few bytes per chunk, or a trainer that trains one
    layer, measures mostly fixed costs, and scaling its per-sample costs by that would
    mislead every option that leans on it."""
    link_busy_share: float = 0.5
    """A link measured faster than planned is believed beyond the probe's rate only when
    its measured time is at least this share of the busiest stage's (`Replanner.scales`)."""
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    """How re-plans choose."""
    min_gain: float = 0.1
    """A re-plan changes the cut or share only when the new choice is predicted this much
    faster than the plan in force at the measured rates: measured rates are noisy, and a
    change costs the chunks already issued by the old plan."""

    significance: float = 3.0
    """A server's or trainer's move drifts only beyond this many standard errors of its
    chunks' own scatter over a run of `min_chunks` (`StageRates.noise`): on a shared
    core chunks scatter by tens of percent, and runs of a few slow ones come by chance.
    0 turns it off."""

    swing: float = 2.0
    """A drift that moves the plan's predicted epoch by less than this factor must also
    show in a longer window before the plan changes (`drift.settled`): runs of a few chunks
    swing around an unchanged rate. A larger move, a link 10x slower, is acted on at once."""

    def __post_init__(self) -> None:
        if not self.swing >= 1.0:
            raise ValueError(f"swing must be >= 1, got {self.swing}")
        if not self.significance >= 0.0:
            raise ValueError(f"significance must be >= 0, got {self.significance}")
        if not self.threshold > 0.0:
            raise ValueError(f"threshold must be > 0, got {self.threshold}")
        if self.min_chunks < 1:
            raise ValueError(f"min_chunks must be >= 1, got {self.min_chunks}")
        if not 0.0 <= self.min_gain < 1.0:
            raise ValueError(f"min_gain must be in [0, 1), got {self.min_gain}")
        if not 0.0 <= self.link_busy_share <= 1.0:
            raise ValueError(f"link_busy_share must be in [0, 1], got {self.link_busy_share}")
        if not 0.0 <= self.min_stage_share < 1.0:
            raise ValueError(f"min_stage_share must be in [0, 1), got {self.min_stage_share}")
        if not 0.0 < self.weight <= 1.0:
            raise ValueError(f"weight must be in (0, 1], got {self.weight}")
