"""A plan as a picture: each option's predicted busy seconds per stage and bytes a sample,
the choice marked, and measured epochs beside where options were run (`hapi plan --plot`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hapi.graph.cut_point import RAW
from hapi.plan.cost import Estimate
from hapi.plan.plan import Plan

__all__ = ["plot_plan", "save_png"]

SHOWN = 12
"""Options drawn at most: more do not read. The fastest, with the chosen one and the two
a reader measures it against - raw bytes and the freeze cut without a local share."""

_COLORS = {"server": "tab:blue", "link": "tab:orange", "trainer": "tab:green"}


def plot_plan(
    plan: Plan,
    path: str | Path,
    *,
    measured: Sequence[tuple[Estimate, float]] = (),
    title: str = "",
) -> Path:
    """Write `plan` as a PNG at `path`: per option, the server's, the link's and the
    trainer's predicted busy seconds over an epoch with the predicted epoch marked, and
    the bytes a sample crosses the link; `measured` adds (option, measured epoch seconds)
    beside. Returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    shown = _shown(plan)
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(10, 1.2 + 0.42 * len(shown)), sharey=True,
        gridspec_kw={"width_ratios": [3, 1]},
    )  # fmt: skip
    _stages(left, shown, {(o.cut, o.share): s for o, s in measured})
    left.set_yticks(range(len(shown)), [_label(o, plan) for o in shown])
    for tick, o in zip(left.get_yticklabels(), shown, strict=True):
        tick.set_fontweight("bold" if o is plan.chosen else "normal")
    samples = max(plan.workload.samples, 1)
    bars = right.barh(range(len(shown)), [o.bytes / samples / 1e3 for o in shown], color="tab:gray")
    right.bar_label(bars, fmt="%.3g", fontsize=7, padding=2)
    right.margins(x=0.25)
    right.set_xscale("log")
    right.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    right.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    right.set_xlabel("KB a sample over the link")
    link = plan.link.bytes_per_s * 8 / 1e6
    fig.suptitle(
        (f"{title}: " if title else "")
        + f"{plan.workload.samples:,} samples, link {link:,.1f} Mbit/s, {plan.codec}",
        fontsize=10,
    )
    others = ", ".join(f"{o.label} {o.epoch_s:.2f} s" for o in shown if o is not plan.chosen)
    return save_png(
        fig, path, f"chosen: {plan.chosen.label}, {plan.epoch_s:.2f} s predicted; {others}"
    )


def save_png(fig: Any, path: str | Path, description: str) -> Path:
    """Lay `fig` out, write it as a PNG at `path` (its folder made), and close it.
    `description` goes into the PNG's text: what the picture says, for a reader who
    cannot see it and for a program that checks it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    # bbox "tight": legends placed outside the axes are kept too.
    fig.savefig(out, dpi=110, bbox_inches="tight", metadata={"Description": description})
    plt.close(fig)
    return out


def _shown(plan: Plan) -> list[Estimate]:
    """The options drawn, the fastest on top."""
    anchors = [
        o for o in (plan.chosen, plan.option(RAW), plan.option(plan.freeze)) if o is not None
    ]
    fastest = [o for o in plan.options if o not in anchors][: SHOWN - len(anchors)]
    return sorted({id(o): o for o in (*fastest, *anchors)}.values(), key=lambda o: -o.epoch_s)


def _label(option: Estimate, plan: Plan) -> str:
    label = "RAW (the images' bytes)" if option.cut == RAW else option.label
    if option.cut == plan.freeze and not option.hybrid:
        label += " (the freeze cut)"
    return ("\u25b6 chosen: " if option is plan.chosen else "") + label


def _stages(ax: Any, shown: list[Estimate], measured: dict[tuple[int, float], float]) -> None:
    """Each option's three stages as bars, its predicted epoch as a tick, and its
    measured epoch as a cross where it was run."""
    rows = range(len(shown))
    height = 0.26
    for i, stage in enumerate(("server", "link", "trainer")):
        offsets = [r + (1 - i) * height for r in rows]
        values = [o.stages[stage] for o in shown]
        ax.barh(offsets, values, height, color=_COLORS[stage], label=f"{stage} busy")
    ax.scatter(
        [o.epoch_s for o in shown], rows, marker="|", s=400, color="black",
        label="predicted epoch", zorder=3,
    )  # fmt: skip
    runs = [
        (r, measured[(o.cut, o.share)]) for r, o in enumerate(shown) if (o.cut, o.share) in measured
    ]
    if runs:
        ax.scatter(
            [s for _, s in runs], [r for r, _ in runs], marker="x", s=80, color="tab:red",
            label="measured epoch", zorder=4,
        )  # fmt: skip
    ax.set_xlabel("seconds per epoch (each stage's busy time; the stages overlap)")
    # Below the axes: inside, it hides the bars of whichever option sits under it.
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=5, fontsize=8)
