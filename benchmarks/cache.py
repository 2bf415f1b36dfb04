"""The feature cache: later epochs and later jobs against extracting the embeddings once.

Two tiers as `startup.py` runs them: `hapi serve` on a local store of ~90 KB photo-like
JPEGs in one network namespace on core 0, each trainer a new process in another on core 1,
one torch thread each, joined by a veth shaped with `tc tbf` (root only). ResNet-18 at
112 px frozen to `avgpool+flatten`, deterministic transforms (`augment=False`).

- fine-tune: five epochs at each rate, with the trainer's cache and with `cache=False`,
  against the peer a user writes instead - a plain PyTorch script that GETs every object
  from a file server beside the store, runs the frozen head over them once and trains
  `fc` on the embeddings for five epochs. Each run is timed from its process's start to
  its exit; hapi's runs keep the server's and the trainer's profiles from a warm-up job
  (a returning user; `startup.py` measures a cold plan), each with an empty feature cache.
- sweep: four jobs of a learning-rate sweep, one after another, against one server with
  `--feature-cache` (each job with its own trainer cache, so only the server's can help):
  the server's head seconds over the four against one job's on a server without it.
- views: a job with `views=4` (epochs 5+ hit) and one with fresh augmentation.
- accuracy: the demo's task (EfficientNet-Lite0 with its ImageNet weights, a linear probe
  on the synthetic set), in this process on loopback, with deterministic transforms,
  `views=2`, `views=4` and fresh augmentation, the same epochs, over a few seeds.

    python benchmarks/cache.py                 # writes benchmarks/out/cache.{json,png}
    python benchmarks/cache.py --results       # ... and its section of benchmarks/RESULTS.md
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

from _cache_report import ACCURACY, FINE_TUNE, _fine_tune_summary, _plot, _report
from _host import machine, pin
from _results import write_section
from peer import _FileServer, _Objects, _one_thread
from plan import PORT, Stage

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="fine-tune,sweep,views,accuracy")
    parser.add_argument("--rates", default="10mbit,1gbit")
    parser.add_argument("--images", type=int, default=128)
    parser.add_argument("--classes", type=int, default=4)
    parser.add_argument("--stored-size", type=int, default=420, help="side of the stored JPEGs")
    parser.add_argument("--image-size", type=int, default=112)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="the peer's DataLoader workers")
    parser.add_argument("--sweep-rate", default="1gbit")
    parser.add_argument("--accuracy-epochs", type=int, default=8)
    parser.add_argument("--accuracy-seeds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=HERE / "out")
    parser.add_argument("--results", action="store_true", help="write benchmarks/RESULTS.md")
    parser.add_argument(
        "--report-only", action="store_true", help="rewrite the report from out/cache.json"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one trainer process
    args = parser.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        {"hapi": _hapi, "peer": _peer, "stats": _stats}[spec["kind"]](spec)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        saved = json.loads((args.out / "cache.json").read_text())
        for key, value in saved["args"].items():
            if key not in ("out", "results", "report_only", "worker"):
                setattr(args, key, value)
        _finish(saved, args)
        return
    parts = args.parts.split(",")
    started = time.time()
    result: dict = {
        "machine": machine(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }

    def save() -> None:  # after every part: a later part's failure keeps what was measured
        result["minutes"] = (time.time() - started) / 60
        (args.out / "cache.json").write_text(json.dumps(result, indent=2))

    with tempfile.TemporaryDirectory(prefix="hapi-cache-bench-") as root:
        keys, labels, object_bytes = _make_dataset(root, args)
        result["mean_object_bytes"] = object_bytes
        rates = args.rates.split(",")
        if {"fine-tune", "sweep", "views"} & set(parts):
            stage = CacheStage(root, rates[0], argparse.Namespace(shaping="netns"))
            with stage, _FileServer(root, stage) as files:
                if "fine-tune" in parts:
                    result["fine_tune"] = []
                    for rate in rates:
                        stage.set_rate(rate)
                        row = _fine_tune(stage, files, rate, keys, labels, args)
                        result["fine_tune"].append(row)
                        print(json.dumps(_fine_tune_summary(row)), flush=True)
                        save()
                stage.set_rate(args.sweep_rate)
                if "views" in parts:
                    result["views"] = _views(stage, args)
                    print(json.dumps(result["views"]["cached"]), flush=True)
                    save()
                if "sweep" in parts:
                    result["sweep"] = _sweep(stage, args)
                    print(json.dumps(result["sweep"]["head_s"]), flush=True)
                    save()
        if "accuracy" in parts:
            result["accuracy"] = _accuracy(args)
            print(json.dumps(result["accuracy"]["final"]), flush=True)
            save()
    save()
    _finish(result, args)


def _finish(result: dict, args: argparse.Namespace) -> None:
    _plot(result, args.out / "cache.png")
    text = _report(result, args)
    print(text)
    if args.results:
        write_section("cache", text)


class CacheStage(Stage):
    """`plan.Stage`, whose server may keep a feature cache (`--feature-cache`)."""

    server_args: tuple[str, ...] = ()

    def _start(self) -> None:
        assert self.link is not None
        cmd = [sys.executable, "-m", "hapi.cli", "serve", "--store", self.root, "--threads", "1"]
        cmd += ["--host", self.link.storage_ip, "--port", str(PORT), "--insecure"]
        cmd = self.link.storage_cmd([*cmd, *self.server_args])
        self.address = f"grpc://{self.link.storage_ip}:{PORT}"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - read back if it fails to start
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=self.log, env=env, preexec_fn=lambda: pin(0),
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while self._run({"ping": True}, check=False) is None:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.log.seek(0)
                err = self.log.read().decode(errors="replace")[-1500:]
                raise RuntimeError(f"server on {self.address} did not start: {err}")
            time.sleep(0.5)

    def restart(self, *server_args: str) -> None:
        """A server just started, with `server_args`."""
        self._stop()
        self.server_args = server_args
        self._start()

    def run(self, spec: dict, env: dict[str, str] | None = None) -> dict:
        """One trainer process (`--worker spec`) on the trainer's core, timed whole."""
        assert self.link is not None
        spec = {**spec, "address": self.address, "veth": self.link._veth[1]}
        cmd = self.link.trainer_cmd([sys.executable, __file__, "--worker", json.dumps(spec)])
        env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        t0 = time.perf_counter()
        done = subprocess.run(
            cmd, capture_output=True, text=True, env=env, preexec_fn=lambda: pin(1), check=False
        )
        wall = time.perf_counter() - t0
        if done.returncode != 0:
            raise RuntimeError(f"{spec['kind']} failed: {done.stderr[-3000:]}")
        return {"wall_s": wall, **json.loads(done.stdout.strip().splitlines()[-1])}

    def server_stats(self) -> dict:
        return self.run({"kind": "stats"})


def _job(args: argparse.Namespace, **options: Any) -> dict:
    return {
        "kind": "hapi", "classes": args.classes, "image_size": args.image_size,
        "epochs": args.epochs, "augment": False, "lr": 0.01, **options,
    }  # fmt: skip


def _fine_tune(
    stage: CacheStage,
    files: _FileServer,
    rate: str,
    keys: list[str],
    labels: list[int],
    args: argparse.Namespace,
) -> dict:
    """One rate: hapi with and without the cache and the peer, interleaved in repeats."""
    runs: dict[str, list[dict]] = {name: [] for name in FINE_TUNE}
    peer = {
        "kind": "peer", "base": files.base, "keys": keys, "labels": labels,
        "image_size": args.image_size, "classes": args.classes, "epochs": args.epochs,
        "workers": args.workers,
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="hapi-home-") as home:
        # A returning user: the plan's profiles kept by a job before (no features kept).
        stage.restart()
        stage.run(_job(args, epochs=1, cache=False), {"HAPI_CACHE_DIR": home})
        for r in range(args.repeats):
            for name in FINE_TUNE[r % 3 :] + FINE_TUNE[: r % 3]:
                if name == "peer":
                    runs[name].append(stage.run(peer))
                    continue
                with tempfile.TemporaryDirectory(prefix="hapi-features-") as features:
                    spec = _job(args, cache=name == "hapi cache", cache_dir=features)
                    runs[name].append(stage.run(spec, {"HAPI_CACHE_DIR": home}))
    return {"rate": rate, "runs": runs}


def _views(stage: CacheStage, args: argparse.Namespace) -> dict:
    """A `views=4` job over six epochs and one with fresh augmentation over two."""
    out = {}
    for name, options in (
        ("views=4", {"augment": True, "views": 4, "epochs": max(6, args.epochs)}),
        ("fresh augmentation", {"augment": True, "epochs": 2}),
    ):
        with tempfile.TemporaryDirectory(prefix="hapi-features-") as features:
            out[name] = stage.run(_job(args, cut=None, cache_dir=features, **options))
    return {
        "runs": out,
        "cached": {name: [e["cached"] for e in run["epochs"]] for name, run in out.items()},
    }


def _sweep(stage: CacheStage, args: argparse.Namespace) -> dict:
    """Four jobs of a learning-rate sweep, one after another, on a server with a feature
    cache, its stats read after each (one job's head seconds: the first's); and, beside
    it, one job on a server without one. Freeze cut: all of the head runs on the server."""
    lrs = (0.003, 0.01, 0.03, 0.1)
    stage.restart()
    with tempfile.TemporaryDirectory(prefix="hapi-features-") as features:
        one = stage.run(_job(args, cut=None, lr=lrs[1], cache_dir=features))
    alone = stage.server_stats()
    jobs, after = [], []
    with tempfile.TemporaryDirectory(prefix="hapi-server-cache-") as server_cache:
        stage.restart("--feature-cache", server_cache, "--feature-cache-size", "2GiB")
        for lr in lrs:
            with tempfile.TemporaryDirectory(prefix="hapi-features-") as features:
                jobs.append(stage.run(_job(args, cut=None, lr=lr, cache_dir=features)))
            after.append(stage.server_stats())
    stage.restart()
    head = [a["head_s"] for a in after]
    return {
        "lrs": lrs, "one": one, "jobs": jobs, "server_alone": alone, "server_after": after,
        "head_s": {"first job": head[0], "sweep": head[-1], "no cache, one job": alone["head_s"]},
    }  # fmt: skip


def _accuracy(args: argparse.Namespace) -> dict:
    """The demo's task for each choice of augmentation, over seeds, on loopback."""
    import torch

    from hapi.cli.demo_run import DemoConfig
    from hapi.client import TransferJob
    from hapi.data import open_store, synth_dataset
    from hapi.graph import ModelSpec, build_model, trace
    from hapi.server import ServerConfig, serve
    from hapi.wire import check_wire_dtype

    torch.set_num_threads(1)
    demo = DemoConfig(epochs=args.accuracy_epochs)
    runs: dict[str, list[dict]] = {name: [] for name in ACCURACY}
    with tempfile.TemporaryDirectory(prefix="hapi-demo-") as root:
        store = open_store(root)
        for prefix, per_class, seed in (
            ("train", demo.train_per_class, demo.seed),
            ("val", demo.val_per_class, demo.seed + 1),
        ):
            synth_dataset(store, prefix, classes=demo.classes, per_class=per_class,
                          size=demo.stored_size, seed=seed)  # fmt: skip
        spec = ModelSpec(name=demo.model, weights=demo.weights, num_classes=demo.classes)
        freeze = trace(build_model(spec), (3, demo.image_size, demo.image_size)).num_cuts - 1
        options: dict[str, dict[str, Any]] = {
            "augment=False": {"augment": False},
            "views=2": {"views": 2},
            "views=4": {"views": 4},
            "fresh augmentation": {},
        }
        with serve(ServerConfig(store=root)) as server:
            for seed in range(args.accuracy_seeds):
                for name in ACCURACY:
                    with tempfile.TemporaryDirectory(prefix="hapi-features-") as features:
                        t0 = time.perf_counter()
                        job = TransferJob(
                            ModelSpec(name=demo.model, weights=demo.weights,
                                      num_classes=demo.classes, seed=seed),
                            "train", server.address, eval_dataset="val", freeze=freeze,
                            cut=None, image_size=demo.image_size, batch_size=demo.batch_size,
                            wire_dtype=check_wire_dtype(demo.wire_dtype), seed=seed,
                            cache_dir=features,
                            **options[name],
                        )  # fmt: skip
                        optimizer = torch.optim.SGD(
                            job.trainable_parameters, lr=demo.lr, momentum=0.9
                        )
                        job.fit(args.accuracy_epochs, optimizer)
                        evaluation = job.evaluate()
                        runs[name].append(
                            {
                                "seed": seed,
                                "accuracy": evaluation.accuracy,
                                "loss": evaluation.loss,
                                "train_accuracy": [e.accuracy for e in job.history.epochs],
                                "cached": [e.cached for e in job.history.epochs],
                                "seconds": time.perf_counter() - t0,
                            }
                        )
    final = {n: statistics.mean(r["accuracy"] for r in rs) for n, rs in runs.items()}
    return {"runs": runs, "final": final, "model": demo.model, "freeze": freeze}


def _rx_bytes(veth: str) -> int:
    return int(Path(f"/sys/class/net/{veth}/statistics/rx_bytes").read_text())


def _hapi(spec: dict) -> None:
    """A user's script: a job, its epochs, done; per-epoch figures and link bytes."""
    import torch

    from hapi import TransferJob

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    link = [_rx_bytes(spec["veth"])]
    options = {k: spec[k] for k in ("augment", "views", "cache", "cache_dir", "cut") if k in spec}
    job = TransferJob(
        {"name": "resnet18", "num_classes": spec["classes"]}, "train", spec["address"],
        freeze="avgpool+flatten", image_size=spec["image_size"], batch_size=32, **options,
    )  # fmt: skip

    def progress(done: int, total: int) -> None:
        if done == total:  # an epoch's last step: its bytes across the link
            link.append(_rx_bytes(spec["veth"]))

    built = time.perf_counter()
    job.fit(spec["epochs"], lr=spec["lr"], progress=progress)
    end_ = time.perf_counter()
    link.append(_rx_bytes(spec["veth"]))
    epochs = [
        {
            "seconds": e.seconds, "bytes": e.bytes_received, "cached": e.cached,
            "server_cached": e.server_cached, "computed": e.computed, "samples": e.samples,
            "loss": e.loss, "accuracy": e.accuracy, "cut": e.cut, "share": e.share,
            "link_bytes": link[i + 1] - link[i] if i + 1 < len(link) - 1 else None,
        }
        for i, e in enumerate(job.history.epochs)
    ]  # fmt: skip
    print(
        json.dumps(
            {
                "build_s": built - t0, "fit_s": end_ - built, "epochs": epochs,
                "link_bytes": link[-1] - link[0], "summary": job.summary(),
                # What crossed the link after epoch 1's last step (None: not seen).
                "after_first_link_bytes": link[-1] - link[1] if len(link) > 2 else None,
            }
        )
    )  # fmt: skip


def _peer(spec: dict) -> None:
    """The embeddings-once peer: GET every object, run the frozen head once, keep the
    embeddings in memory, train `fc` on them for the epochs."""
    import torch
    import torchvision
    from torch.utils.data import DataLoader

    t0 = time.perf_counter()
    link = _rx_bytes(spec["veth"])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=spec["classes"])
    head = torch.nn.Sequential(*list(model.children())[:-1], torch.nn.Flatten()).eval()
    dataset = _EvalObjects(spec["base"], spec["keys"], spec["labels"], spec["image_size"])
    loader: DataLoader[tuple[torch.Tensor, int]] = DataLoader(
        dataset, batch_size=32, num_workers=spec["workers"], worker_init_fn=_one_thread
    )
    built = time.perf_counter()
    features, targets = [], []
    with torch.inference_mode():
        for images, labels in loader:
            features.append(head(images))
            targets.append(labels)
    x, y = torch.cat(features), torch.cat(targets)
    extracted = time.perf_counter()
    optimizer = torch.optim.SGD(model.fc.parameters(), lr=0.01, momentum=0.9)
    seconds = []
    for _ in range(spec["epochs"]):
        start = time.perf_counter()
        for batch in torch.randperm(len(y)).split(32):
            loss = torch.nn.functional.cross_entropy(model.fc(x[batch]), y[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        seconds.append(time.perf_counter() - start)
    print(
        json.dumps(
            {
                "build_s": built - t0, "extract_s": extracted - built, "train_epochs_s": seconds,
                "link_bytes": _rx_bytes(spec["veth"]) - link,
            }
        )
    )  # fmt: skip


class _EvalObjects(_Objects):
    """The peer's objects under hapi's eval transforms (`Transforms.eval`): resize the
    shorter side to 8/7 of the input, center crop, normalize - deterministic."""

    def __init__(self, base: str, keys: list[str], labels: list[int], size: int) -> None:
        from torchvision import transforms

        super().__init__(base, keys, labels, size)
        self.transform = transforms.Compose(
            [
                transforms.Resize(round(size * 8 / 7)),
                transforms.CenterCrop(size),
                transforms.ToTensor(),
                transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
            ]
        )


def _stats(spec: dict) -> None:
    """The server's head seconds over every session, and its feature cache's counters."""
    from hapi.client import connect

    stats = connect(spec["address"], timeout=10).stats()
    sessions = [*stats.sessions.values(), *stats.closed_sessions.values()]
    cache = stats.feature_cache
    print(
        json.dumps(
            {
                "head_s": sum(s.head_s for s in sessions),
                "samples": sum(s.samples for s in sessions),
                "cache_hits": sum(s.cache_hits for s in sessions),
                "cpu_s": stats.cpu_s,
                "feature_cache": cache.model_dump() if cache is not None else None,
            }
        )
    )


def _make_dataset(root: str, args: argparse.Namespace) -> tuple[list[str], list[int], float]:
    """The photo-like JPEGs; their keys, labels and mean size in bytes."""
    from hapi.data import open_store, synth_dataset

    manifest = synth_dataset(
        open_store(root), "train", classes=args.classes,
        per_class=max(1, args.images // args.classes), size=args.stored_size, seed=0, quality=90,
    )  # fmt: skip
    sizes = [p.stat().st_size for p in Path(root, "train").rglob("*.jpg")]
    return list(manifest.keys), list(manifest.labels), statistics.mean(sizes)


if __name__ == "__main__":
    main()
