"""Wire codecs measured: real epochs through a shaped link, with codecs off and with the
planner choosing them.

`hapi serve` (a local store of photo-like JPEGs) runs in one network namespace on core 0,
the trainer in another on core 1, one torch thread each, joined by a veth shaped with
`tc tbf` (root only). Each run is its own trainer process: a `TransferJob` with
`cut="auto"`, `fit(epochs)`; its last epoch is reported (the first pays for the
sessions' opening). Options, interleaved in each repeat in a rotated order:
- `codecs off`: `wire_compression="none"` - the planner chooses the cut alone;
- `auto`: the default - the planner chooses a lossless compression with the cut;
- `auto + lossy`: `lossy_wire=True` - fp16, int8 and fp8 weighed too.

By default each repeat measures the pipeline once (a job with `lossy_wire=True`, which
measures every codec) and the three options' jobs plan from those kept profiles: their
plans then differ by the codec alone, not by where two measurements on shared cores put
the cut (`--profiles own`: each run measures its own, as a job does). The report gives
each plan's predicted binding stage and the machine's load average beside it. At
10 Mbit/s this CPU server's head to layer3 takes about as long as the link carries its
features, so 3 Mbit/s is measured too: a link that binds.

    python benchmarks/wire_epochs.py            # writes benchmarks/out/wire_epochs.{json,png}
    python benchmarks/wire_epochs.py --results  # ... and its section of benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _host import machine, pin
from _results import write_section
from plan import Stage

HERE = Path(__file__).resolve().parent
OPTIONS: dict[str, dict[str, object]] = {
    "codecs off": {"wire_compression": "none"},
    "auto": {},
    "auto + lossy": {"lossy_wire": True},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="3mbit,10mbit,1gbit")
    parser.add_argument("--images", type=int, default=160)
    parser.add_argument("--classes", type=int, default=4)
    parser.add_argument("--stored-size", type=int, default=420, help="side of the stored JPEGs")
    parser.add_argument("--image-size", type=int, default=112)
    parser.add_argument("--freeze", default="layer3")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--profiles", choices=("shared", "own"), default="shared",
        help="shared: a repeat's options plan from one measurement; own: each run measures",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=HERE / "out")
    parser.add_argument("--results", action="store_true", help="write benchmarks/RESULTS.md")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one trainer
    parser.add_argument("--report", action="store_true", help="rewrite the text from the JSON")
    args = parser.parse_args()
    if args.worker:
        _worker(json.loads(args.worker))
        return
    if args.report:  # the same run's figures, its text rewritten
        saved = json.loads((args.out / "wire_epochs.json").read_text())
        # A JSON from before `--profiles` was made with each run measuring its own.
        args = argparse.Namespace(
            **{**vars(args), "profiles": "own", **saved["args"], "results": args.results}
        )
        text = _report(saved, args)
        print(text)
        if args.results:
            write_section("wire-epochs", text)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    rows = []
    with tempfile.TemporaryDirectory(prefix="hapi-wire-epochs-") as root:
        jpeg = _make_dataset(root, args)
        rates = args.rates.split(",")
        with Stage(root, rates[0], argparse.Namespace(shaping="netns")) as stage:
            for rate in rates:
                stage.set_rate(rate)
                rows.append(_rate(stage, rate, args))
                print(json.dumps(_summary(rows[-1])), flush=True)
    result = {
        "machine": machine(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "mean_object_bytes": jpeg,
        "minutes": (time.time() - started) / 60,
        "rates": rows,
    }
    (args.out / "wire_epochs.json").write_text(json.dumps(result, indent=2))
    _plot(rows, args.out / "wire_epochs.png")
    text = _report(result, args)
    print(text)
    if args.results:
        write_section("wire-epochs", text)


def _rate(stage: Stage, rate: str, args: argparse.Namespace) -> dict:
    job = {
        "freeze": args.freeze, "image_size": args.image_size, "classes": args.classes,
        "epochs": args.epochs,
    }  # fmt: skip
    names = list(OPTIONS)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="hapi-profiles-") as kept:
            shared = args.profiles == "shared"
            if shared:  # every codec measured once, for the repeat's three plans
                measure = {**OPTIONS["auto + lossy"], "reuse_profiles": True}
                _run(stage, {**job, "options": measure, "plan_only": True}, kept)
            for name in names[r % len(names) :] + names[: r % len(names)]:
                options = {**OPTIONS[name], "reuse_profiles": shared}
                runs[name].append(_run(stage, {**job, "options": options}, kept))
    return {"rate": rate, "runs": runs}


def _run(stage: Stage, job: dict, kept: str) -> dict:
    """One trainer process in the trainer's namespace, on the trainer's core, with the
    profiles kept in `kept` (a fresh cache otherwise: no run reads another's features)."""
    assert stage.link is not None
    cmd = stage.link.trainer_cmd(
        [sys.executable, __file__, "--worker", json.dumps({**job, "address": stage.address})]
    )
    with tempfile.TemporaryDirectory(prefix="hapi-cache-") as cache:
        Path(kept).mkdir(exist_ok=True)
        os.symlink(kept, Path(cache) / "profiles")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HAPI_CACHE_DIR": cache}
        done = subprocess.run(
            cmd, capture_output=True, text=True, env=env, preexec_fn=lambda: pin(1), check=False
        )
    if done.returncode != 0:
        raise RuntimeError(f"the trainer failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _worker(spec: dict) -> None:
    import torch

    from hapi import TransferJob

    torch.set_num_threads(1)
    job = TransferJob(
        {"name": "resnet18", "num_classes": spec["classes"]},
        "train",
        spec["address"],
        freeze=spec["freeze"],
        image_size=spec["image_size"],
        batch_size=32,
        **{"reuse_profiles": False, **spec["options"]},
    )
    plan = job.plan
    assert plan is not None
    kept = job.history.of_kind("plan")[0].data["kept_profiles"]
    if spec.get("plan_only"):
        print(json.dumps({"reason": plan.reason}))
        return
    job.fit(spec["epochs"], lr=0.01)
    last = job.history.epochs[-1]
    print(
        json.dumps(
            {
                "epoch_s": last.seconds,
                "bytes": last.bytes_received,
                "samples": last.samples,
                "codec": plan.codec,
                "option": plan.chosen.label,
                "predicted_s": plan.epoch_s,
                "cut": last.cut,
                "share": last.share,
                "replans": len(job.history.plan_changes),
                "kept_profiles": kept,
                "reason": plan.reason,
                "load": os.getloadavg()[0],
            }
        )
    )


def _median(runs: list[dict], field: str) -> float:
    return statistics.median(r[field] for r in runs)


def _summary(row: dict) -> dict:
    return {
        "rate": row["rate"],
        "epoch_s": {k: round(_median(v, "epoch_s"), 2) for k, v in row["runs"].items()},
        "MB": {k: round(_median(v, "bytes") / 1e6, 2) for k, v in row["runs"].items()},
    }


def _report(result: dict, args: argparse.Namespace) -> str:
    names = list(OPTIONS)
    shared = getattr(args, "profiles", "own") == "shared"  # older JSON: each run measured
    flags = f" --repeats {args.repeats}" + ("" if shared else " --profiles own")
    profiles = (
        "the options of a repeat plan from one measurement (a `lossy_wire=True` job's kept "
        "profiles, every codec measured), so their plans differ by the codec alone"
        if shared
        else "each run measures its own profiles"
    )
    lines = [
        "## Wire codecs measured: epochs through a shaped link (`benchmarks/wire_epochs.py`)",
        "",
        f"`python benchmarks/wire_epochs.py{' --results' if args.results else ''}{flags}` on "
        f"{result['machine']} ({result['minutes']:.0f} min): ResNet-18 at {args.image_size} px "
        f"frozen to `{args.freeze}`, {args.images} photos of "
        f"{result['mean_object_bytes'] / 1e3:.0f} KB, `cut=\"auto\"`; server and trainer "
        "pinned to a core each (one torch thread) across a `tc tbf` veth; each run a new "
        f"trainer process, epoch {args.epochs} of {args.epochs} reported (bytes as they "
        f"crossed); {profiles}; medians of {args.repeats} repeats, options interleaved. "
        "Plot: `out/wire_epochs.png`.",
        "",
        "| link | " + " | ".join(f"{n}: epoch, MB" for n in names)
        + " | auto / off | auto + lossy / off |",
        "|---|" + "---|" * (len(names) + 2),
    ]  # fmt: skip
    for row in result["rates"]:
        runs = row["runs"]
        cells = [
            f"{_median(runs[n], 'epoch_s'):.1f} s, {_median(runs[n], 'bytes') / 1e6:.1f}"
            for n in names
        ]
        off = runs["codecs off"]
        ratios = [
            statistics.median(
                a["epoch_s"] / b["epoch_s"] for a, b in zip(runs[n], off, strict=True)
            )
            for n in ("auto", "auto + lossy")
        ]
        lines.append(
            f"| {row['rate']} | " + " | ".join(cells)
            + " | " + " | ".join(f"{r:.2f}x" for r in ratios) + " |"
        )  # fmt: skip
    worst = {
        row["rate"]: max(
            statistics.median(a["epoch_s"] / b["epoch_s"]
                              for a, b in zip(row["runs"][n], row["runs"]["codecs off"],
                                              strict=True))
            for n in ("auto", "auto + lossy")
        )
        for row in result["rates"]
    }  # fmt: skip
    # Where the link binds: most of the codecs-off plans were predicted held by it.
    bound = [
        row["rate"] for row in result["rates"]
        if 2 * sum(_held(r) == "link-bound" for r in row["runs"]["codecs off"])
        > len(row["runs"]["codecs off"])
    ]  # fmt: skip
    missed = [
        rate for rate, ratio in worst.items() if ratio > 1.0 or (rate in bound and ratio >= 1.0)
    ]
    lines += [
        "",
        "Goal (issue 40): with codecs at least as fast as without at every rate, faster where "
        f"the link binds (codecs off predicted link-bound: {', '.join(bound) or 'none'}) - "
        + ("met." if not missed else f"not met at {', '.join(missed)} (see the plans below)."),
    ]
    same = [row["rate"] for row in result["rates"] if _same_plans(row["runs"])]
    if same:
        lines += [
            "",
            f"At {', '.join(same)} the three options chose the same plan (codec and cut) in "
            "each repeat: the ratios there are run-to-run noise.",
        ]
    gains = {
        row["rate"]: [g for n in names[1:] for r in row["runs"][n] if (g := _codec_gain(r))]
        for row in result["rates"]
    }
    lines += [
        "",
        "What the codec itself was predicted to save, within each run (its profiles): the "
        "chosen plan's predicted epoch over the best fp32-only plan's on the same profiles - "
        + "; ".join(f"{rate}: {min(g):.2f}x-{max(g):.2f}x" for rate, g in gains.items() if g)
        + (". Between repeats" if shared else ". Between runs")
        + " the profiles, measured on shared cores, move with the load, and with them the "
        "cut chosen; a run's cut is the larger part of its epoch.",
    ]
    lines += [
        "",
        "The plans chosen (codec, option, the stage the plan predicted binds, its predicted "
        "epoch; the last epoch's cut; the 1-minute load average; per run):",
        "",
    ]
    for row in result["rates"]:
        for n in names:
            chosen = "; ".join(
                f"{r['codec']}, {r['option']}, {_held(r)} {r['predicted_s']:.1f} s "
                f"(ran cut {r['cut']} + {r['share']:.0%} local; load {r.get('load', 0):.1f})"
                for r in row["runs"][n]
            )
            lines.append(f"- {row['rate']}, {n}: {chosen}")
    return "\n".join(lines)


def _same_plans(runs: dict[str, list[dict]]) -> bool:
    """Whether every option of each repeat ran the same codec and option."""
    repeats = zip(*runs.values(), strict=True)
    return all(len({(r["codec"], r["option"]) for r in repeat}) == 1 for repeat in repeats)


def _codec_gain(run: dict) -> float | None:
    """The run's predicted epoch over the fp32-only plan's on its profiles (its reason names
    each codec weighed: "with fp32 6.73 s, ..."); None when fp32 was chosen."""
    found = re.search(r"with fp32 ([0-9.]+) s", run.get("reason", ""))
    return run["predicted_s"] / float(found.group(1)) if found else None


def _held(run: dict) -> str:
    """The binding stage the plan's reason names ("held by the link")."""
    found = re.search(r"held by the (\w+)", run.get("reason", ""))
    return f"{found.group(1)}-bound" if found else "predicted"


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    width = 0.25
    for i, name in enumerate(OPTIONS):
        xs = [j + (i - 1) * width for j in range(len(rows))]
        axes[0].bar(xs, [_median(r["runs"][name], "epoch_s") for r in rows], width, label=name)
        axes[1].bar(xs, [_median(r["runs"][name], "bytes") / 1e6 for r in rows], width)
    for ax, label in zip(axes, ("epoch, s (median)", "MB on the wire per epoch"), strict=True):
        ax.set_xticks(range(len(rows)), [r["rate"] for r in rows])
        ax.set_ylabel(label)
    axes[0].legend(fontsize=7)
    fig.suptitle("ResNet-18, cut='auto', codecs off vs chosen by the planner", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _make_dataset(root: str, args: argparse.Namespace) -> float:
    """The photo-like JPEGs; their mean size in bytes."""
    from hapi.data import open_store, synth_dataset

    synth_dataset(
        open_store(root), "train", classes=args.classes,
        per_class=max(1, args.images // args.classes), size=args.stored_size, seed=0, quality=90,
    )  # fmt: skip
    sizes = [p.stat().st_size for p in Path(root, "train").rglob("*.jpg")]
    return statistics.mean(sizes)


if __name__ == "__main__":
    main()
