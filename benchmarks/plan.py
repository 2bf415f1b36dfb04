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
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _host import end, machine, pin
from _netns import ShapedLink
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

PREFETCH = 4
"""Chunks in flight per route: the loader's default (`JobConfig.prefetch`). Sweeps before
2026-11-27 ran 3."""
CONFIGS = {"vit": ("vit_b_16", {"image_size": "IMAGE_SIZE"})}
"""Models built with options: torchvision's ViT takes its input size (IMAGE_SIZE: the
job's image size)."""


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


def _worker(spec: dict) -> None:
    """In the trainer's process: plan, or run each option (and the auto job) for real."""
    import torch

    from hapi.client import Connection, TransferJob, connect

    torch.set_num_threads(1)
    if spec.get("ping"):
        connect(spec["address"], timeout=2).stats()
        print(json.dumps({"ok": True}))
        return
    common = {
        "freeze": spec["freeze"],
        "image_size": spec.get("image_size", 112),
        "batch_size": spec.get("batch_size", 32),
        "chunk_size": spec.get("chunk_size", 16),
        "prefetch": spec.get("prefetch", PREFETCH),
        "retry_budget_s": 10,
    }
    model = _spec(
        spec.get("model", "resnet18"), spec.get("image_size", 112), spec.get("classes", 4)
    )
    dataset = spec.get("dataset", "train")

    def server() -> Connection:
        """A job's own connection, with the receive window the spec names (`--window`;
        `window.py` runs jobs under two side by side)."""
        return connect(spec["address"], receive_window=spec.get("window", "grpc"))

    if spec.get("plan_only"):
        job = TransferJob(model, dataset, server(), replan=False, **common)
        assert job.plan is not None
        print(json.dumps({"plan": job.plan.to_dict()}))
        return
    chunks: list[dict] = []
    if spec.get("trace"):
        _trace_chunks(chunks)
    runs = []
    # Each option a fixed (cut, share), or "auto": a job that plans and re-plans itself.
    jobs = [
        ("auto", {}) if o == "auto" else (f"{o[0]}:{o[1]}", {"cut": int(o[0]), "local_share": o[1]})
        for o in spec["options"]
    ]
    for label, options in jobs:
        job = TransferJob(model, dataset, server(), **common, **options)
        planned = job.plan.to_dict() if job.plan is not None else None
        epochs = spec.get("epochs", 3)
        at = measured_epoch(epochs)
        progress = _signal_change(job, at, spec["change_at"]) if "change_at" in spec else None
        job.fit(epochs, lr=0.01, progress=progress)
        last = job.history.epochs[at]
        runs.append(
            {
                "label": label,
                "cut": last.cut,
                "share": last.share,
                "epoch_s": last.seconds,
                "server_s": last.server_s,
                "transfer_s": last.transfer_s,
                "trainer_s": last.trainer_s,
                "binding": last.binding,
                "bytes": last.bytes_received,
                "wait_s": last.wait_s,
                "chunks_local": last.chunks_local,
                "changes": [e.message for e in job.history.plan_changes if e.epoch == at],
                # Every epoch's: a job that re-planned in the first epoch runs the last
                # at what it chose, and the figures alone do not say why.
                "all_changes": [f"epoch {e.epoch}: {e.message}" for e in job.history.plan_changes],
                "reroutes": len([e for e in job.history.reroutes if e.epoch == at]),
                "recalls": len([e for e in job.history.recalls if e.epoch == at]),
                "plan": planned,
                "chunks": chunks[:],
            }
        )
        chunks.clear()
    print(json.dumps({"runs": runs}))


def _trace_chunks(into: list[dict]) -> None:
    """Record every chunk the router sees (route, samples, bytes, stage seconds)."""
    from hapi.client.routing import Router

    observe = Router.observe
    started = time.perf_counter()

    def traced(self, record):  # type: ignore[no-untyped-def]
        row = {
            "t": round(time.perf_counter() - started, 3),
            "epoch": record.epoch,
            "chunk": record.chunk,
            "local": record.route.local,
            "cut": record.route.cut,
            "samples": record.samples,
            "bytes": record.bytes,
            "server_s": record.server_s,
            "transfer_s": record.transfer_s,
            "trainer_s": record.trainer_s,
            "buffered": record.transfer_buffered,
        }
        into.append(row)
        observe(self, record)
        if self.replanner is not None:
            # What the re-planner believes after it: a misread shows where it came from.
            row["scales"] = {k: round(v, 3) for k, v in self.replanner.scales().items()}

    Router.observe = traced  # type: ignore[method-assign]

    from hapi.client._fetch import Fetcher

    fetch = Fetcher.fetch

    def traced_fetch(self, flow):  # type: ignore[no-untyped-def]
        fetch(self, flow)
        into.append(
            {
                "flow": flow.index,
                "epoch": self.epoch,
                "local": flow.route.local,
                "issued": round(flow.issued - started, 3),
                "turn": flow.turn and round(flow.turn - started, 3),
                "end": round(flow.read_end - started, 3),
                "server_s": flow.server_s,
                "queue_s": flow.queue_s,
                "bytes": flow.bytes,
                "link_s": flow.link_s,
            }
        )

    Fetcher.fetch = traced_fetch  # type: ignore[method-assign]


def _spec(model: str, image_size: int, classes: int) -> dict:
    """The job's model: a torchvision name, or one of `CONFIGS` with its options."""
    name, options = CONFIGS.get(model, (model, None))
    config: dict[str, object] | None = None
    if options is not None:
        config = {k: image_size if v == "IMAGE_SIZE" else v for k, v in options.items()}
    return {"name": name, "num_classes": classes, "config": config}


def measured_epoch(epochs: int) -> int:
    """The epoch of a job's `epochs` that is measured. Of 3 or more, the one before the
    last: it was fetched while the one before it drained and fetches the next while it
    drains, as every epoch of a long fit does (the first has no epoch to fill behind, and
    the first of the job also opens its sessions; the last has no next epoch to pay for).
    Of 2, the last; of 1, that one."""
    return epochs - 2 if epochs >= 3 else epochs - 1


def _signal_change(job, epoch: int, at: float):  # type: ignore[no-untyped-def]
    """A progress callback that tells the parent to change the link, once, in the middle
    of `epoch`."""
    step_at = max(1, int(job.batches_per_epoch() * at))

    def progress(step: int, total: int) -> None:
        if len(job.history.epochs) == epoch and step == step_at:
            print("CHANGE", flush=True)

    return progress


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


def _make_dataset(root: str, args: argparse.Namespace) -> None:
    from hapi.data import open_store, synth_dataset

    for name, images in (("train", args.images), ("long", args.change_images)):
        synth_dataset(
            open_store(root), name, classes=args.classes, per_class=max(1, images // args.classes),
            size=args.stored_size, seed=0, quality=90,
        )  # fmt: skip


if __name__ == "__main__":
    main()
