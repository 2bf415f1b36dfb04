"""Beside the data on every storage node: location-aware routing against today's.

A SeaweedFS cluster of three storage nodes, each in its own network namespace with a
volume server, a filer with its S3 gateway, and a `hapi serve` reading through its own
node's gateway; a trainer in a fourth namespace (`_cluster_net.ClusterNet`). The nodes'
links to each other are shaped with `tc tbf` at `--between`, their links to the trainer
at `--trainer`. Every hapi server is started with `--beside` and `--filer`, so each
chunk's report says how many of its bytes were read on the server's own node; the two
options differ in the trainer alone:

- `today`: the trainer does not use where keys lie (the servers are asked, so their
  reports count the bytes read on their own node): chunks of the shuffled order go by
  measured rate, as with servers that cannot say;
- `located`: the trainer asks, groups each epoch by home and sends each chunk home.

The hapi servers and every SeaweedFS process share core 1, one torch thread each, each
hapi server held to a share of it (`--server-cpu`, a CPU cgroup of its own: sharing the
core freely, one ran faster while the others waited, and the router took their chunks
away from home for a slowness no machine of its own has); the trainer runs on core 0.
ResNet-18 frozen to `layer4`, 64 px, fresh augmentation each epoch (so every epoch reads
every object), ~90 KB photo-like JPEGs.

    python benchmarks/locality.py                # writes benchmarks/out/locality.{json,png}
    python benchmarks/locality.py --results      # ... and its section of benchmarks/RESULTS.md

Goals (issue 54): local fraction >= 0.95; epoch time located / today <= 0.6x where the
links between storage nodes bind.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from _cluster_net import ClusterNet
from _cpu_cap import CpuCap
from _host import end, machine, serving, taskset
from _results import write_section
from _seaweed_cluster import BUCKET, KEY, PORTS, SECRET, cluster, node_shares

HERE = Path(__file__).resolve().parent
NODES = 3
MODES = ("today", "located")
GOAL_LOCAL, GOAL_RATIO = 0.95, 0.6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--between", default="20mbit,100mbit", help="rates between nodes")
    parser.add_argument("--trainer", default="1gbit", help="each node's rate to the trainer")
    parser.add_argument("--images", type=int, default=600)
    parser.add_argument("--stored-size", type=int, default=420, help="side of the stored JPEGs")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=HERE / "out")
    parser.add_argument("--results", action="store_true", help="write benchmarks/RESULTS.md")
    parser.add_argument("--scale-nodes", default="1,2,3", help="cluster sizes ('' for none)")
    parser.add_argument("--scale-trainer", default="10mbit", help="each node's rate, scaling")
    parser.add_argument("--scale-images", type=int, default=600)
    parser.add_argument("--scale-epochs", type=int, default=3)
    parser.add_argument("--scale-cut", default="layer1", help="the cut, scaling")
    parser.add_argument(
        "--server-cpu",
        type=float,
        default=0.3,
        help="each hapi server's share of core 1, a CPU cgroup (0: none)",
    )
    parser.add_argument("--kill-after-s", type=float, default=6.0, help="into the killed run")
    parser.add_argument("--parts", default="compare,scale,kill", help="what to run")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: the trainer's job
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_job(json.loads(args.worker))))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    # SIGTERM (a timeout) unwinds like Ctrl-C: the processes, namespaces and bridges go.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.time()
    parts = args.parts.split(",")
    rows: list[dict[str, Any]] = []
    object_bytes = 0.0
    shares: list[float] = []
    if "compare" in parts:
        with cluster(NODES, args.trainer, args, args.images) as (net, root, object_bytes, _):
            shares = node_shares(net)
            print(f"the photos' bytes on each node: {shares}", flush=True)
            rows = _sweep(net, args, root)
    scale = _scale(args) if "scale" in parts else []
    killed = _killed(args) if "kill" in parts else None
    out = {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows, "scale": scale,
           "killed": killed, "node_shares": shares,
           "object_bytes": object_bytes, "machine": machine(),
           "wall_s": time.time() - started}  # fmt: skip
    (args.out / "locality.json").write_text(json.dumps(out, indent=1))
    _plot(rows, scale, args.out / "locality.png")
    text = _section(out)
    print(text)
    if args.results:
        write_section("locality", text)


def _scale(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Throughput with 1, 2, 3 storage nodes, each node's link to the trainer binding
    (`--scale-trainer`) and the links between them not: a cluster of each size."""
    rows: list[dict[str, Any]] = []
    for nodes in (int(n) for n in args.scale_nodes.split(",") if n):
        with cluster(nodes, args.scale_trainer, args, args.scale_images) as (net, root, _, _):
            net.shape(between="1gbit")
            for repeat in range(args.repeats):
                row = _run(net, args, "located", root, cut=args.scale_cut, epochs=args.scale_epochs)
                rows.append({"nodes": nodes, "repeat": repeat, **row})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def _killed(args: argparse.Namespace) -> dict[str, Any]:
    """Replicated volumes (`100`: each on two nodes, data centers of their own); node 1's
    volume server killed by its pid a few seconds into the job, while its chunks are
    read."""
    with cluster(NODES, args.trainer, args, args.images, "100") as (net, root, _, volumes):
        net.shape(between=args.between.split(",")[0])
        timer = threading.Timer(args.kill_after_s, lambda: end(volumes[1]))
        timer.start()
        try:
            return {"after_s": args.kill_after_s, **_run(net, args, "located", root)}
        finally:
            timer.cancel()


def _sweep(net: ClusterNet, args: argparse.Namespace, logs: Path) -> list[dict[str, Any]]:
    """Every rate between nodes; in each repeat both options, in a rotated order."""
    rows = []
    for between in args.between.split(","):
        net.shape(between=between)
        for repeat in range(args.repeats):
            modes = MODES if repeat % 2 == 0 else MODES[::-1]
            for mode in modes:
                row = _run(net, args, mode, logs)
                rows.append({"between": between, "repeat": repeat, "mode": mode, **row})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def _run(
    net: ClusterNet,
    args: argparse.Namespace,
    mode: str,
    logs: Path,
    cut: str | None = None,
    epochs: int | None = None,
) -> dict[str, Any]:
    """One job over servers just started (nothing loaded, nothing cached)."""
    procs = []
    log_files = [open(logs / f"serve{i}.log", "ab") for i in range(len(net.nodes))]  # noqa: SIM115
    caps = ExitStack()
    try:
        for i, (ip, front) in enumerate(zip(net.storage_ips, net.front_ips, strict=True)):
            env = {**os.environ, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET,
                   "OMP_NUM_THREADS": "1"}  # fmt: skip
            cmd = [*taskset(1), sys.executable, "-m", "hapi.cli", "serve", "--store", f"s3://{BUCKET}",
                   "--endpoint", f"http://{ip}:{PORTS['s3']}", "--host", front,
                   "--port", str(PORTS["hapi"]), "--threads", "1",
                   "--insecure",  # the namespaces are the benchmark's own
                   "--beside", f"http://{ip}:{PORTS['volume']}",
                   "--filer", f"http://{ip}:{PORTS['filer']}"]  # fmt: skip
            quiet = subprocess.DEVNULL
            join = caps.enter_context(CpuCap(args.server_cpu)).preexec if args.server_cpu else None
            procs.append(
                subprocess.Popen(
                    net.node_cmd(i, cmd), env=env, stdout=quiet, stderr=quiet, preexec_fn=join
                )
            )
        addresses = [f"grpc://{front}:{PORTS['hapi']}" for front in net.front_ips]
        for i, (proc, address) in enumerate(zip(procs, addresses, strict=True)):
            try:
                serving(proc, address)
            except RuntimeError:
                raise RuntimeError((logs / f"serve{i}.log").read_text()[-3000:]) from None
        epochs = epochs or args.epochs
        spec = {"addresses": addresses, "mode": mode, "epochs": epochs, "cut": cut}
        with tempfile.TemporaryDirectory(prefix="hapi-locality-cache-") as cache:
            env = {**os.environ, "OMP_NUM_THREADS": "1", "HAPI_CACHE_DIR": cache}
            cmd = [*taskset(0), sys.executable, __file__, "--worker", json.dumps(spec)]
            done = subprocess.run(net.trainer_cmd(cmd), env=env, capture_output=True,
                                  text=True, check=False, timeout=1800)  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"the job failed: {done.stderr[-2000:]}")
        return dict(json.loads(done.stdout.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            end(proc)
        caps.close()
        for file in log_files:
            file.close()


def _job(spec: dict[str, Any]) -> dict[str, Any]:
    """The trainer's script: build the job, train, report what the user waited for."""
    started = time.perf_counter()
    import torch

    torch.set_num_threads(1)
    from hapi.client import TransferJob
    from hapi.client.servers.pool import Servers

    if spec["mode"] == "today":
        # Today's routing: the servers find where the keys lie (so their reports count
        # the bytes read on their own node) and the trainer does not use it.
        locate = Servers.place

        def today(self: Servers, keys: Any) -> None:
            locate(self, keys)
            self.placement = None

        Servers.place = today  # type: ignore[method-assign,assignment]
    job = TransferJob({"name": "resnet18", "num_classes": 4}, "train", spec["addresses"],
                      freeze="layer4", cut=spec["cut"], image_size=64, batch_size=32, chunk_size=32,
                      prefetch=4, seed=0)  # fmt: skip
    history = job.fit(spec["epochs"], lr=0.01)
    return {
        "whole_s": time.perf_counter() - started,
        "epoch_s": [e.seconds for e in history.epochs],
        "samples": [e.samples for e in history.epochs],
        "samples_per_s": [e.samples / e.seconds for e in history.epochs],
        "bytes_received": [e.bytes_received for e in history.epochs],
        "local_fraction": [e.local_fraction for e in history.epochs],
        "read_bytes": [e.read_bytes for e in history.epochs],
        "failovers": sum(e.failovers for e in history.epochs),
    }


def _summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rate between nodes: each option's medians, and located / today per repeat."""
    out = []
    for between in dict.fromkeys(r["between"] for r in rows):
        at = [r for r in rows if r["between"] == between]
        by = {m: [r for r in at if r["mode"] == m] for m in MODES}
        pairs = [
            (t, loc)
            for t in by["today"]
            for loc in by["located"]
            if t["repeat"] == loc["repeat"]
        ]  # fmt: skip
        out.append({
            "between": between,
            **{f"{m}_epoch_s": statistics.median(r["epoch_s"][-1] for r in by[m]) for m in MODES},
            **{f"{m}_whole_s": statistics.median(r["whole_s"] for r in by[m]) for m in MODES},
            **{f"{m}_local": statistics.median(r["local_fraction"][-1] or 0.0 for r in by[m])
               for m in MODES},
            "epoch_ratio": statistics.median(
                loc["epoch_s"][-1] / t["epoch_s"][-1] for t, loc in pairs),
            "whole_ratio": statistics.median(loc["whole_s"] / t["whole_s"] for t, loc in pairs),
        })  # fmt: skip
    return out


def _section(out: dict[str, Any]) -> str:
    args, rows = out["args"], out["rows"]
    lines = [
        "## Locality: chunks read beside their bytes on a storage cluster",
        "",
        f"{NODES} SeaweedFS storage nodes in their own network namespaces (volume server, "
        f"filer + S3 gateway, `hapi serve --beside --filer` each; all on core 1, each hapi "
        f"server held to {args.get('server_cpu', '0')} of it by a CPU cgroup of its own, so "
        f"that it keeps its pace as a machine of its own does), the trainer "
        f"in a fourth (core 0); links between nodes shaped at each rate below, "
        f"{args['trainer']} to the trainer. ResNet-18 to `layer4` at 64 px, fresh "
        f"augmentation, {args['images']} photo-like JPEGs of {out['object_bytes'] / 1e3:.0f} KB, "
        f"{args['epochs']} epochs, {args['repeats']} repeats, both options in each "
        f"(medians; ratios per repeat). `today`: the trainer does not ask where keys lie; "
        f"`located`: it does (issue 54). {out['machine']}.",
        "",
        *_shares_lines(out.get("node_shares") or []),
        "| between nodes | local fraction today / located | last epoch today / located (s) "
        "| located / today | whole run today / located (s) | located / today |",
        "|---|---|---|---|---|---|",
    ]
    for s in _summary(rows):
        lines.append(
            f"| {s['between']} | {s['today_local']:.2f} / **{s['located_local']:.2f}** | "
            f"{s['today_epoch_s']:.1f} / {s['located_epoch_s']:.1f} | "
            f"**{s['epoch_ratio']:.2f}x** | "
            f"{s['today_whole_s']:.1f} / {s['located_whole_s']:.1f} | {s['whole_ratio']:.2f}x |"
        )
    lines += _scale_lines(out.get("scale") or [], args)
    killed = out.get("killed")
    if killed:
        lines += [
            "",
            f"A volume server killed by its pid {killed['after_s']:.0f} s into a job on "
            f"replicated volumes (`100`, {args['between'].split(',')[0]} between nodes): "
            f"the epochs trained {' and '.join(map(str, killed['samples']))} of "
            f"{args['images']} samples, each once; local fraction "
            f"{' and '.join(f'{x:.2f}' for x in killed['local_fraction'])}, "
            f"epochs {' and '.join(f'{x:.1f}' for x in killed['epoch_s'])} s.",
        ]
    lines += [
        "",
        f"Goals: local fraction >= {GOAL_LOCAL}, epoch time located / today <= {GOAL_RATIO}x "
        "where the links between nodes bind. Every run trained every sample once "
        f"(samples per epoch: {sorted({n for r in rows for n in r['samples']})}).",
        "",
        "    python benchmarks/locality.py --results",
        "",
        "![locality](out/locality.png)",
    ]
    return "\n".join(lines)


def _shares_lines(shares: list[float]) -> list[str]:
    if not shares:
        return []
    held = " / ".join(f"{100 * x:.0f}%" for x in shares)
    return [
        f"The photos' bytes lay {held} on the three nodes, as a large cluster spreads its "
        "objects over its hundreds of volumes: each node is a data center of its own with "
        "as many volumes, and a third of the photos is written through each node's gateway "
        "(`spread_volumes`). Left to itself, SeaweedFS grew 7 volumes, 1 / 3 / 3 on the "
        "nodes (14% / 43% / 43% of the bytes); with 2 volumes a node and one gateway, 28% / "
        "38% / 34%. A balanced epoch then reads a fifth, or a twentieth, of its bytes on "
        "other nodes whatever the routing.",
        "",
    ]


def _scale_summary(scale: list[dict[str, Any]]) -> list[tuple[int, float, float]]:
    """(nodes, median samples/s over all epochs, that over nodes x one node's).

    Over every epoch, the first's start included: a later epoch's own figure counts the
    chunks fetched ahead while the one before drained (4 per server), which with three
    servers were most of an epoch of 300 and read as 1.5x more than three links carry."""
    rates = {
        n: statistics.median(
            sum(r["samples"]) / sum(r["epoch_s"]) for r in scale if r["nodes"] == n
        )
        for n in dict.fromkeys(r["nodes"] for r in scale)
    }
    one = rates.get(1)
    return [(n, v, v / (n * one) if one else float("nan")) for n, v in rates.items()]


def _scale_lines(scale: list[dict[str, Any]], args: dict[str, str]) -> list[str]:
    if not scale:
        return []
    lines = [
        "",
        f"Throughput with 1-3 storage nodes (a cluster of each size, {args['scale_images']} "
        f"photos, cut `{args['scale_cut']}`, each node's link to the trainer "
        f"{args['scale_trainer']} and 1gbit between nodes; `located`; "
        f"{args.get('scale_epochs', 2)} epochs, their samples over their time):",
        "",
        "| storage nodes | samples/s over every epoch | / (nodes x one node's) |",
        "|---|---|---|",
    ]
    for nodes, rate, ratio in _scale_summary(scale):
        lines.append(f"| {nodes} | {rate:.0f} | **{ratio:.2f}** |")
    return lines


def _plot(rows: list[dict[str, Any]], scale: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = _summary(rows)
    fig, (left, right, third) = plt.subplots(1, 3, figsize=(12, 3.4))
    xs = range(len(summary))
    for k, (mode, color) in enumerate(zip(MODES, ("tab:gray", "tab:green"), strict=True)):
        at = [x + (k - 0.5) * 0.38 for x in xs]
        left.bar(at, [s[f"{mode}_epoch_s"] for s in summary], 0.38, label=mode, color=color)
        right.bar(at, [s[f"{mode}_local"] for s in summary], 0.38, label=mode, color=color)
    for ax, label in ((left, "last epoch, s (median)"), (right, "bytes read on own node")):
        ax.set_xticks(list(xs), [f"{s['between']} between nodes" for s in summary], fontsize=8)
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    right.axhline(GOAL_LOCAL, color="k", lw=0.8, ls="--")
    scaled = _scale_summary(scale) if scale else []
    if scaled:
        nodes = [n for n, _, _ in scaled]
        third.plot(nodes, [r for _, r, _ in scaled], "o-", color="tab:green", label="located")
        third.plot(nodes, [n * scaled[0][1] for n in nodes], ":", color="k", label="N x one node")
        third.set_xticks(nodes)
        third.set_xlabel("storage nodes")
        third.set_ylabel("samples/s (every epoch)")
        third.legend(fontsize=7)
    fig.suptitle("3 storage nodes: chunks routed by measured rate (today) or beside their bytes",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
