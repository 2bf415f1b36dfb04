"""Dataset formats: the same photo-like JPEGs (about 100 KB each) as single objects, as
WebDataset shards and as Parquet files, on SeaweedFS on loopback.

One `hapi serve` (one core, one torch thread; SeaweedFS floats on the machine's cores)
serves an epoch of each format to this process on another core, with 4 chunks of 64 in
flight, in the loader's own order for that dataset (shard order for shards): samples/s
at RAW (the server only reads and sends: per-request latency binds) and at a pushed-down
cut (ResNet-18 at 64 px to `layer2`: decoding binds). Formats run interleaved in each
repeat; the figure is the median. Store requests per epoch are counted by running the
epoch's chunks through the same read path (`hapi.data.samples.read_objects`) over a store
that counts the requests reaching it; index requests (once per shard version) apart.

    python benchmarks/formats.py                 # writes benchmarks/out/formats.{json,png}
    python benchmarks/formats.py --results       # ... and its section of RESULTS.md
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the tests' SeaweedFS helper

from _host import end, machine, pin, taskset  # noqa: E402
from _results import write_section  # noqa: E402

FORMATS = ("objects", "webdataset", "parquet")


class Counting:
    """The store at the boundary, counting the requests that reach it."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.uri, self.requests = inner, inner.uri, 0

    def get(self, key: str) -> bytes:
        self.requests += 1
        return bytes(self.inner.get(key))

    def get_range_versioned(self, key: str, start: int, end: int) -> tuple[bytes, str, int]:
        self.requests += 1
        return self.inner.get_range_versioned(key, start, end)  # type: ignore[no-any-return]

    def list_versions(self, prefix: str = "") -> Any:
        return self.inner.list_versions(prefix)  # listings are not counted: once per job


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--stored-size", type=int, default=440, help="side of the JPEGs")
    parser.add_argument("--shard-size", default="16MB")
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--prefetch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=HERE / "out")
    parser.add_argument("--results", action="store_true", help="write benchmarks/RESULTS.md")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    pin(1)
    os.environ.setdefault("HAPI_CACHE_DIR", tempfile.mkdtemp(prefix="hapi-formats-"))
    load_before = os.getloadavg()[0]
    from tests.seaweed import SeaweedS3

    with tempfile.TemporaryDirectory() as tmp, SeaweedS3(Path(tmp) / "weed") as weed:
        bucket = weed.new_bucket()
        names, sizes, index_requests = _write(Path(tmp), bucket, weed.options, args)
        runs: dict[str, dict[str, list[float]]] = {f: {"raw": [], "cut": []} for f in FORMATS}
        requests: dict[str, int] = {}
        chunks: dict[str, list[list[str]]] = {}
        with _Server(bucket, weed) as server:
            for repeat in range(args.repeats):
                for fmt in FORMATS:
                    for cut in ("raw", "cut"):
                        rate, chunks[fmt] = _epoch(server, names[fmt], cut, args, repeat)
                        runs[fmt][cut].append(rate)
                        print(
                            f"{fmt} {cut} repeat {repeat}: {runs[fmt][cut][-1]:.0f}/s", flush=True
                        )
        for fmt in FORMATS:
            requests[fmt] = _requests(bucket, weed.options, names[fmt], chunks[fmt])
    result = {
        "machine": machine(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "mean_image_bytes": sizes,
        "samples_per_s": runs,
        "requests_per_epoch": requests,
        "index_requests": index_requests,
        # Other jobs on the machine's cores bound every format's rate: say how many.
        "load_average": {"before": load_before, "after": os.getloadavg()[0]},
    }
    (args.out / "formats.json").write_text(json.dumps(result, indent=1))
    _plot(result, args.out / "formats.png")
    report = _report(result, args)
    print(report)
    if args.results:
        write_section("formats", report)


def _write(
    tmp: Path, bucket: str, options: Any, args: argparse.Namespace
) -> tuple[dict[str, str], int, dict[str, int]]:
    from hapi._sizes import parse_bytes
    from hapi.data import DatasetManifest, import_folder, open_store, shard_indexes, synth_dataset
    from hapi.data.members import MemberStore
    from hapi.data.shard_writer import import_shards

    source = tmp / "src"
    per_class = args.images // 4
    synth_dataset(open_store(source), classes=4, per_class=per_class, size=args.stored_size, seed=0)
    files = [p for p in source.rglob("*.jpg")]
    mean = int(statistics.mean(p.stat().st_size for p in files))
    store = open_store(bucket, options)
    import_folder(source, store, "objects")
    index_requests = {"objects": 0}
    for fmt in ("webdataset", "parquet"):
        import_shards(source, store, fmt, format=fmt, shard_size=parse_bytes(args.shard_size))  # type: ignore[arg-type]
        # Indexes built from nothing kept: in memory (writing built them) nor on disk.
        shard_indexes._MEMORY.clear()
        os.environ["HAPI_CACHE_DIR"] = tempfile.mkdtemp(prefix="hapi-formats-")
        counting = Counting(open_store(bucket, options))
        DatasetManifest.from_store(MemberStore(counting), fmt)  # type: ignore[arg-type]
        index_requests[fmt] = counting.requests
    return {f: f for f in FORMATS}, mean, index_requests


class _Server:
    """`hapi serve` over the bucket in a subprocess on core 0, stopped by its pid."""

    def __init__(self, bucket: str, weed: Any) -> None:
        from tests.seaweed import free_port

        self.bucket, self.weed = bucket, weed
        self.port = free_port()
        self.address = f"grpc://127.0.0.1:{self.port}"

    def __enter__(self) -> _Server:
        from hapi.client import connect

        cmd = [
            *taskset(0),
            sys.executable,
            "-m",
            "hapi.cli",
            "serve",
            "--store",
            self.bucket,
            "--endpoint",
            self.weed.endpoint,
            "--port",
            str(self.port),
            "--threads",
            "1",
        ]
        env = {**os.environ, **self.weed.client_env, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                connect(self.address, timeout=2).stats()
                return self
            except Exception:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    end(self.proc)
                    raise RuntimeError(f"server on {self.address} did not start") from None
                time.sleep(0.2)

    def __exit__(self, *exc: object) -> None:
        end(self.proc)


def _epoch(
    server: _Server, dataset: str, cut: str, args: argparse.Namespace, epoch: int
) -> tuple[float, list[list[str]]]:
    """Samples/s of one epoch of `dataset`'s chunks in the loader's order, K in flight;
    and the chunks' keys."""
    from hapi.client import FeatureLoader, connect
    from hapi.data import Transforms
    from hapi.graph import RAW, ModelSpec, build_model, trace
    from hapi.wire import ChunkTicket, SessionRequest

    spec = ModelSpec(name="resnet18", num_classes=4)
    at = RAW if cut == "raw" else trace(build_model(spec), (3, 64, 64)).resolve_cut("layer2")
    conn = connect(server.address)
    with conn:
        manifest = conn.manifest(dataset)
        info = conn.open_session(
            SessionRequest(
                model=spec.to_dict(),
                cut=at,
                transforms=Transforms.eval(64).to_dict(),
                image_size=64,
            )
        )
        loader = FeatureLoader(
            conn, info.session, manifest, batch_size=64, chunk_size=args.chunk_size, seed=1
        )
        tickets = [
            ChunkTicket(session=info.session, chunk=i, epoch=epoch, keys=keys, labels=labels)
            for i, (keys, labels) in enumerate(loader.chunks(epoch))
        ]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.prefetch) as pool:
            samples = sum(len(b.keys) for r in pool.map(conn.fetch, tickets) for b in r.batches)
        seconds = time.perf_counter() - t0
        conn.close_session(info.session)
    if samples != len(manifest):
        raise RuntimeError(f"{dataset}: {samples} of {len(manifest)} samples came back")
    return samples / seconds, [t.keys for t in tickets]


def _requests(bucket: str, options: Any, dataset: str, chunks: list[list[str]]) -> int:
    """Store requests of an epoch's chunk reads (indexes already built)."""
    from hapi.data import DatasetManifest, open_store
    from hapi.data.members import MemberStore
    from hapi.data.samples import read_objects

    counting = Counting(open_store(bucket, options))
    members = MemberStore(counting)
    DatasetManifest.from_store(members, dataset)  # type: ignore[arg-type]
    counting.requests = 0
    for keys in chunks:
        for blob in read_objects(members, keys):  # type: ignore[arg-type]
            if isinstance(blob, BaseException):
                raise blob
    return counting.requests


def _report(result: dict[str, Any], args: argparse.Namespace) -> str:
    runs, req = result["samples_per_s"], result["requests_per_epoch"]
    med = {f: {c: statistics.median(v) for c, v in runs[f].items()} for f in FORMATS}
    lines = [
        "## Dataset formats (`benchmarks/formats.py`)",
        "",
        f"`python benchmarks/formats.py --results`: {args.images} JPEGs of "
        f"{result['mean_image_bytes'] / 1e3:.0f} KB on average, on "
        f"SeaweedFS on loopback; one `hapi serve` on one core; chunks of {args.chunk_size}, "
        f"{args.prefetch} in flight, in the loader's order; shards of {args.shard_size}. "
        f"Medians of {args.repeats} interleaved repeats. Machine: {result['machine']}"
        + (
            f", load average (1 min) {load['before']:.1f} before and {load['after']:.1f} "
            "after the run."
            if (load := result.get("load_average"))
            else "."
        ),
        "",
        "| format | samples/s at RAW | vs objects | samples/s at layer2 (64 px) | vs objects "
        "| store requests per epoch | index requests (once) |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in FORMATS:
        lines.append(
            f"| {f} | {med[f]['raw']:.0f} | {med[f]['raw'] / med['objects']['raw']:.1f}x "
            f"| {med[f]['cut']:.0f} | {med[f]['cut'] / med['objects']['cut']:.2f}x "
            f"| {req[f]} | {result['index_requests'][f]} |"
        )
    ratios = {f: med[f]["raw"] / med["objects"]["raw"] for f in ("webdataset", "parquet")}
    lines += [
        "",
        "Goal (issue 41): shards at least 5x the samples/s of single objects at RAW - "
        + ("met" if min(ratios.values()) >= 5 else "not met")
        + f" (webdataset {ratios['webdataset']:.1f}x, parquet {ratios['parquet']:.1f}x).",
        "",
        "![samples per second and requests per format](out/formats.png)",
    ]
    return "\n".join(lines)


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["samples_per_s"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.38
    for i, cut in enumerate(("raw", "cut")):
        values = [statistics.median(runs[f][cut]) for f in FORMATS]
        ax.bar(
            [x + i * width for x in range(len(FORMATS))],
            values,
            width,
            label=cut.upper() if cut == "raw" else "layer2",
        )
    ax.set_xticks([x + width / 2 for x in range(len(FORMATS))], FORMATS)
    ax.set_ylabel("samples/s (one server core)")
    ax.set_title("Formats on SeaweedFS (loopback)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
