"""What a user waits for: a whole training script's wall time, planning included.

`plan.py` measures steady-state epochs; a user waits for the whole process - importing
torch, building the model, measuring the plan, every epoch. Each run here is its own
trainer process running a user's script (build a `TransferJob`, `fit(2)`, exit), timed
from its start to its exit, on a real shaped link: `hapi serve` (on a local store of
~90 KB photo-like JPEGs) in one network namespace on core 0, the trainer in another on
core 1, one torch thread each, joined by a veth shaped with `tc tbf` (root only).

Every run meets a server just started (no head loaded, nothing profiled). Options,
interleaved in each repeat in a rotated order:
- `auto cold`: `cut="auto"` with nothing measured before - an empty profile cache;
- `auto warm`: `cut="auto"` after another job on the same model (the server's profile
  and the trainer's kept profile are reused; the link is measured again);
- `freeze cut`, `RAW`: the two fixed options a user would otherwise pick;
- `peer`: what a user writes without hapi (`peer.py`'s): a PyTorch DataLoader whose 4
  workers GET each object over HTTP/1.1 from a file server beside the store (on the
  server's core), torchvision's transforms, ResNet-18 training `fc`.

    python benchmarks/startup.py                 # writes benchmarks/out/startup.{json,png}
    python benchmarks/startup.py --results       # ... and its section of benchmarks/RESULTS.md

Goal (issue 37, item 9): `auto cold` within 1.05x of the best fixed option at every rate,
and never slower than the peer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _host import machine, pin
from _results import DETAILS, write_section
from peer import _FileServer
from plan import Stage

HERE = Path(__file__).resolve().parent
OPTIONS = ("auto cold", "auto warm", "freeze cut", "RAW", "peer")
_PHASES = ("start_s", "build_s", "fit_s", "exit_s")
"""A hapi script's wall time in parts: the interpreter's start (torch imported), the job
built, `fit`, the interpreter's exit."""
GOAL = 1.05
"""`auto cold` over the best fixed option's whole script, at most."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="10mbit,100mbit,1gbit")
    parser.add_argument("--images", type=int, default=220)
    parser.add_argument("--classes", type=int, default=4)
    parser.add_argument("--stored-size", type=int, default=420, help="side of the stored JPEGs")
    parser.add_argument("--image-size", type=int, default=112)
    parser.add_argument("--freeze", default="avgpool+flatten")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=HERE / "out")
    parser.add_argument("--results", action="store_true", help="write benchmarks/RESULTS.md")
    parser.add_argument("--from-json", type=Path, help="report a saved run's startup.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one user's script
    args = parser.parse_args()
    if args.worker:
        _script(json.loads(args.worker))
        return
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        kept = {"out": args.out, "results": args.results, "from_json": args.from_json}
        _finish(saved, argparse.Namespace(**{**vars(args), **saved["args"], **kept}))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    started, load_before = time.time(), os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory(prefix="hapi-startup-") as root:
        object_bytes, keys, labels = _make_dataset(root, args)
        rates = args.rates.split(",")
        with (
            Stage(root, rates[0], argparse.Namespace(shaping="netns")) as stage,
            _FileServer(root, stage) as files,
        ):
            for rate in rates:
                stage.set_rate(rate)
                rows.append(_rate(stage, files, (keys, labels), rate, args))
                print(json.dumps(_summary(rows[-1])), flush=True)
    result = {
        "machine": machine(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "mean_object_bytes": object_bytes,
        "minutes": (time.time() - started) / 60,
        "load_average": {"before": load_before, "after": os.getloadavg()[0]},
        "rates": rows,
    }
    (args.out / "startup.json").write_text(json.dumps(result, indent=2))
    _finish(result, args)


def _finish(result: dict, args: argparse.Namespace) -> None:
    """The plot, the report, and with `--results` its section of RESULTS.md."""
    rows = result["rates"]
    args.out.mkdir(parents=True, exist_ok=True)
    _plot(rows, args.out / "startup.png")
    text = _report(rows, args, result["mean_object_bytes"], result.get("load_average"))
    print(text)
    if args.results:
        write_section("startup", text)


def _flags(args: argparse.Namespace) -> str:
    """The options a run was given beyond the defaults, as its command line's."""
    defaults = {"rates": "10mbit,100mbit,1gbit", "images": 220, "image_size": 112, "repeats": 2}
    return "".join(
        f" --{name.replace('_', '-')} {getattr(args, name)}"
        for name, default in defaults.items()
        if getattr(args, name) != default
    )


def _rate(
    stage: Stage,
    files: _FileServer,
    dataset: tuple[list[str], list[int]],
    rate: str,
    args: argparse.Namespace,
) -> dict:
    job = {
        "freeze": args.freeze, "image_size": args.image_size, "classes": args.classes,
        "epochs": args.epochs,
    }  # fmt: skip
    peer_job = {
        "base": files.base, "keys": dataset[0], "labels": dataset[1],
        "image_size": args.image_size, "batch_size": 32, "classes": args.classes,
        "epochs": args.epochs, "workers": 4,
    }  # fmt: skip
    runs: dict[str, list[dict]] = {name: [] for name in OPTIONS}
    for r in range(args.repeats):
        for name in OPTIONS[r % len(OPTIONS) :] + OPTIONS[: r % len(OPTIONS)]:
            with tempfile.TemporaryDirectory(prefix="hapi-cache-") as cache:
                # Every run meets a server just started - no head loaded, nothing profiled -
                # so each pays the same cold server, and `auto cold` has nothing measured.
                stage._stop()
                stage._start()
                if name == "auto warm":  # another job on the same model came first
                    _run(stage, {**job, "option": "auto"}, cache)
                if name == "peer":
                    runs[name].append(_run(stage, peer_job, cache, script=HERE / "peer.py"))
                else:
                    runs[name].append(_run(stage, {**job, "option": name}, cache))
    return {"rate": rate, "runs": runs}


def _run(stage: Stage, job: dict, cache: str, script: Path = Path(__file__)) -> dict:
    """One user's script in the trainer's namespace on the trainer's core, timed whole."""
    assert stage.link is not None
    cmd = stage.link.trainer_cmd(
        [sys.executable, str(script), "--worker", json.dumps({**job, "address": stage.address})]
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HAPI_CACHE_DIR": cache}
    launched = time.time()
    done = subprocess.run(
        cmd, capture_output=True, text=True, env=env, preexec_fn=lambda: pin(1), check=False
    )
    exited = time.time()
    if done.returncode != 0:
        raise RuntimeError(f"the script failed: {done.stderr[-2000:]}")
    run = {"wall_s": exited - launched, **json.loads(done.stdout.strip().splitlines()[-1])}
    if "started" in run:  # the interpreter's start and exit, which the script's clock misses
        run["start_s"], run["exit_s"] = run.pop("started") - launched, exited - run.pop("ended")
    return run


def _script(spec: dict) -> None:
    """A user's script: a job, two epochs, done."""
    started, t0 = time.time(), time.perf_counter()
    import torch

    from hapi import TransferJob

    torch.set_num_threads(1)
    option = spec["option"]
    fixed: dict[str, Any] = {}
    if option == "freeze cut":
        fixed = {"cut": None}
    elif option == "RAW":
        fixed = {"cut": -1}
    job = TransferJob(
        {"name": "resnet18", "num_classes": spec["classes"]},
        "train",
        spec["address"],
        freeze=spec["freeze"],
        image_size=spec["image_size"],
        batch_size=32,
        **fixed,
    )
    built = time.perf_counter()
    job.fit(spec["epochs"], lr=0.01)
    end = time.perf_counter()
    epochs = [e.seconds for e in job.history.epochs]
    plan = job.history.of_kind("plan")
    print(
        json.dumps(
            {
                "started": started,
                "ended": started + time.perf_counter() - t0,
                "build_s": built - t0,
                "fit_s": end - built,
                "epochs_s": epochs,
                # What `fit` spent before its first epoch: measuring the plan, opening sessions.
                "before_epochs_s": end - built - sum(epochs),
                "cut": job.history.epochs[-1].cut,
                "share": job.history.epochs[-1].share,
                "plan": plan[0].message if plan else None,
                "replans": len(job.history.plan_changes),
                "events": [
                    [e.kind, e.epoch, e.chunk, e.message]
                    for e in job.history.events
                    if e.kind in ("plan", "plan-deferred", "replan")
                ],
            }
        )
    )


def _summary(row: dict) -> dict:
    return {
        "rate": row["rate"],
        "wall_s": {k: round(_median(v, "wall_s"), 2) for k, v in row["runs"].items()},
    }


def _median(runs: list[dict], field: str) -> float:
    return statistics.median(r[field] for r in runs)


def _report(
    rows: list[dict], args: argparse.Namespace, object_bytes: float, load: dict | None
) -> str:
    cold = [_cold_ratio(row["runs"]) for row in rows]
    met = sum(r <= GOAL for r in cold)
    peer = [_median(row["runs"]["auto cold"], "wall_s") / _median(row["runs"]["peer"], "wall_s")
            for row in rows if row["runs"].get("peer")]  # fmt: skip
    lines = [
        "## What a user waits for: a whole script, planning included",
        "",
        f"`python benchmarks/startup.py{_flags(args)}{' --results' if args.results else ''}` on "
        f"{machine()}: ResNet-18 at {args.image_size} px frozen to `{args.freeze}`, "
        f"{args.images} photos of {object_bytes / 1e3:.0f} KB, {args.epochs} epochs, server "
        "and trainer pinned to a core each across a `tc tbf` veth; each run a new process, "
        f"timed from start to exit; medians of {args.repeats} repeats, options interleaved; "
        "the peer: a PyTorch DataLoader (4 workers) GETting the objects over HTTP from a file "
        "server beside the store"
        + (
            f"; load average {load['before']:.1f} before, {load['after']:.1f} after (2 shared "
            "cores: other jobs ran beside it)."
            if load
            else "."
        ),
        "",
        f"Goal: `auto cold` within {GOAL:.2f}x of the best fixed option at every rate - "
        f"met at {met} of {len(rows)} ({', '.join(f'{r:.2f}x' for r in cold)})"
        + (
            f"; never slower than the peer - met at {sum(r <= 1 for r in peer)} of {len(peer)} "
            f"({', '.join(f'{r:.2f}x' for r in peer)})."
            if peer
            else "."
        ),
        "",
        "| link | auto cold | auto warm | freeze cut | RAW | peer | cold / best fixed "
        "| cold / peer | warm / best fixed | cold: before epoch 1 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        runs = row["runs"]
        wall = {k: _median(v, "wall_s") if v else float("nan") for k, v in runs.items()}
        best = min(wall["freeze cut"], wall["RAW"])
        lines.append(
            f"| {row['rate']} | {wall['auto cold']:.1f} s | {wall['auto warm']:.1f} s "
            f"| {wall['freeze cut']:.1f} s | {wall['RAW']:.1f} s | {wall.get('peer', 0):.1f} s "
            f"| {wall['auto cold'] / best:.2f}x | {wall['auto cold'] / wall.get('peer', 1):.2f}x "
            f"| {wall['auto warm'] / best:.2f}x "
            f"| {_median(runs['auto cold'], 'before_epochs_s'):.1f} s |"
        )
    lines += ["", "![whole run per option and link](out/startup.png)", DETAILS]
    lines += ["The plans `auto` ran (last epoch's cut and share, the run's whole script and "
              "its re-plans):", ""]  # fmt: skip
    for row in rows:
        for name in OPTIONS[:2]:
            chosen = ", ".join(_choice(r) for r in row["runs"][name])
            lines.append(f"- {row['rate']}, {name}: {chosen}")
    lines += [
        "",
        "Where each script's time went (medians): the interpreter's start with torch "
        "imported, the job built (hapi imported), `fit`, and the interpreter's exit:",
        "",
    ]
    for row in rows:
        for name, runs in row["runs"].items():
            if runs and "exit_s" in runs[0]:
                parts = [f"{_median(runs, f):.2f}" for f in _PHASES]
                lines.append(f"- {row['rate']}, {name}: {' + '.join(parts)} s")
    return "\n".join(lines)


def _cold_ratio(runs: dict[str, list[dict]]) -> float:
    """`auto cold`'s median whole script over the best fixed option's."""
    best = min(_median(runs["freeze cut"], "wall_s"), _median(runs["RAW"], "wall_s"))
    return _median(runs["auto cold"], "wall_s") / best


def _choice(run: dict) -> str:
    cut = "RAW" if run["cut"] == -1 else run["cut"]
    return f"{cut}+{run['share']:.0%} ({run['wall_s']:.1f} s, {run['replans']} re-plans)"


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(OPTIONS)
    for i, name in enumerate(OPTIONS):
        walls = [_median(row["runs"][name], "wall_s") if row["runs"].get(name) else 0.0
                 for row in rows]  # fmt: skip
        xs = [j + (i - (len(OPTIONS) - 1) / 2) * width for j in range(len(rows))]
        ax.bar(xs, walls, width, label=name)
    ax.set_xticks(range(len(rows)), [row["rate"] for row in rows])
    ax.set_ylabel("whole script, s (median)")
    ax.set_title("a user's script: ResNet-18, 2 epochs, planning included", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _make_dataset(root: str, args: argparse.Namespace) -> tuple[float, list[str], list[int]]:
    """The photo-like JPEGs: their mean size in bytes, their keys and labels (the peer's)."""
    from hapi.data import open_store, synth_dataset

    manifest = synth_dataset(
        open_store(root), "train", classes=args.classes,
        per_class=max(1, args.images // args.classes), size=args.stored_size, seed=0, quality=90,
    )  # fmt: skip
    sizes = [p.stat().st_size for p in Path(root, "train").rglob("*.jpg")]
    return statistics.mean(sizes), list(manifest.keys), list(manifest.labels)


if __name__ == "__main__":
    main()
