"""The planner against brute force: every option measured, the plan's choice beside them.

The storage side (`hapi serve` on a local store) and the trainer are two processes, each
pinned to its own core with one torch thread, in two network namespaces joined by a veth
shaped with `tc tbf` (`_netns.ShapedLink`, root only; `--shaping egress` uses the server's
token bucket instead). The images are photo-like JPEGs of about 100 KB.

For each freeze point and link rate the script asks the planner for its table, picks the
options to brute-force (RAW, INPUT, a spread of cuts up to the freeze point, the best
hybrids and the chosen option), and measures each, plus a job with `cut="auto"` (which
plans and re-plans itself), in interleaved repeats. It reports, against the median of the
repeats: the share of configurations where the plan is within 5% of the best option, the
mean regret, the speed-up over RAW and over the freeze cut, and the hybrid's gain over the
best pure option. `--link-change` adds a run whose link rate drops mid-epoch.

    python benchmarks/plan.py                  # writes benchmarks/out/plan.{json,png}
    python benchmarks/plan.py --name plan-256 --images 256 ...   # out/plan-256.*, its section
    python benchmarks/plan.py --results        # ... and its section of benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _host import end, machine, pin
from _netns import ShapedLink
from _plan_report import _plot, _report, _summary
from _plan_worker import PREFETCH, _worker
from _results import write_section

HERE = Path(__file__).resolve().parent
PORT = 18815

FREEZES = {
    "resnet18": "layer3,avgpool+flatten",
    "resnet50": "layer3,avgpool+flatten",
    "vgg11": "features.10,classifier.5",
    "densenet121": "features.denseblock3,features+flatten",
    "vit": "encoder.layers.encoder_layer_5,encoder+getitem",
}
"""Two freeze points per model the benchmark knows: one mid-network, one before the head."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet18", help=f"of {', '.join(FREEZES)}")
    parser.add_argument("--freezes", help="freeze points (one model); default: FREEZES")
    parser.add_argument("--rates", default="10mbit,100mbit,1gbit")
    parser.add_argument("--images", type=int, default=128)
    parser.add_argument("--classes", type=int, default=4)
    parser.add_argument("--stored-size", type=int, default=440, help="side of the stored JPEGs")
    parser.add_argument("--image-size", type=int, default=112, help="the model's input side")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--chunk-size", type=int, default=16)
    parser.add_argument("--prefetch", type=int, default=PREFETCH, help="chunks in flight per route")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--epochs",
        type=int,
        default=3,
        help="epochs per job; the one before the last is measured (one epoch: that one)",
    )
    parser.add_argument("--shaping", choices=("netns", "egress"), default="netns")
    parser.add_argument(
        "--window", default="grpc",
        help="the trainer's receive window: grpc (connect's default), auto, or bytes",
    )  # fmt: skip
    parser.add_argument("--link-change", default="1gbit:10mbit", help="FROM:TO, or none")
    parser.add_argument(
        "--change-images", type=int, default=512,
        help="images in the link-change run: enough chunks after the change to re-plan",
    )  # fmt: skip
    parser.add_argument(
        "--trace", action="store_true", help="record each chunk's stage times in the JSON"
    )
    parser.add_argument(
        "--link-change-only", action="store_true",
        help="run only the link-change run; keep the configurations saved in out/NAME.json",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=HERE / "out")
    parser.add_argument(
        "--name", default="plan", help="the files' stem in --out and the RESULTS section"
    )
    parser.add_argument("--results", action="store_true", help="write benchmarks/RESULTS.md")
    parser.add_argument(
        "--report-only", action="store_true", help="rewrite the report from out/NAME.json"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one trainer run
    args = parser.parse_args()
    if args.worker:
        _worker(json.loads(args.worker))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        saved = json.loads((args.out / f"{args.name}.json").read_text())
        for key, value in saved["args"].items():
            if key not in ("out", "name", "results", "report_only", "worker"):
                setattr(args, key, value)
        _finish(saved["configs"], saved["link_change"], args)
        return
    started = time.time()
    if args.link_change_only:
        _link_change_only(args, started)
        return
    with tempfile.TemporaryDirectory(prefix="hapi-plan-") as root:
        _make_dataset(root, args)
        configs = []
        rates = args.rates.split(",")
        with Stage(root, rates[0], args) as stage:
            change = None
            if args.link_change != "none":
                change = _link_change(stage, args)
                print(json.dumps(change), flush=True)
            for rate in rates:
                stage.set_rate(rate)
                for model in args.models.split(","):
                    freezes = args.freezes or FREEZES[model]
                    for freeze in freezes.split(","):
                        configs.append(_config(stage, rate, model, freeze, args))
                        print(json.dumps(_summary(configs[-1])), flush=True)
                        _save(configs, change, args, started)  # what is measured so far
    _save(configs, change, args, started)
    _finish(configs, change, args)


def _link_change_only(args: argparse.Namespace, started: float) -> None:
    """The link-change run alone, saved beside the configurations of the last full run
    (whose arguments the report keeps: this run takes the same models and sizes, and
    the change and the repeats asked for now - a sweep saved with `--link-change none`
    can gain one)."""
    saved = json.loads((args.out / f"{args.name}.json").read_text())
    for key, value in saved["args"].items():
        if key not in (
            "out",
            "name",
            "results",
            "report_only",
            "worker",
            "link_change_only",
            "link_change",
            "change_images",
            "trace",
            "repeats",
        ):
            setattr(args, key, value)
    with tempfile.TemporaryDirectory(prefix="hapi-plan-") as root:
        _make_dataset(root, args)
        with Stage(root, args.link_change.split(":")[0], args) as stage:
            change = _link_change(stage, args)
    print(json.dumps(change), flush=True)
    configs = saved["configs"]
    _save(configs, change, args, started - 60 * saved.get("minutes", 0.0))
    _finish(configs, change, args)


def _save(
    configs: list[dict], change: dict | None, args: argparse.Namespace, started: float
) -> None:
    result = {
        "machine": machine(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "minutes": (time.time() - started) / 60,
        "configs": configs,
        "link_change": change,
    }
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=2))


def _finish(configs: list[dict], change: dict | None, args: argparse.Namespace) -> None:
    _plot(configs, args.out / f"{args.name}.png")
    text = _report(configs, change, args)
    print(text)
    if args.results:
        write_section(args.name, text)


class Stage:
    """The server in the storage namespace on core 0; trainers in the trainer's on core 1."""

    def __init__(self, root: str, rate: str, args: argparse.Namespace) -> None:
        self.root, self.rate, self.args = root, rate, args
        self.link = ShapedLink(rate) if args.shaping == "netns" else None

    def __enter__(self) -> Stage:
        host = self.link.__enter__().storage_ip if self.link else "127.0.0.1"
        self.address = f"grpc://{host}:{PORT}"
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start(self) -> None:
        cmd = [sys.executable, "-m", "hapi.cli", "serve", "--store", self.root, "--threads", "1"]
        cmd += ["--host", self.address.split("//")[1].split(":")[0], "--port", str(PORT)]
        cmd += ["--insecure"]
        if self.link is None:
            cmd += ["--egress-limit", self.rate]
        if self.link is not None:
            cmd = self.link.storage_cmd(cmd)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
            preexec_fn=lambda: pin(0),
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while self._run({"ping": True}, check=False) is None:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"server on {self.address} did not start")
            time.sleep(0.5)

    def set_rate(self, rate: str) -> None:
        if rate == self.rate:
            return
        self.rate = rate
        if self.link is not None:
            self.link.set_rate(rate)
        else:  # the token bucket's rate is fixed at start
            self._stop()
            self._start()

    def trainer(self, job: dict, on_line=None) -> dict | None:  # type: ignore[no-untyped-def]
        return self._run(job, on_line=on_line)

    def _run(self, job: dict, check: bool = True, on_line=None) -> dict | None:  # type: ignore[no-untyped-def]
        cmd = [sys.executable, __file__, "--worker", json.dumps({**job, "address": self.address})]
        if self.link is not None:
            cmd = self.link.trainer_cmd(cmd)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
            preexec_fn=lambda: pin(1),
        )  # fmt: skip
        last = None
        assert proc.stdout is not None
        for line in proc.stdout:
            if on_line is not None:
                on_line(line.strip())
            last = line
        err = proc.stderr.read() if proc.stderr else ""
        if proc.wait() != 0:
            if check:
                raise RuntimeError(f"trainer failed: {err[-2000:]}")
            return None
        return json.loads(last) if last else None

    def _stop(self) -> None:
        if getattr(self, "proc", None) is None:
            return
        end(self.proc)

    def __exit__(self, *exc: object) -> None:
        self._stop()
        if self.link is not None:
            self.link.__exit__()


def _job_options(args: argparse.Namespace, model: str, freeze: str) -> dict:
    return {
        "model": model,
        "freeze": freeze,
        "image_size": args.image_size,
        "batch_size": args.batch_size,
        "chunk_size": args.chunk_size,
        "prefetch": args.prefetch,
        "classes": args.classes,
        "epochs": args.epochs,
        "trace": args.trace,
        "window": args.window if args.window in ("grpc", "auto") else int(args.window),
    }


def _config(stage: Stage, rate: str, model: str, freeze: str, args: argparse.Namespace) -> dict:
    """One (model, freeze, rate): the planner's table, then every picked option in repeats."""
    base = _job_options(args, model, freeze)
    planned = stage.trainer({**base, "plan_only": True})
    assert planned is not None
    options: list[list[float] | str] = [*_pick(planned["plan"]), "auto"]
    runs: dict[str, list[dict]] = {}
    for r in range(args.repeats):
        # Interleaved: every option once per repeat, in an order rotated per repeat; the
        # `auto` job too, else it is always last in its process and an order effect shows
        # as its regret.
        order = options[r % len(options) :] + options[: r % len(options)]
        result = stage.trainer({**base, "options": order})
        assert result is not None
        for run in result["runs"]:
            runs.setdefault(run["label"], []).append(run)
    return {
        "rate": rate, "model": model, "freeze": freeze, "plan": planned["plan"], "runs": runs,
    }  # fmt: skip


def _pick(plan: dict) -> list[list[float]]:
    """RAW, the freeze cut, the chosen option, and among the options predicted within 3x
    of the fastest: INPUT, a spread of pure cuts and the three fastest hybrids. (An early
    cut on a slow link moves 8x the bytes of the image: minutes an epoch, no contender.)"""
    rows = plan["options"]
    fastest = min(r["epoch_s"] for r in rows)
    near = [r for r in rows if r["epoch_s"] <= 3 * fastest]
    pure = sorted({r["cut"] for r in near if r["share"] == 0 and r["cut"] >= 1})
    spread = pure[:: max(1, len(pure) // 4)] + pure[-1:]
    freeze = max(r["cut"] for r in rows)
    picked = [[-1, 0.0], [freeze, 0.0], [plan["cut"], plan["share"]]]
    picked += [[r["cut"], 0.0] for r in near if r["cut"] == 0 and r["share"] == 0]
    picked += [[c, 0.0] for c in spread]
    picked += [[r["cut"], r["share"]] for r in near if r["share"] > 0][:3]
    unique: list[list[float]] = []
    for option in picked:
        if option not in unique:
            unique.append(option)
    return unique


def _link_change(stage: Stage, args: argparse.Namespace) -> dict:
    """An epoch whose link drops mid-way: the re-planning job against fixed plans."""
    before, after = args.link_change.split(":")
    model = args.models.split(",")[0]
    freeze = (args.freezes or FREEZES[model]).split(",")[-1]
    base = {
        **_job_options(args, model, freeze),
        "chunk_size": max(4, args.chunk_size // 2),
        "dataset": "long",
    }
    stage.set_rate(after)
    for_after = stage.trainer({**base, "plan_only": True})
    stage.set_rate(before)
    for_before = stage.trainer({**base, "plan_only": True})
    assert for_after is not None and for_before is not None

    def option(plan: dict) -> list[float]:
        return [plan["plan"]["cut"], plan["plan"]["share"]]

    runs: dict[str, list[float]] = {}
    traces: dict[str, list[list[dict]]] = {}
    for _ in range(args.repeats):
        for label, job in (
            ("auto (re-plans)", {"options": ["auto"]}),
            (f"plan for {before}", {"options": [option(for_before)]}),
            (f"plan for {after}", {"options": [option(for_after)]}),
        ):
            stage.set_rate(before)

            def on_line(line: str) -> None:
                if line == "CHANGE":
                    stage.set_rate(after)

            result = stage.trainer({**base, **job, "change_at": 0.5}, on_line=on_line)
            assert result is not None
            runs.setdefault(label, []).append(result["runs"][0]["epoch_s"])
            if label.startswith("auto"):
                runs.setdefault("auto changes", []).append(result["runs"][0]["changes"])
            if args.trace:
                traces.setdefault(label, []).append(result["runs"][0]["chunks"])
    stage.set_rate(args.rates.split(",")[0])
    change = {
        "from": before, "to": after, "freeze": freeze, "images": args.change_images, "runs": runs,
    }  # fmt: skip
    if traces:
        change["traces"] = traces
    return change


def _make_dataset(root: str, args: argparse.Namespace) -> None:
    from hapi.data import open_store, synth_dataset

    for name, images in (("train", args.images), ("long", args.change_images)):
        synth_dataset(
            open_store(root), name, classes=args.classes, per_class=max(1, images // args.classes),
            size=args.stored_size, seed=0, quality=90,
        )  # fmt: skip


if __name__ == "__main__":
    main()
