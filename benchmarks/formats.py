"""Dataset formats: the same photo-like JPEGs (about 100 KB each) as single objects, as
WebDataset shards and as Parquet files, on SeaweedFS, against the peer reading the shards.

SeaweedFS and one `hapi serve` (one torch thread) share one pinned core; this process (the
trainer) takes the other. Two settings: SeaweedFS on loopback, and each store request held
back `--delay-ms` by a proxy (`_delay_proxy.py`; these machines have no `netem`), a cloud
store's first-byte latency. In each, interleaved in every repeat: an epoch of each format
in the loader's order, 4 chunks of 64 in flight, at RAW (the server reads and sends, the
trainer only counts) and at a pushed-down cut (ResNet-18 at 64 px to `layer2`, the first
`--cut-samples`); the WebDataset epoch at RAW with the trainer decoding; what a job's
training loop gets from the WebDataset shards, decoded images at cut INPUT, decoded by
the server alone and with a share of the chunks decoded in the trainer (`_formats_job.py`);
and the peer (a `DataLoader` over `s3torchconnector`, `_formats_peer.py`) on the same
shards, decoding the same way. Figures are medians. Store requests per epoch are counted
at the proxy; index requests (once per shard version) by a counting store; the server
core's CPU per sample from /proc.

    python benchmarks/formats.py                 # writes benchmarks/out/formats.{json,png}
    python benchmarks/formats.py --results       # ... and its section of RESULTS.md
    python benchmarks/formats.py --from-json F   # report a run's JSON again
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the tests' SeaweedFS helper

from _delay_proxy import DelayProxy  # noqa: E402
from _formats_job import SHARE_NOTE, balanced_share, job_epoch  # noqa: E402
from _formats_peer import peer_epoch  # noqa: E402
from _formats_setup import FORMATS, Server, hapi_epoch, write_formats  # noqa: E402
from _host import machine, pin  # noqa: E402
from _results import write_section  # noqa: E402

MODES = ("raw", "cut", "trainer", "input", "hybrid")
"""The server's delivery at RAW and at a pushed-down cut; RAW with the trainer decoding;
a job's decoded inputs at INPUT, the server decoding all or a share decoded locally."""
LABELS = {
    "raw": "RAW",
    "cut": "layer2",
    "trainer": "RAW + trainer decodes",
    "input": "job: server decodes",
    "hybrid": "job: + local share",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=10000)
    parser.add_argument("--stored-size", type=int, default=440, help="side of the JPEGs")
    parser.add_argument("--shard-size", default="16MB")
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--prefetch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--delay-ms", type=float, default=20.0, help="added to each request")
    parser.add_argument("--cut-samples", type=int, default=1024, help="timed at the cut")
    parser.add_argument("--peer-workers", type=int, default=2)
    parser.add_argument(
        "--share", type=float, help="the hybrid's local share (default: balanced, measured)"
    )
    parser.add_argument("--out", type=Path, default=HERE / "out")
    parser.add_argument("--results", action="store_true", help="write benchmarks/RESULTS.md")
    parser.add_argument("--from-json", type=Path, help="report a run's JSON, measuring nothing")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        result = json.loads(args.from_json.read_text())
        for k, v in result["args"].items():
            if k in ("images", "chunk_size", "prefetch", "repeats", "cut_samples", "peer_workers"):
                setattr(args, k, int(v))
            elif k == "share":
                setattr(args, k, None if v == "None" else float(v))
            elif k in ("shard_size", "delay_ms"):
                setattr(args, k, float(v) if k == "delay_ms" else v)
        _finish(result, args)
        return
    os.environ.setdefault("HAPI_CACHE_DIR", tempfile.mkdtemp(prefix="hapi-formats-"))
    load_before = os.getloadavg()[0]
    from tests.seaweed import SeaweedS3

    settings = ("loopback", f"{args.delay_ms:g} ms")
    # Decoding in the trainer is the same work for every format: it is timed against
    # the peer on the shards the peer reads.
    options = [(f, m) for m in ("raw", "cut") for f in FORMATS]
    options += [("webdataset", m) for m in ("trainer", "input", "hybrid")]
    options += [("peer", "trainer")]
    shares: dict[str, float] = {}
    runs: dict[str, dict[str, list[float]]] = {
        s: {f"{f} {m}": [] for f, m in options} for s in settings
    }
    requests: dict[str, int] = {}
    cpu: dict[str, dict[str, list[list[float]]]] = {s: {f: [] for f in FORMATS} for s in settings}
    with tempfile.TemporaryDirectory() as tmp:
        # SeaweedFS starts on core 0 (and Go sizes itself to it), with `hapi serve`;
        # this process, the trainer, and the proxy (the network) take core 1.
        pin(0)
        weed = SeaweedS3(Path(tmp) / "weed").start()
        pin(1)
        try:
            bucket = weed.new_bucket()
            sizes, index_requests = write_formats(Path(tmp), bucket, weed.options, args)
            upstream = ("127.0.0.1", int(weed.ports["s3"]))
            with (
                DelayProxy(upstream, delay_s=args.delay_ms / 1e3, core=1) as proxy,
                Server(bucket, weed, weed.endpoint, 0) as direct,
                Server(bucket, weed, proxy.endpoint, 0) as delayed,
            ):
                servers = dict(zip(settings, (direct, delayed), strict=True))
                endpoints = {settings[0]: weed.endpoint, settings[1]: proxy.endpoint}
                for repeat in range(args.repeats):
                    for setting in settings:
                        for fmt, mode in options:
                            before = proxy.requests()
                            pids = (_pid(weed.proc), servers[setting].proc.pid)
                            cpu0 = [_cpu_s(p) for p in pids]
                            if fmt == "peer":
                                n, s = peer_epoch(
                                    bucket, endpoints[setting], weed, 1, args.peer_workers
                                )
                                if n != args.images:
                                    raise RuntimeError(f"the peer read {n} of {args.images}")
                                rate = n / s
                            elif mode in ("input", "hybrid"):
                                share = 0.0
                                if mode == "hybrid":
                                    share = shares.setdefault(setting, _share(runs[setting], args))
                                rate = job_epoch(servers[setting], fmt, share, args)
                            else:
                                rate = hapi_epoch(servers[setting], fmt, mode, args, repeat)
                            if setting != settings[0] and mode in ("raw", "trainer"):
                                # The peer's process and a job read two epochs: the second is timed.
                                epochs = 2 if fmt == "peer" else 1
                                requests[f"{fmt} {mode}"] = (proxy.requests() - before) // epochs
                            runs[setting][f"{fmt} {mode}"].append(rate)
                            if mode == "raw":
                                spent = [_cpu_s(p) - c for p, c in zip(pids, cpu0, strict=True)]
                                cpu[setting][fmt].append([1e3 * c / args.images for c in spent])
                            print(f"{setting} {fmt} {mode} #{repeat}: {rate:.0f}/s", flush=True)
        finally:
            weed.stop()
    result = {
        "machine": machine(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "mean_image_bytes": sizes,
        "samples_per_s": runs,
        "requests_per_epoch": requests,
        # The server core's CPU ms per sample at RAW: [SeaweedFS, hapi serve] per repeat.
        "cpu_ms_per_sample": cpu,
        "index_requests": index_requests,
        "local_share": shares,
        # Other jobs on the machine's cores bound every format's rate: say how many.
        "load_average": {"before": load_before, "after": os.getloadavg()[0]},
    }
    _finish(result, args)


def _finish(result: dict[str, Any], args: argparse.Namespace) -> None:
    (args.out / "formats.json").write_text(json.dumps(result, indent=1))
    _plot(result, args.out / "formats.png")
    report = _report(result, args)
    print(report)
    if args.results:
        write_section("formats", report)


def _share(runs: dict[str, list[float]], args: argparse.Namespace) -> float:
    """The hybrid's local share: `--share`, or balanced from this run's first rates."""
    if args.share is not None:
        return float(args.share)
    return balanced_share(runs["webdataset trainer"][0], runs["webdataset input"][0])


def _pid(proc: subprocess.Popen[bytes] | None) -> int:
    if proc is None:
        raise RuntimeError("SeaweedFS is not running")
    return proc.pid


def _cpu_s(pid: int) -> float:
    """CPU seconds a process (all its threads) has used, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _report(result: dict[str, Any], args: argparse.Namespace) -> str:
    req = result["requests_per_epoch"]
    med = {
        setting: {k: statistics.median(v) for k, v in runs.items()}
        for setting, runs in result["samples_per_s"].items()
    }
    settings = list(med)
    load = result["load_average"]
    shares = result.get("local_share", {})
    lines = [
        "## Dataset formats (`benchmarks/formats.py`)",
        "",
        f"`python benchmarks/formats.py --images {args.images} --repeats {args.repeats} "
        f"--cut-samples {args.cut_samples} --results` (10,000 in the issue: fewer, so the run "
        f"fits the shared machine's benchmark lock): {args.images} JPEGs of "
        f"{result['mean_image_bytes'] / 1e3:.0f} KB on average (shards of {args.shard_size}) "
        "on SeaweedFS; SeaweedFS and one `hapi serve` (one torch thread) share one pinned "
        "core, the trainer takes the other; chunks of "
        f"{args.chunk_size}, {args.prefetch} in flight, in the loader's order. Two settings: "
        f"SeaweedFS on loopback, and every store request held back {args.delay_ms:g} ms (a "
        "cloud store's first-byte latency) by a proxy on the trainer's core that passes "
        "responses back zero-copy. RAW: the server reads and sends, the trainer only counts; "
        f"layer2: pushed down to ResNet-18's `layer2` at 64 px (the epoch's first "
        f"{args.cut_samples} samples). Medians of {args.repeats} interleaved repeats. "
        f"Machine: {result['machine']}, load average (1 min) {load['before']:.1f} before and "
        f"{load['after']:.1f} after the run.",
        "",
        "| setting | format | RAW samples/s | vs objects | layer2 samples/s | vs objects "
        "| store requests per epoch |",
        "|---|---|---|---|---|---|---|",
    ]
    for setting in settings:
        m = med[setting]
        runs = result["samples_per_s"][setting]
        for f in FORMATS:
            lines.append(
                f"| {setting} | {f} | {m[f + ' raw']:.0f}{_spread(runs[f + ' raw'])} "
                f"| {m[f + ' raw'] / m['objects raw']:.1f}x | {m[f + ' cut']:.0f} "
                f"| {m[f + ' cut'] / m['objects cut']:.2f}x | {req.get(f + ' raw', '-')} |"
            )
    lines += [
        "",
        "Store requests are counted at the proxy (the delayed setting's epochs, listings "
        "included: one LIST page per 1000 keys); indexing the shards took "
        f"{result['index_requests']['webdataset']} (WebDataset) and "
        f"{result['index_requests']['parquet']} (Parquet) requests once, kept after. "
        "A rate whose repeats differ by more than 1.5x is followed by them. " + _cores(result, med),
        "",
        "Against the peer, decoded 64 px images (`Transforms.eval(64)`) from the same "
        "WebDataset shards: the peer is a PyTorch `DataLoader` "
        f"({args.peer_workers} workers on the trainer's core: where a DataLoader runs) over "
        "`s3torchconnector`'s `S3IterableDataset`, streaming the shards and decoding with "
        "hapi's function; `RAW + trainer decodes`: the server sends RAW and the trainer "
        "decodes each batch as it arrives (the benchmark's own fetch, not the job's); "
        "`job`: the batches a `TransferJob` at cut INPUT hands its training loop (its own "
        "loader, `_formats_job.py`), the server decoding every chunk on the core beside "
        "the data, or a fixed share of them decoded in the trainer from RAW ("
        + SHARE_NOTE
        + ": "
        + ", ".join(f"{s} {v:.2f}" for s, v in shares.items())
        + "). The peer and the job: epoch 2 of 2 (workers started, sessions opened).",
        "",
        "| setting | delivery | samples/s | vs peer | store requests per epoch |",
        "|---|---|---|---|---|",
    ]
    for setting in settings:
        m, runs = med[setting], result["samples_per_s"][setting]
        peer = m["peer trainer"]
        for mode in ("trainer", "input", "hybrid"):
            key = f"webdataset {mode}"
            if key not in m:
                continue
            label = LABELS[mode] + (f" ({shares[setting]:.2f})" if mode == "hybrid" else "")
            lines.append(
                f"| {setting} | {label} | {m[key]:.0f}{_spread(runs[key])} | {m[key] / peer:.2f}x "
                f"| {req.get(key, '-')} |"
            )
        lines.append(
            f"| {setting} | peer | {peer:.0f}{_spread(runs['peer trainer'])} | 1.00x "
            f"| {req.get('peer trainer', '-')} |"
        )
    lines.append("")
    for setting in settings:
        m = med[setting]
        ratios = {f: m[f + " raw"] / m["objects raw"] for f in ("webdataset", "parquet")}
        jobs = [m[k] for k in ("webdataset input", "webdataset hybrid") if k in m]
        job = max(jobs) / m["peer trainer"] if jobs else float("nan")
        alone = m["webdataset trainer"] / m["peer trainer"]
        lines.append(
            f"Goals (issue 41), {setting}: shards at least 5x the samples/s of single objects "
            "at RAW - "
            + ("met" if min(ratios.values()) >= 5 else "not met")
            + f" (webdataset {ratios['webdataset']:.1f}x, parquet {ratios['parquet']:.1f}x); "
            "at least as fast as the peer reading the same shards - "
            + ("met" if job >= 1 else "not met")
            + f" (the job's best delivery {job:.2f}x; the trainer decoding RAW alone "
            f"{alone:.2f}x)."
        )
    lines += ["", "![samples per second per format and setting](out/formats.png)"]
    return "\n".join(lines)


def _spread(rates: list[float]) -> str:
    """The repeats of a rate that they do not agree on (over 1.5x apart), else nothing."""
    if len(rates) > 1 and max(rates) > 1.5 * min(rates):
        return " (" + ", ".join(f"{r:.0f}" for r in rates) + ")"
    return ""


def _cores(result: dict[str, Any], med: dict[str, dict[str, float]]) -> str:
    """Where the server's core went at RAW, and the bound that puts on shards."""
    per_setting = result.get("cpu_ms_per_sample", {})
    text = (
        "Where the server's core goes at RAW (CPU ms per sample over the epoch's call, "
        "its listing and session included; medians: SeaweedFS + `hapi serve`): "
        + "; ".join(
            f"{setting}: "
            + ", ".join(
                f"{f} {statistics.median(r[0] for r in rs):.2f} + "
                f"{statistics.median(r[1] for r in rs):.2f}"
                for f, rs in per.items()
                if rs
            )
            for setting, per in per_setting.items()
        )
        + "."
    )
    for setting, per in per_setting.items():
        cost = {f: [statistics.median(r[i] for r in rs) for i in (0, 1)] for f, rs in per.items()}
        if all(per.values()):
            busy = {f: med[setting][f + " raw"] * sum(cost[f]) / 1e3 for f in FORMATS}
            text += (
                f" At RAW ({setting}) the server's core was busy {busy['objects']:.0%} of the "
                f"epoch for objects, {busy['webdataset']:.0%} for WebDataset and "
                f"{busy['parquet']:.0%} for Parquet (its CPU over the whole call against the "
                "timed fetch: over 100% where listing weighs): a single object costs it "
                f"{sum(cost['objects']):.2f} ms, and SeaweedFS alone spends "
                f"{cost['webdataset'][0]:.2f} ms per WebDataset sample, so shards could be at "
                f"most {sum(cost['objects']) / cost['webdataset'][0]:.1f}x as fast on this core "
                "were `hapi serve` free."
            )
    return text


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(result["samples_per_s"])
    fig, axes = plt.subplots(1, len(settings), figsize=(11, 4), sharey=True)
    width = 0.16
    names = [*FORMATS, "peer"]
    for ax, setting in zip(axes, settings, strict=True):
        runs = result["samples_per_s"][setting]
        for i, mode in enumerate(MODES):
            xs = [x + i * width for x, f in enumerate(names) if f"{f} {mode}" in runs]
            values = [
                statistics.median(runs[f"{f} {mode}"]) for f in names if f"{f} {mode}" in runs
            ]
            label = LABELS[mode] if mode != "trainer" else "RAW + trainer decodes (peer: decodes)"
            ax.bar(xs, values, width, label=label)
        ax.set_xticks([x + 2 * width for x in range(len(names))], names)
        ax.set_title(f"SeaweedFS, {setting}")
    axes[0].set_ylabel("samples/s")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
