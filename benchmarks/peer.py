"""hapi's RAW path and its planned job against the peer: a plain PyTorch DataLoader.

The issue the planner came from measured hapi's RAW path (the trainer reads raw bytes
through `hapi serve` and computes everything) 13-25% slower than a plain PyTorch job on
the same link. This benchmark keeps that comparison honest. The peer is what a user
writes without hapi: a `torch.utils.data.DataLoader` whose workers GET each object over
HTTP from a file server beside the store (an object store's GET, without S3's signing),
decode and transform it with torchvision, and a training loop over the whole model with
everything but `fc` frozen. hapi runs the same model and freeze point (ResNet-18 to
`avgpool+flatten`) twice: at RAW, the same work as the peer, and with `cut="auto"`.

As in `plan.py`, the storage side (the file server and `hapi serve`) is pinned to one
core in one network namespace and the trainer to the other core in another, joined by a
veth shaped with `tc tbf` (root only). Every run is its own process with one torch
thread; the peer's DataLoader workers share the trainer's core. Epoch 2 of 2 is
measured, each option once per repeat, in an order rotated per repeat; the report gives
medians.

    python benchmarks/peer.py                  # writes benchmarks/out/peer.{json,png}
    python benchmarks/peer.py --results        # ... and its section of benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import http.client
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import quote, urlsplit

import torch
from _host import end, machine, pin
from _plan_report import _label, _spread, median_epoch
from _plan_worker import measured_epoch
from _results import write_section
from plan import Stage

HERE = Path(__file__).resolve().parent
FILE_PORT = 18816
MODEL, FREEZE = "resnet18", "avgpool+flatten"
"""The peer trains `fc` of a torchvision ResNet-18: hapi's job at this freeze point."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="10mbit,25mbit,100mbit,1gbit")
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--classes", type=int, default=4)
    parser.add_argument("--stored-size", type=int, default=440, help="side of the stored JPEGs")
    parser.add_argument("--image-size", type=int, default=64, help="the model's input side")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=4, help="the peer's DataLoader workers")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--epochs",
        type=int,
        default=3,
        help="epochs per run; the one before the last is measured (plan.measured_epoch)",
    )
    parser.add_argument("--out", type=Path, default=HERE / "out")
    parser.add_argument("--results", action="store_true", help="write benchmarks/RESULTS.md")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one peer run
    args = parser.parse_args()
    if args.worker:
        _peer(json.loads(args.worker))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    rows = []
    with tempfile.TemporaryDirectory(prefix="hapi-peer-") as root:
        keys, labels = _make_dataset(root, args)
        rates = args.rates.split(",")
        # Stage wants plan.py's arguments: a shaped link, no change-over run.
        stage_args = argparse.Namespace(shaping="netns")
        with Stage(root, rates[0], stage_args) as stage, _FileServer(root, stage) as files:
            for rate in rates:
                stage.set_rate(rate)
                rows.append(_rate(stage, files, rate, keys, labels, args))
                print(json.dumps(_summary(rows[-1])), flush=True)
    result = {
        "machine": machine(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "minutes": (time.time() - started) / 60,
        "rates": rows,
    }
    (args.out / "peer.json").write_text(json.dumps(result, indent=2))
    _plot(rows, args.out / "peer.png")
    text = _report(rows, args)
    print(text)
    if args.results:
        write_section("peer", text)


class _FileServer:
    """The peer's object store: a static HTTP/1.1 file server (keep-alive) over the
    dataset's directory, in the storage namespace on the server's core."""

    def __init__(self, root: str, stage: Stage) -> None:
        self.root, self.stage = root, stage
        assert stage.link is not None
        self.base = f"http://{stage.link.storage_ip}:{FILE_PORT}"

    def __enter__(self) -> _FileServer:
        assert self.stage.link is not None
        cmd = self.stage.link.storage_cmd(
            [sys.executable, "-m", "http.server", "--bind", self.stage.link.storage_ip,
             "--directory", self.root, "--protocol", "HTTP/1.1", str(FILE_PORT)]
        )  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=lambda: pin(0)
        )
        return self

    def __exit__(self, *exc: object) -> None:
        end(self.proc)


def _make_dataset(root: str, args: argparse.Namespace) -> tuple[list[str], list[int]]:
    """The photo-like JPEGs `plan.py` uses; the keys and labels for the peer."""
    from hapi.data import open_store, synth_dataset

    manifest = synth_dataset(
        open_store(root), "train", classes=args.classes,
        per_class=max(1, args.images // args.classes), size=args.stored_size, seed=0, quality=90,
    )  # fmt: skip
    return list(manifest.keys), list(manifest.labels)


def _rate(
    stage: Stage,
    files: _FileServer,
    rate: str,
    keys: list[str],
    labels: list[int],
    args: argparse.Namespace,
) -> dict:
    """One link rate: the peer, hapi RAW and hapi `auto`, interleaved in repeats."""
    hapi_job = {
        "model": MODEL, "freeze": FREEZE, "image_size": args.image_size,
        "batch_size": args.batch_size, "classes": args.classes, "epochs": args.epochs,
    }  # fmt: skip
    peer_job = {
        "base": files.base, "keys": keys, "labels": labels, "image_size": args.image_size,
        "batch_size": args.batch_size, "classes": args.classes, "epochs": args.epochs,
        "workers": args.workers,
    }  # fmt: skip
    options = ["peer", "hapi RAW", "hapi auto"]
    runs: dict[str, list[dict]] = {name: [] for name in options}
    for r in range(args.repeats):
        for name in options[r % len(options) :] + options[: r % len(options)]:
            if name == "peer":
                runs[name].append(_run_peer(stage, peer_job))
                continue
            option = "auto" if name == "hapi auto" else [-1, 0.0]
            result = stage.trainer({**hapi_job, "options": [option]})
            assert result is not None
            run = result["runs"][0]
            runs[name].append(
                {"epoch_s": run["epoch_s"], "label": _label(run["cut"], run["share"])}
            )
    return {"rate": rate, "runs": runs}


def _run_peer(stage: Stage, job: dict) -> dict:
    """The peer in the trainer's namespace on the trainer's core; its last epoch."""
    assert stage.link is not None
    cmd = stage.link.trainer_cmd([sys.executable, __file__, "--worker", json.dumps(job)])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        cmd, capture_output=True, text=True, env=env, preexec_fn=lambda: pin(1), check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"peer failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _peer(spec: dict) -> None:
    """In the peer's process: a DataLoader over HTTP GETs, ResNet-18 training `fc`."""
    import torchvision
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)
    model = torchvision.models.resnet18(num_classes=spec["classes"])
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    for parameter in model.fc.parameters():
        parameter.requires_grad_(True)
    model.eval()  # the frozen layers' batch norm keeps its statistics, as hapi's head does
    optimizer = torch.optim.SGD(model.fc.parameters(), lr=0.01, momentum=0.9)
    loader: DataLoader[tuple[torch.Tensor, int]] = DataLoader(
        _Objects(spec["base"], spec["keys"], spec["labels"], spec["image_size"]),
        batch_size=spec["batch_size"], shuffle=True, num_workers=spec["workers"],
        persistent_workers=spec["workers"] > 0, worker_init_fn=_one_thread,
    )  # fmt: skip
    seconds = []
    for _ in range(spec["epochs"]):
        start = time.perf_counter()
        for images, targets in loader:
            loss = torch.nn.functional.cross_entropy(model(images), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        seconds.append(time.perf_counter() - start)
    print(json.dumps({"epoch_s": seconds[measured_epoch(spec["epochs"])], "label": "peer"}))


def _one_thread(_: int) -> None:
    torch.set_num_threads(1)


class _Objects(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """A map-style dataset: GET the object, decode, RandomResizedCrop, flip, normalize
    (hapi's default train transforms, in torchvision). One keep-alive connection per
    DataLoader worker."""

    def __init__(self, base: str, keys: list[str], labels: list[int], size: int) -> None:
        from torchvision import transforms

        self.base, self.keys, self.labels = base, keys, labels
        self.transform = transforms.Compose(
            [
                transforms.RandomResizedCrop(size),
                transforms.RandomHorizontalFlip(),
                transforms.ToTensor(),
                transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
            ]
        )
        self._connection: http.client.HTTPConnection | None = None

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        if self._connection is None:
            self._connection = http.client.HTTPConnection(urlsplit(self.base).netloc)
        self._connection.request("GET", "/" + quote(self.keys[index]))
        response = self._connection.getresponse()
        body = response.read()
        if response.status != 200:
            raise RuntimeError(f"GET {self.keys[index]}: HTTP {response.status}")
        image = Image.open(io.BytesIO(body)).convert("RGB")
        return self.transform(image), self.labels[index]


def _summary(row: dict) -> dict:
    return {"rate": row["rate"], **{k: round(median_epoch(v), 3) for k, v in row["runs"].items()}}


def _report(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [
        "## hapi against the peer (a plain PyTorch DataLoader)",
        "",
        f"`{_command(args)}` on {machine()}; ResNet-18 at {args.image_size} px trained "
        f"from `{FREEZE}` (only `fc`), {args.images} photo-like JPEGs of ~100 KB "
        f"({args.stored_size} px, quality 90), batch {args.batch_size}; the peer: a "
        f"DataLoader with {args.workers} workers GETting each object over HTTP/1.1 from a "
        "file server beside the store, torchvision's transforms, the whole model in the "
        "training loop. Storage side and trainer two processes pinned to one core each, "
        "in two network namespaces joined by a veth shaped with tc tbf; "
        f"epoch {measured_epoch(args.epochs) + 1} of {args.epochs} (hapi's fetched while "
        f"the one before drained), median of {args.repeats} interleaved repeats "
        "(spread = (max - min) / median). Data in `out/peer.json`.",
        "",
        "| link | peer s | spread | hapi RAW s | spread | RAW / peer | hapi auto s | auto plan "
        "| peer / auto |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        peer, raw, auto = (row["runs"][k] for k in ("peer", "hapi RAW", "hapi auto"))
        plans = sorted({r["label"] for r in auto})
        lines.append(
            f"| {row['rate']} | {median_epoch(peer):.2f} | {_spread(peer):.0%} "
            f"| {median_epoch(raw):.2f} | {_spread(raw):.0%} "
            f"| {median_epoch(raw) / median_epoch(peer):.2f}x "
            f"| {median_epoch(auto):.2f} | {' / '.join(plans)} "
            f"| {median_epoch(peer) / median_epoch(auto):.2f}x |"
        )
    lines += ["", "![epoch time per link: peer, hapi RAW, hapi auto](out/peer.png)"]
    return "\n".join(lines)


def _command(args: argparse.Namespace) -> str:
    parts = ["python benchmarks/peer.py --results"]
    for name, default in (
        ("rates", "10mbit,25mbit,100mbit,1gbit"), ("images", 256), ("image_size", 64),
        ("workers", 4), ("repeats", 3),
    ):  # fmt: skip
        value = getattr(args, name)
        if value != default:
            parts.append(f"--{name.replace('_', '-')} {value}")
    return " ".join(parts)


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ("peer", "hapi RAW", "hapi auto")
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for i, name in enumerate(names):
        xs = [j + (i - 1) * width for j in range(len(rows))]
        ax.bar(xs, [median_epoch(row["runs"][name]) for row in rows], width, label=name)
    ax.set_xticks(range(len(rows)), [row["rate"] for row in rows])
    ax.set_ylabel("epoch s (median)")
    ax.set_title("ResNet-18 to avgpool+flatten: epoch time per link", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
