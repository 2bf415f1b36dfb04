"""`Plan`: the chosen (cut, local share), every option weighed, and why."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hapi.graph.cut_point import INPUT, RAW
from hapi.plan.cost import Estimate, Workload, estimate
from hapi.plan.profiles import LinkProfile, ServerProfile, TrainerProfile

__all__ = ["Plan"]


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A job's choice of cut and local share, with the predictions it was made from.

    It keeps its profiles and workload so that a `Replanner` can weigh it against what is
    measured, and so that `hapi plan` and `job.plan` can show every option.
    """

    chosen: Estimate
    """The option chosen."""
    options: tuple[Estimate, ...]
    """Every option weighed, fastest first."""
    reason: str
    """Why this option: the one-line summary `explain` starts with."""
    server: ServerProfile
    """The server's profile the predictions used."""
    trainer: TrainerProfile
    """The trainer's profile the predictions used."""
    link: LinkProfile
    """The link's profile the predictions used."""
    workload: Workload
    """The epoch the predictions are for."""
    freeze: int
    """The freeze point: no cut past it was weighed."""
    names: tuple[str, ...] = ()
    """Cut points' names, cut k at position k-1 (for tables)."""
    compression: str = "none"
    """The feature streams' buffer compression (none, lz4, zstd); the wire dtype is the
    server profile's. Chosen with the cut by `choose_codec`, kept by re-plans."""

    @property
    def wire_dtype(self) -> str:
        """The dtype features travel in (the server profile's sizes are in it)."""
        return self.server.wire_dtype

    @property
    def codec(self) -> str:
        """`int8+zstd`, `fp32`: the features' codec on the wire, as tables name it."""
        dtype = self.wire_dtype
        return dtype if self.compression == "none" else f"{dtype}+{self.compression}"

    @property
    def cut(self) -> int:
        """Where pushed-down chunks are cut (RAW: the baseline, nothing pushed down)."""
        return self.chosen.cut

    @property
    def share(self) -> float:
        """Share of the chunks the trainer computes itself from raw bytes (0 for RAW)."""
        return self.chosen.share

    @property
    def local_share(self) -> float:
        """Share of the chunks that travel as raw bytes: 1 for RAW, else `share`."""
        return 1.0 if self.cut == RAW else self.share

    @property
    def feature_cut(self) -> int:
        """Where every chunk joins the trainer's stream (local chunks compute up to it)."""
        return max(self.cut, INPUT)

    @property
    def epoch_s(self) -> float:
        """Predicted epoch time of the chosen option."""
        return self.chosen.epoch_s

    @property
    def binding(self) -> str:
        """The stage predicted to hold the epoch."""
        return self.chosen.binding

    def option(self, cut: int, share: float = 0.0) -> Estimate | None:
        """The estimate of option (`cut`, `share`), if it was weighed."""
        for o in self.options:
            if o.cut == cut and abs(o.share - share) < 1e-9:
                return o
        return None

    def with_choice(self, cut: int, share: float = 0.0, *, reason: str) -> Plan:
        """The same plan with (`cut`, `share`) chosen instead (weighed now if it was not).

        Raises:
            InvalidRequest: a cut the profiles do not cover, or a share outside [0, 1].
        """
        chosen = self.option(cut, share)
        options = self.options
        if chosen is None:
            names = dict(enumerate(self.names, 1))
            chosen = estimate(
                cut,
                share,
                self.server,
                self.trainer,
                self.link,
                self.workload,
                name=names.get(cut, ""),
            )
            options = tuple(sorted((*options, chosen), key=lambda o: o.epoch_s))
        return dataclasses.replace(self, chosen=chosen, options=options, reason=reason)

    def rows(self) -> list[dict[str, Any]]:
        """One JSON-safe row per option, fastest first, for tables and plots."""
        return [
            {
                "option": o.label,
                "cut": o.cut,
                "name": o.name,
                "share": o.share,
                "server_s": o.server_s,
                "link_s": o.link_s,
                "trainer_s": o.trainer_s,
                "fill_s": o.fill_s,
                "epoch_s": o.epoch_s,
                "bytes": o.bytes,
                "binding": o.binding,
                "chosen": o is self.chosen,
            }
            for o in self.options
        ]

    def explain(self, *, limit: int = 12) -> str:
        """The reason, then a table of the options (at most `limit`, the chosen always)."""
        shown = list(self.options[:limit])
        if self.chosen not in shown:
            shown.append(self.chosen)
        header = f"  {'option':<28} {'server':>8} {'link':>8} {'trainer':>8} {'epoch':>8}  bytes"
        lines = [self.reason]
        if not self.reason.startswith(f"{self.codec} features"):
            lines.append(f"features cross as {self.codec}")
        lines.append(header)
        for o in shown:
            mark = "*" if o is self.chosen else " "
            lines.append(
                f"{mark} {o.label:<28} {o.server_s:>7.2f}s {o.link_s:>7.2f}s "
                f"{o.trainer_s:>7.2f}s {o.epoch_s:>7.2f}s  {_size(o.bytes)}"
            )
        hidden = len(self.options) - len(shown)
        if hidden > 0:
            lines.append(f"  ... {hidden} slower options")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe summary for the job's history: the choice and the option table."""
        return {
            "cut": self.cut,
            "share": self.share,
            "epoch_s": self.epoch_s,
            "binding": self.binding,
            "reason": self.reason,
            "codec": self.codec,
            "options": self.rows(),
        }


def _size(n: float) -> str:
    units = ("B", "KB", "MB", "GB")
    i = 0
    while n >= 1000 and i < len(units) - 1:
        n /= 1000
        i += 1
    return f"{n:.0f} B" if i == 0 else f"{n:.1f} {units[i]}"
