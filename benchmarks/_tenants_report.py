"""The tenants benchmark's report: the medians, the fairness index, the table and the plot."""

from __future__ import annotations

import argparse
import os
import platform
from pathlib import Path
from typing import Any

MiB = 1 << 20


def _median_row(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The round of median throughput, with failures and peaks over every round."""
    ordered = sorted(rounds, key=lambda r: r["samples_per_s"])
    row = dict(ordered[len(ordered) // 2])
    row["rounds"] = len(rounds)
    row["spread"] = (ordered[-1]["samples_per_s"] - ordered[0]["samples_per_s"]) / max(
        row["samples_per_s"], 1e-9
    )
    row["errors"] = sum(r["errors"] for r in rounds)
    row["oom_kills"] = sum(r["oom_kills"] or 0 for r in rounds)
    row["killed"] = sum(1 for r in rounds if (r["server_exit"] or 0) < 0)
    for name in ("peak_rss", "peak_charged"):
        row[name] = max(r[name] for r in rounds)
    tracked = [r["tracked_peak"] for r in rounds if r["tracked_peak"] is not None]
    row["tracked_peak"] = max(tracked) if tracked else None
    return row


def _jain(values: list[float]) -> float:
    total = sum(values)
    squares = sum(v * v for v in values)
    return total * total / (len(values) * squares) if squares else 0.0


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MiB:.0f}"


def _table(
    rows: list[dict[str, Any]],
    sizes: dict[str, Any],
    cold: dict[str, Any],
    args: argparse.Namespace,
) -> str:
    lines = [
        "## Many jobs on one server under a memory cap",
        "",
        f"`python benchmarks/tenants.py --results` on {platform.machine()}, "
        f"{len(os.sched_getaffinity(0))} cores, no GPU, Python {platform.python_version()}. "
        f"{args.model} frozen to `{args.freeze}` at {args.image_size} px, JPEGs stored at "
        f"{args.stored_size} px; chunks of {args.chunk} keys, {args.in_flight} in flight per "
        f"job, server batch up to {args.batch_size}; {args.seconds:.0f} s measured after "
        f"{args.warmup:.0f} s. The server runs in a memory cgroup capped at what one warm "
        f"job made it use ({_mib(sizes['warm'])} MiB, the cgroup's peak charge) plus two "
        f"batches of activations = {_mib(sizes['cap'])} MiB, on one core with one torch "
        f"thread; the budget is the cap less the idle server's charge "
        f"({_mib(sizes['idle'])} MiB) and 96 MiB: {_mib(sizes['budget'])} MiB. `fixed` = no "
        "adaptation (unbounded budget, a compute slot per chunk); `adaptive4` = four compute "
        "slots, so the budget binds and batches shrink. Jain's index over per-job "
        "samples/s (per weight for `weights`); each run is the median of "
        f"{args.repeat} interleaved rounds (spread: max - min over median; the machine is "
        "shared), failures and peaks over all rounds. Peak charged: the cgroup's "
        "`memory.max_usage_in_bytes`; peak anon RSS: the server's `RssAnon`, sampled every "
        "0.1 s; a peak charge at the cap without an OOM kill is the kernel reclaiming page "
        "cache (the dataset's files) to stay under it. Data: `out/tenants.json`.",
        "",
        "| run | jobs | samples/s (spread) | vs alone | Jain | 2:1 ratio | mean batch "
        "| failed requests "
        "| OOM kills "
        "| peak charged MiB | peak anon RSS MiB | cap MiB | scheduler's peak MiB | budget MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
        vs = f"{r['vs_alone']:.2f}x" if r.get("vs_alone") is not None else "-"
        budget = "unbounded" if r["budget"] >= 1 << 40 else _mib(r["budget"])
        killed = f"{r['oom_kills']} in {r['rounds']} rounds"
        lines.append(
            f"| {r['run']} | {r['jobs']} | {r['samples_per_s']:.1f} ({r['spread']:.0%}) | {vs} "
            f"| {r['jain']:.3f} | {ratio} | {r['mean_batch']:.1f} | {r['errors']} | {killed} "
            f"| {_mib(r['peak_charged'])} "
            f"| {_mib(r['peak_rss'])} | {_mib(r['cap'])} "
            f"| {_mib(r['tracked_peak'])} | {budget} |"
        )
    lines += [
        "",
        f"Cold opens: {cold['trials']} rounds of 8 sessions opened at the same moment on "
        "models the server had not traced (resnet18 and mobilenet_v3_small at a new input "
        "size each round), while another session streamed: "
        f"{cold['failures']} failures in {cold['opens']} opens.",
        "",
        "![throughput and memory per run](out/tenants.png)",
    ]
    return "\n".join(lines)


def _plot(rows: list[dict[str, Any]], sizes: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["run"] for r in rows]
    left.bar(names, [r["samples_per_s"] for r in rows], color="tab:blue")
    left.set_ylabel("aggregate samples/s")
    left.set_title("throughput")
    right.bar(names, [r["peak_charged"] / MiB for r in rows], color="tab:orange")
    right.axhline(sizes["cap"] / MiB, color="red", linestyle="--", label="cgroup cap")
    right.set_ylabel("server's cgroup, peak charge (MiB)")
    right.set_title("memory")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
