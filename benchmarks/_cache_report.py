"""The feature cache benchmark's report: the RESULTS.md section, its goals and the plot."""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

FINE_TUNE = ("hapi cache", "hapi no cache", "peer")
ACCURACY = ("augment=False", "views=2", "views=4", "fresh augmentation")


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _epoch_s(runs: list[dict], i: int) -> float:
    return _median([r["epochs"][i]["seconds"] for r in runs])


def _fine_tune_summary(row: dict) -> dict:
    return {
        "rate": row["rate"],
        "wall_s": {k: round(_median([r["wall_s"] for r in v]), 2) for k, v in row["runs"].items()},
    }


def _report(result: dict, args: argparse.Namespace) -> str:
    kb = result["mean_object_bytes"] / 1e3
    lines = [
        "## The feature cache: later epochs and later jobs",
        "",
        f"`{_command(args)}` on {result['machine']}; {args.images} photo-like JPEGs of "
        f"{kb:.0f} KB, ResNet-18 at {args.image_size} px frozen to `avgpool+flatten`, "
        "`augment=False`, batch 32; server and trainer pinned to a core each (one torch "
        "thread) in two network namespaces joined by a veth shaped with `tc tbf`. Every "
        "run is a new process timed from its start to its exit. Data in `out/cache.json`.",
    ]
    if "fine_tune" in result:
        lines += _report_fine_tune(result["fine_tune"], args)
    if "views" in result:
        lines += ["", "Samples from the trainer's cache per epoch (`cut=None`, "
                  f"{args.sweep_rate}):", ""]  # fmt: skip
        for name, run in result["views"]["runs"].items():
            why = next((s for s in run["summary"].splitlines() if "cache" in s), "")
            lines.append(
                f"- {name}: {[e['cached'] for e in run['epochs']]} of "
                f"{run['epochs'][0]['samples']}; epoch s "
                f'{[round(e["seconds"], 1) for e in run["epochs"]]}; summary: "{why}"'
            )
    if "sweep" in result:
        lines += _report_sweep(result["sweep"], args)
    if "accuracy" in result:
        lines += _report_accuracy(result["accuracy"], args)
    lines += _goals(result)
    lines += ["", "![per-epoch time, cache on and off, and the peer](out/cache.png)"]
    return "\n".join(lines)


def _report_fine_tune(rows: list[dict], args: argparse.Namespace) -> list[str]:
    n = args.epochs
    lines = [
        "",
        f"A {n}-epoch fine-tune (medians of {args.repeats} interleaved repeats; hapi "
        '`cut="auto"` with the profiles a job before kept, each run an empty feature '
        f"cache; the peer with {args.workers} DataLoader workers). Epoch 1 / slowest later: "
        f"epoch 1's time over the slowest of epochs 2-{n}'s; later epochs' feature bytes: "
        "the most any run's epochs 2-5 received (`EpochStats.bytes_received`); link bytes: "
        "what the trainer's veth received over the whole run.",
        "",
        "| link | option | epoch 1 s | epochs 2-5 s | epoch 1 / slowest later | later epochs' "
        "feature bytes | link bytes (run) | whole run s | / peer |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        runs = row["runs"]
        peer_wall = _median([r["wall_s"] for r in runs["peer"]])
        for name in FINE_TUNE:
            rs = runs[name]
            wall = _median([r["wall_s"] for r in rs])
            link = _median([r["link_bytes"] for r in rs]) / 1e6
            if name == "peer":
                extract = _median([r["extract_s"] for r in rs])
                train = [_median([r["train_epochs_s"][i] for r in rs]) for i in range(n)]
                lines.append(
                    f"| {row['rate']} | peer | {extract:.1f} (extract) + {train[0]:.3f} "
                    f"| {' / '.join(f'{t:.3f}' for t in train[1:])} | - | - "
                    f"| {link:.1f} MB | {wall:.1f} | 1.00x |"
                )
                continue
            first = _epoch_s(rs, 0)
            later = [_epoch_s(rs, i) for i in range(1, n)]
            later_bytes = max(sum(e["bytes"] for e in r["epochs"][1:]) for r in rs)
            lines.append(
                f"| {row['rate']} | {name} | {first:.1f} "
                f"| {' / '.join(f'{t:.2f}' for t in later)} | {first / max(later):.0f}x "
                f"| {later_bytes:,} | {link:.1f} MB | {wall:.1f} | {wall / peer_wall:.2f}x |"
            )
    plans = {
        row["rate"]: sorted({_plan(r["epochs"][0]) for r in row["runs"]["hapi cache"]})
        for row in rows
    }
    lines += ["", "hapi's plans (epoch 1's cut + local share): "
              + "; ".join(f"{k}: {', '.join(v)}" for k, v in plans.items())]  # fmt: skip
    return lines


def _plan(epoch: dict) -> str:
    return f"{'RAW' if epoch['cut'] == -1 else epoch['cut']}+{epoch['share']:.0%}"


def _report_sweep(sweep: dict, args: argparse.Namespace) -> list[str]:
    after = sweep["server_after"]
    head = [a["head_s"] for a in after]
    cache = after[-1].get("feature_cache") or {}
    per_job = [
        f"{j['epochs'][0]['server_cached']}/{j['epochs'][0]['samples']}" for j in sweep["jobs"]
    ]
    walls = [f"{j['wall_s']:.1f}" for j in sweep["jobs"]]
    return [
        "",
        f"A learning-rate sweep ({', '.join(map(str, sweep['lrs']))}): four jobs of "
        f"{args.epochs} epochs one after another, `cut=None` (the whole head on the server), "
        f"each with its own trainer cache, against one server with `--feature-cache`, "
        f"{args.sweep_rate}. The server's head seconds (`stats()`, every session's "
        f"`head_s`) after each job: {', '.join(f'{h:.2f}' for h in head)} - the sweep "
        f"**{head[-1] / head[0]:.2f}x** one job's (4x without the cache; one job on a server "
        f"without it, beside: {sweep['server_alone']['head_s']:.2f} s). Epoch 1's samples "
        f"from the server's cache, per job: {', '.join(per_job)}; its counters: "
        f"{cache.get('hits', 0)} hits, {cache.get('misses', 0)} misses, "
        f"{cache.get('writes', 0)} writes, {cache.get('bytes_held', 0) / 1e6:.1f} MB held. "
        f"Whole job s: {', '.join(walls)} (one job without the server's cache: "
        f"{sweep['one']['wall_s']:.1f}).",
    ]


def _goals(result: dict) -> list[str]:
    """The issue's goals against this run's figures."""
    lines = ["", "Goals (issue 39):", ""]
    rows = {row["rate"]: row["runs"] for row in result.get("fine_tune", [])}
    if "10mbit" in rows:
        cached = rows["10mbit"]["hapi cache"]
        n = len(cached[0]["epochs"])
        ratio = _epoch_s(cached, 0) / max(_epoch_s(cached, i) for i in range(1, n))
        moved = max(sum(e["bytes"] for e in r["epochs"][1:]) for r in cached)
        link = max(r["after_first_link_bytes"] for r in cached)
        lines.append(
            f"- epochs 2-{n} at 10 Mbit/s: {moved} feature bytes (the link carried at most "
            f"{link:,} bytes after epoch 1 ended: control messages, each epoch's listing of "
            f"the objects' versions), the slowest {ratio:.0f}x faster than epoch 1 "
            f"(goal: 0 bytes, >= 10x): {'met' if moved == 0 and ratio >= 10 else 'NOT met'}"
        )
    for rate, goal, ok in (("1gbit", "<= 1.1x", 1.1), ("10mbit", "< 1x", 1.0)):
        if rate in rows:
            hapi = _median([r["wall_s"] for r in rows[rate]["hapi cache"]])
            peer = _median([r["wall_s"] for r in rows[rate]["peer"]])
            met = hapi / peer <= ok if ok > 1 else hapi / peer < ok
            lines.append(
                f"- the whole {len(rows[rate]['hapi cache'][0]['epochs'])}-epoch run against "
                f"the embeddings-once peer at {rate}: {hapi:.1f} s / {peer:.1f} s = "
                f"{hapi / peer:.2f}x (goal {goal}): {'met' if met else 'NOT met'}"
            )
    if "sweep" in result:
        head = [a["head_s"] for a in result["sweep"]["server_after"]]
        ratio = head[-1] / head[0]
        lines.append(
            f"- a four-job sweep's server head seconds: {ratio:.2f}x one job's (goal <= 1.1x): "
            f"{'met' if ratio <= 1.1 else 'NOT met'}"
        )
    return lines


def _report_accuracy(acc: dict, args: argparse.Namespace) -> list[str]:
    lines = [
        "",
        f"The demo's task (`{acc['model']}` with its ImageNet weights, a linear probe "
        f"(freeze {acc['freeze']}), 4 classes of 48 synthetic training images, 64 to "
        f"evaluate, 112 px), {args.accuracy_epochs} epochs, seeds 0-{args.accuracy_seeds - 1}, "
        "in one process on loopback: evaluation accuracy after the last epoch (one image "
        "of 64 is 1.6 points).",
        "",
        "| transforms | mean accuracy | per seed | epochs computed (not cached) |",
        "|---|---|---|---|",
    ]
    for name in ACCURACY:
        runs = acc["runs"][name]
        seeds = [f"{r['accuracy']:.1%}" for r in runs]
        computed = statistics.median(sum(1 for c in r["cached"] if c == 0) for r in runs)
        lines.append(f"| {name} | {acc['final'][name]:.1%} | {', '.join(seeds)} | {computed:.0f} |")
    return lines


def _command(args: argparse.Namespace) -> str:
    parts = ["python benchmarks/cache.py --results"]
    defaults = {
        "parts": "fine-tune,sweep,views,accuracy", "rates": "10mbit,1gbit", "images": 128,
        "repeats": 3, "epochs": 5, "accuracy_epochs": 8, "accuracy_seeds": 2,
    }  # fmt: skip
    for name, default in defaults.items():
        value = getattr(args, name)
        if value != default:
            parts.append(f"--{name.replace('_', '-')} {value}")
    return " ".join(parts)


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result.get("fine_tune", [])
    fig, axes = plt.subplots(1, max(1, len(rows)), figsize=(4.2 * max(1, len(rows)), 3.4))
    axes = axes if len(rows) > 1 else [axes]
    for ax, row in zip(axes, rows, strict=False):
        runs = row["runs"]
        n = len(runs["hapi cache"][0]["epochs"])
        xs = range(1, n + 1)
        for name in ("hapi cache", "hapi no cache"):
            ax.plot(xs, [_epoch_s(runs[name], i) for i in range(n)], marker="o", label=name)
        peer = runs["peer"]
        extract = _median([r["extract_s"] for r in peer])
        train = [_median([r["train_epochs_s"][i] for r in peer]) for i in range(n)]
        ax.plot(xs, [extract + train[0], *train[1:]], marker="s", label="peer (extract once)")
        ax.set_yscale("log")
        ax.set_xticks(list(xs))
        ax.set_xlabel("epoch")
        ax.set_title(f"{row['rate']}", fontsize=9)
    if rows:
        axes[0].set_ylabel("epoch s (median, log)")
        axes[0].legend(fontsize=7)
    fig.suptitle("ResNet-18 to avgpool+flatten, augment=False: time per epoch", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
