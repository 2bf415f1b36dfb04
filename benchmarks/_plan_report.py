"""The planner benchmark's report: its summary figures, the RESULTS.md section and the plot."""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from _host import machine
from _plan_worker import PREFETCH, measured_epoch


def _summary(config: dict) -> dict:
    return {
        "rate": config["rate"],
        "model": config["model"],
        "freeze": config["freeze"],
        "plan": [config["plan"]["cut"], config["plan"]["share"]],
        "medians": {k: round(median_epoch(v), 3) for k, v in config["runs"].items()},
    }


def median_epoch(runs: list[dict]) -> float:
    """The median epoch time of an option's repeats."""
    return statistics.median(r["epoch_s"] for r in runs)


def bound_ratio(run: dict) -> float | None:
    """Epoch / pipeline bound: the slowest stage's busy time as the job measured it
    (server, link, trainer); None where no stage was measured."""
    bound = max(run["server_s"], run["transfer_s"], run["trainer_s"])
    return run["epoch_s"] / bound if bound > 0 else None


def ends_bound_ratio(run: dict, steps: int) -> float | None:
    """Epoch / the pipeline bound with the ends no pipeline overlaps, for an epoch of
    `steps` training steps: the trainer's first step waits for the first batch to be
    computed and carried, and the last step starts only after the last has been, so a
    pure option's epoch is at least max(feed / steps + trainer, feed + trainer / steps),
    feed the slower of the server and the link. With two stages balanced over 8 steps
    that is 1.125x the slowest alone. A hybrid's first chunk is local and needs no
    server; its ends are not charged (the slowest stage alone), nor an epoch's that ran
    behind the one before it (`steps` 0: its fill overlapped that one's drain). None
    where no stage was measured."""
    server, link, trainer = run["server_s"], run["transfer_s"], run["trainer_s"]
    bound = max(server, link, trainer)
    if run["share"] == 0.0 and steps > 0:
        feed = max(server, link)
        bound = max(bound, feed / steps + trainer, feed + trainer / steps)
    return run["epoch_s"] / bound if bound > 0 else None


def _spread(runs: list[dict]) -> float:
    times = [r["epoch_s"] for r in runs]
    return (max(times) - min(times)) / statistics.median(times)


def _measured(epochs: int) -> str:
    at = measured_epoch(epochs) + 1
    ahead = " (fetched behind the one before, fetching the next)" if at < epochs else ""
    return f"epoch {at} of {epochs} measured{ahead}"


def _report(configs: list[dict], change: dict | None, args: argparse.Namespace) -> str:
    lines = [
        f"## The planner against brute force: {args.models.replace(',', ', ')} at "
        f"{args.rates.replace(',', ', ')}, {args.images}-image epochs",
        "",
        f"`{_command(args)}` on {machine()}; "
        f"models at "
        f"{args.image_size} px, {args.images} photo-like JPEGs of ~100 KB ({args.stored_size} "
        f"px, quality 90), batch {args.batch_size}, chunks of {args.chunk_size}, "
        f"{args.prefetch} in flight; server and trainer two processes pinned to one core "
        f"each, the link {'tc tbf on a veth between two network namespaces' if args.shaping == 'netns' else 'the server egress limit'}; "  # noqa: E501
        f"{_measured(args.epochs)}, median of {args.repeats} "
        "interleaved repeats (spread = (max - min) / median of the plan's runs). `auto` is a "
        'job with `cut="auto"` planning and re-planning itself; `best` the fastest option '
        "measured; worst epoch / bound: the option furthest from its pipeline bound (its "
        f"slowest stage's busy time as the job measured it). Data in `out/{args.name}.json`.",
        "",
        "| link | model | freeze | plan (auto) | auto s | spread | best option | best s "
        "| regret | vs RAW | vs freeze cut | best hybrid / best pure | worst epoch / bound |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    within = regrets = chosen_within = chosen_regrets = 0.0
    for c in configs:
        runs = c["runs"]
        auto = median_epoch(runs["auto"])
        fixed = {k: median_epoch(v) for k, v in runs.items() if k != "auto"}
        best_label = min(fixed, key=fixed.__getitem__)
        best = min(fixed[best_label], auto)
        regret = auto / best - 1
        within += regret <= 0.05
        regrets += max(regret, 0.0)
        # The plan's choice run as a fixed option, beside the others in the same rounds:
        # the choice alone, without the `auto` job's own re-planning and its own runs.
        chosen = fixed.get(f"{c['plan']['cut']}:{c['plan']['share']}")
        if chosen is not None:
            chosen_regret = chosen / fixed[best_label] - 1
            chosen_within += chosen_regret <= 0.05
            chosen_regrets += chosen_regret
        raw = fixed.get("-1:0.0")
        freeze_cut = max(int(k.split(":")[0]) for k in fixed if k.endswith(":0.0"))
        at_freeze = fixed.get(f"{freeze_cut}:0.0")
        hybrids = [v for k, v in fixed.items() if not k.endswith(":0.0")]
        pures = [v for k, v in fixed.items() if k.endswith(":0.0")]
        auto_plan = runs["auto"][0]["plan"]
        lines.append(
            f"| {c['rate']} | {c.get('model', '')} | {c['freeze']} "
            f"| {_label(auto_plan['cut'], auto_plan['share'])} "
            f"| {auto:.2f} | {_spread(runs['auto']):.0%} | {_label_key(best_label)} "
            f"| {fixed[best_label]:.2f} | {regret:+.1%} "
            f"| {_times(raw, auto)} | {_times(at_freeze, auto)} "
            f"| {_times(min(pures), min(hybrids) if hybrids else None)} "
            f"| {_worst_to_bound(runs):.2f} |"
        )
    n = len(configs)
    lines += [
        "",
        f"Plans within 5% of the best measured option: **{within / n:.0%}** ({int(within)} of "
        f"{n}); mean regret **{regrets / n:.1%}** (negative regrets, where `auto` beat every "
        "fixed option, counted as 0). The plan's choice run as a fixed option, in the same "
        f"interleaved rounds as the others: within 5% in **{int(chosen_within)} of {n}**, mean "
        f"regret **{chosen_regrets / n:.1%}**.",
    ]
    if change is not None:
        runs = change["runs"]
        times = {k: statistics.median(v) for k, v in runs.items() if k != "auto changes"}
        after = times.get(f"plan for {change['to']}")
        auto = times.get("auto (re-plans)", 0.0)
        lines += [
            "",
            f"Link change mid-epoch ({change['from']} -> {change['to']} at half of the "
            f"measured epoch, {change.get('images', args.images)} images, freeze "
            f"`{change['freeze']}`), median epoch s: "
            + ", ".join(f"{k} {v:.2f}" for k, v in times.items())
            + (f"; auto / plan for {change['to']}: **{auto / after:.2f}x**" if after else "")
            + ". Re-plans in the measured epoch of each `auto` run: "
            + "; ".join(" / ".join(c) or "none" for c in runs.get("auto changes", [])),
        ]
    lines += ["", f"![predicted vs measured epoch per option](out/{args.name}.png)"]
    return "\n".join(lines)


def _times(slower: float | None, faster: float | None) -> str:
    """`slower / faster` as a speed-up, or "-" where either was not measured (no hybrid
    predicted within 3x of the fastest option)."""
    return f"{slower / faster:.2f}x" if slower and faster else "-"


def _worst_to_bound(runs: dict[str, list[dict]]) -> float:
    """The largest median epoch / pipeline bound over the options: the bound is the
    slowest stage's busy time as the job measured it (server, link, trainer)."""
    ratios = []
    for label, option_runs in runs.items():
        bounds = [b for b in map(bound_ratio, option_runs) if b is not None]
        if bounds and label != "auto":
            ratios.append(statistics.median(bounds))
    return max(ratios, default=float("nan"))


def _command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run (the options that differ from defaults)."""
    parts = ["python benchmarks/plan.py --results", f"--models {args.models}"]
    for name, default in (
        ("images", 128), ("image_size", 112), ("rates", "10mbit,100mbit,1gbit"), ("repeats", 3),
        ("chunk_size", 16), ("prefetch", PREFETCH), ("change_images", 512), ("name", "plan"),
        ("freezes", None), ("link_change", "1gbit:10mbit"),
    ):  # fmt: skip
        value = getattr(args, name, default)
        if value != default:
            parts.append(f"--{name.replace('_', '-')} {value}")
    return " ".join(parts)


def _label(cut: int, share: float) -> str:
    base = {-1: "RAW", 0: "INPUT"}.get(cut, f"cut {cut}")
    return f"{base} + {share:.0%} local" if share else base


def _label_key(key: str) -> str:
    cut, share = key.split(":")
    return _label(int(cut), float(share))


def _plot(configs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(6, len(configs))
    rows = -(-len(configs) // cols)
    # At least two columns wide, so that the title fits over a single configuration.
    width = 3.2 * max(cols, 2)
    fig, axes = plt.subplots(rows, cols, figsize=(width, 3.4 * rows), squeeze=False)
    for ax in axes.flat[len(configs) :]:
        ax.axis("off")
    for ax, c in zip(axes.flat, configs, strict=False):
        predicted = {(r["cut"], r["share"]): r["epoch_s"] for r in c["plan"]["options"]}
        for label, runs in c["runs"].items():
            if label == "auto":
                continue
            cut, share = label.split(":")
            x = predicted.get((int(cut), float(share)))
            if x is None:
                continue
            ax.scatter(
                x, median_epoch(runs), s=14, color="tab:orange" if float(share) else "tab:blue"
            )
        auto = median_epoch(c["runs"]["auto"])
        ax.axhline(auto, color="tab:red", linewidth=1, label="auto (measured)")
        top = max([*predicted.values(), auto]) * 1.1
        ax.plot([0, top], [0, top], color="gray", linestyle="--", linewidth=0.8)
        ax.set_title(f"{c['rate']}, {c.get('model', '')} to {c['freeze']}", fontsize=7)
        ax.set_xlabel("predicted s", fontsize=8)
        ax.set_ylabel("measured s", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("options: predicted vs measured epoch (blue pure, orange hybrid)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
