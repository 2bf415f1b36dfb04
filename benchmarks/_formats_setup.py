"""The formats benchmark's parts: writing the dataset in each format, `hapi serve` as a
pinned subprocess, and hapi's epochs (the server's delivery alone, and with the trainer
decoding at RAW)."""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _host import end, serving, taskset

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


def write_formats(
    tmp: Path, bucket: str, options: Any, args: argparse.Namespace
) -> tuple[int, dict[str, int]]:
    """The photos in each format under its name as prefix; their mean size and the
    requests that indexing each format's shards takes (once per shard version)."""
    from hapi._sizes import parse_bytes
    from hapi.data import DatasetManifest, import_folder, open_store, synth_dataset
    from hapi.data.shard_writer import import_shards
    from hapi.data.shards import indexes as shard_indexes
    from hapi.data.shards.members import MemberStore

    source = tmp / "src"
    per_class = args.images // 4
    synth_dataset(open_store(source), classes=4, per_class=per_class, size=args.stored_size, seed=0)
    mean = int(statistics.mean(p.stat().st_size for p in source.rglob("*.jpg")))
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
    return mean, index_requests


class Server:
    """`hapi serve` over the bucket through `endpoint`, a subprocess pinned to `core`,
    stopped by its pid."""

    def __init__(self, bucket: str, weed: Any, endpoint: str, core: int) -> None:
        from tests.seaweed import free_port

        self.bucket, self.weed, self.endpoint, self.core = bucket, weed, endpoint, core
        self.port = free_port()
        self.address = f"grpc://127.0.0.1:{self.port}"

    def __enter__(self) -> Server:
        cmd = [*taskset(self.core), sys.executable, "-m", "hapi.cli", "serve"]
        cmd += ["--store", self.bucket, "--endpoint", self.endpoint, "--port", str(self.port)]
        cmd += ["--threads", "1"]
        env = {**os.environ, **self.weed.client_env, "OMP_NUM_THREADS": "1"}
        env["AWS_ENDPOINT_URL"] = self.endpoint
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
        )
        serving(self.proc, self.address)
        return self

    def __exit__(self, *exc: object) -> None:
        end(self.proc)


def hapi_epoch(
    server: Server,
    dataset: str,
    mode: str,
    args: argparse.Namespace,
    epoch: int,
) -> float:
    """Samples/s of `dataset`'s chunks in the loader's order, K in flight.

    `mode`: `raw` (the server reads and sends, the trainer only counts), `cut` (pushed
    down to ResNet-18's `layer2` at 64 px; the first `args.cut_samples` of the epoch) or
    `trainer` (RAW, each batch decoded and transformed in the fetching thread as the job's
    local pipeline does, `RawDecoder`).
    """
    from hapi.client import connect
    from hapi.client.servers.decode import RawDecoder
    from hapi.data import Transforms
    from hapi.errors import SessionNotFound
    from hapi.graph import RAW, ModelSpec, build_model, trace
    from hapi.wire import ChunkTicket, SessionRequest

    spec = ModelSpec(name="resnet18", num_classes=4)
    at = RAW if mode != "cut" else trace(build_model(spec), (3, 64, 64)).resolve_cut("layer2")
    transforms = Transforms.eval(64)
    decode = RawDecoder(transforms, 1, "raise")
    conn = connect(server.address)
    with conn:
        manifest = conn.manifest(dataset)
        info = conn.open_session(
            SessionRequest(
                model=spec.to_dict(), cut=at, transforms=transforms.to_dict(), image_size=64
            )
        )
        from hapi.client import FeatureLoader

        loader = FeatureLoader(
            conn, info.session, manifest, batch_size=64, chunk_size=args.chunk_size, seed=1
        )
        chunks = list(loader.chunks(epoch))
        if mode == "cut":
            chunks = chunks[: max(1, args.cut_samples // args.chunk_size)]
        tickets = [
            ChunkTicket(session=info.session, chunk=i, epoch=epoch, keys=keys, labels=labels)
            for i, (keys, labels) in enumerate(chunks)
        ]

        def fetch(ticket: ChunkTicket) -> int:
            batches = conn.fetch(ticket).batches
            if mode == "trainer":
                batches = [decode(b, epoch)[0] for b in batches]
            return sum(len(b.keys) for b in batches)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.prefetch) as pool:
            samples = sum(pool.map(fetch, tickets))
        seconds = time.perf_counter() - t0
        # The epoch is counted below; a session the server already reaped is no failure.
        with contextlib.suppress(SessionNotFound):
            conn.close_session(info.session)
    expected = sum(len(t.keys) for t in tickets)
    if samples != expected:
        raise RuntimeError(f"{dataset} {mode}: {samples} of {expected} samples came back")
    return samples / seconds
