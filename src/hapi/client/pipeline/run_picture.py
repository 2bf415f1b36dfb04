"""A run as a picture (`History.plot`, `hapi train --plot`): per epoch, where its time
went, where its samples came from, the bytes that crossed the link with the cut and share
in force, and the re-plans and failovers on the way.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from hapi.errors import InvalidRequest
from hapi.plan.picture import save_png

# `History` and `EpochStats` are read by attribute only: `history` imports this module, so
# naming them here would close a circle.
History = Any
EpochStats = Any

__all__ = ["plot_run"]

_SOURCES = (
    ("computed", "computed (server or trainer)", "tab:blue"),
    ("server_cached", "from the server's cache", "tab:purple"),
    ("cached", "from the trainer's cache", "tab:green"),
)


def plot_run(history: History, path: str | Path, *, title: str = "") -> Path:
    """Write `history` as a PNG at `path`; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = history.epochs
    if not epochs:
        raise InvalidRequest("no epoch to draw: plot a history after fit")
    x = [e.epoch + 1 for e in epochs]
    fig, (time_ax, samples_ax, bytes_ax) = plt.subplots(
        3, 1, figsize=(max(6.0, 1.1 * len(x) + 3), 8), sharex=True
    )
    _times(time_ax, x, epochs, history)
    bottom = [0] * len(x)
    for field, label, color in _SOURCES:
        values = [getattr(e, field) for e in epochs]
        samples_ax.bar(x, values, bottom=bottom, color=color, label=label)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    samples_ax.set_ylim(0, max(bottom) * 1.5)  # room for the legend above the bars
    samples_ax.set_ylabel("samples")
    samples_ax.set_title("where each epoch's samples came from", fontsize=9, loc="left")
    samples_ax.legend(fontsize=8, loc="upper right")
    megabytes = [e.bytes_received / 1e6 for e in epochs]
    bytes_ax.bar(x, megabytes, color="tab:orange")
    for xi, mb, e in zip(x, megabytes, epochs, strict=True):
        bytes_ax.annotate(
            _route(e), (xi, mb), ha="center", va="bottom", fontsize=7,
            xytext=(0, 2), textcoords="offset points",
        )  # fmt: skip
    bytes_ax.set_ylabel("MB over the link")
    bytes_ax.set_title("bytes received, and the cut and share in force", fontsize=9, loc="left")
    bytes_ax.set_xlabel("epoch")
    bytes_ax.set_xticks(x)
    bytes_ax.margins(y=0.2)
    if title:
        fig.suptitle(title, fontsize=10)
    described = "; ".join(
        f"epoch {e.epoch + 1}: {e.seconds:.2f} s, {e.bytes_received / 1e6:.2f} MB, "
        f"{_route(e) or 'no cut'}, {e.computed} computed, {e.cached} from the trainer's cache"
        for e in epochs
    )
    return save_png(fig, path, described)


def _times(ax: Any, x: list[int], epochs: list[EpochStats], history: History) -> None:
    """Each epoch's seconds as a bar, each stage's busy seconds as a line, and the
    epoch's re-plans and failovers written above its bar."""
    ax.bar(x, [e.seconds for e in epochs], color="lightgray", label="epoch (wall)")
    for field, label, color in (
        ("server_s", "server busy (its chunks summed)", "tab:blue"),
        ("transfer_s", "link busy", "tab:orange"),
        ("trainer_s", "trainer busy", "tab:green"),
    ):
        ax.plot(x, [getattr(e, field) for e in epochs], marker="o", color=color, label=label)
    marks = Counter((e.epoch, e.kind) for e in history.events if e.epoch is not None)
    for xi, e in zip(x, epochs, strict=True):
        notes = [
            f"{n} {kind}{'s' if n > 1 else ''}"
            for kind in ("replan", "failover", "fallback")
            if (n := marks[(e.epoch, kind)])
        ]
        if notes:
            ax.annotate(
                "\n".join(notes), (xi, e.seconds), ha="center", va="bottom", fontsize=7,
                color="tab:red", xytext=(0, 2), textcoords="offset points",
            )  # fmt: skip
    ax.set_ylabel("seconds")
    ax.set_title("where each epoch's time went", fontsize=9, loc="left")
    ax.legend(fontsize=8, loc="upper right")
    ax.margins(y=0.25)


def _route(e: EpochStats) -> str:
    if e.cut is None:
        return ""
    if e.samples and e.computed == 0:
        return "all from caches"  # the cut in force moved nothing this epoch
    where = "raw bytes" if e.cut == -1 else "inputs" if e.cut == 0 else f"cut {e.cut}"
    return f"{where} + {e.share:.0%} local" if e.share and e.cut != -1 else where
