"""A whole job's per-sample costs against N: listing, first batches, server, cached epochs.

`hapi serve` on a local store of tiny JPEGs (32 px, about 1.2 KB, an ImageFolder of 10
classes) pinned to core 0; each trainer a new process pinned to core 1; one torch thread
each. The model is a user's own small CNN whose frozen head gives 512 features a sample
(fp16 on the wire), so what is timed is hapi's own cost per sample, not a network's:
deterministic transforms (`augment=False`), cut at the freeze point, the trainer's cache on.

Three layouts (`--layouts`): `folder`, the JPEGs as files of a local directory;
`shards`, the same as WebDataset `.tar` shards of 64 MB in a local directory; `s3`, the
JPEGs as single objects in SeaweedFS (on loopback, on the server's core). For each layout
and N, job A (a new process) trains two epochs: the server computes every head in
the first, the second comes from the trainer's cache (its memory tier where it fits). Then
job B, a new process started after the cache's files are evicted from the page cache,
trains one epoch from the cache on disk. Measured for each:

- the listing: `Connection.manifest` from the trainer (the server lists, the manifest
  crosses the wire), timed alone before job A;
- the time to each epoch's first step: from the process's start for epoch 1 (build and
  plan included), from the last step of the epoch before for the next;
- each epoch's seconds per sample, and the server's CPU seconds per sample over job A;
- the trainer's and the server's peak RSS (the server's after job A), the trainer's
  peak anonymous and file-backed parts (sampled; RSS counts the mapped cache segments),
  and the cache's bytes on disk against its payload.

    python benchmarks/pipeline_scale.py            # writes out/pipeline_scale.{json,png}
    python benchmarks/pipeline_scale.py --results  # ... and its section of RESULTS.md
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

START = time.perf_counter()

from _host import PinnedServer, end, machine, pin  # noqa:E402
from _results import write_section  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
SIZES = (1_000, 10_000, 100_000)
LAYOUTS = ("folder", "shards", "s3")
CLASSES, SIDE, WIDTH, BATCH = 10, 32, 512, 256
SHARD_BYTES = 64 << 20


def make_store(root: Path, n: int) -> None:
    """`n` tiny JPEGs under `root/train/c<k>/` (100 distinct images, written again)."""
    from PIL import Image

    blobs = []
    rng = random.Random(0)
    for _ in range(100):
        image = Image.effect_noise((SIDE, SIDE), 20 + rng.random() * 40).convert("RGB")
        out = io.BytesIO()
        image.save(out, "JPEG", quality=85)
        blobs.append(out.getvalue())
    for c in range(CLASSES):
        (root / "train" / f"c{c}").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (root / "train" / f"c{i % CLASSES}" / f"{i:08d}.jpg").write_bytes(blobs[i % 100])


@contextlib.contextmanager
def stored(layout: str, root: Path, n: int) -> Iterator[tuple[str, dict[str, str]]]:
    """`n` tiny JPEGs as `train/` in `layout` under `root`: the `--store` a server reads
    and the environment it needs (an S3 endpoint and keys)."""
    if layout == "folder":
        make_store(root / "store", n)
        yield str(root / "store"), {}
        return
    make_store(root / "src", n)
    from hapi.data import import_folder, open_store
    from hapi.data.shard_writer import import_shards

    if layout == "shards":
        store = open_store(root / "store")
        import_shards(root / "src" / "train", store, "train", format="webdataset",
                      shard_size=SHARD_BYTES)  # fmt: skip
        shutil.rmtree(root / "src")
        yield str(root / "store"), {}
        return
    if layout != "s3":
        raise ValueError(f"unknown layout {layout!r}: one of {', '.join(LAYOUTS)}")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' SeaweedFS
    from tests.seaweed import SeaweedS3

    pin(0)  # SeaweedFS shares the server's core (and Go sizes itself to it)
    weed = SeaweedS3(root / "weed").start()
    pin(1)
    try:
        bucket = weed.new_bucket()
        import_folder(root / "src" / "train", open_store(bucket, weed.options), "train")
        shutil.rmtree(root / "src")
        yield bucket, weed.client_env
    finally:
        weed.stop()


def _model() -> Any:
    """The user's model, built the same in every process (a seed): its head's digest
    names the cache's space, so job B finds job A's entries."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    features = nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 64, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, WIDTH),
        nn.ReLU(),
    )
    return nn.Sequential(OrderedDict(features=features, fc=nn.Linear(WIDTH, CLASSES)))


def job(address: str, cache_dir: str, epochs: int) -> dict[str, Any]:
    """One job in this process: its listing, the time to each epoch's first step, and
    each epoch's seconds."""
    import torch

    from hapi import TransferJob

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    model = _model()
    steps: list[float] = []

    def progress(done: int, total: int) -> None:
        steps.append(time.perf_counter())

    job = TransferJob(
        model,
        "train",
        address,
        freeze="features",
        cut="features",
        image_size=SIDE,
        batch_size=BATCH,
        augment=False,
        wire_dtype="fp16",
        cache_dir=cache_dir,
        replan=False,
    )
    stop = threading.Event()
    peaks: dict[str, int] = {}
    sampler = threading.Thread(target=_sample_memory, args=(stop, peaks), daemon=True)
    sampler.start()
    pauses: list[float] = []
    timer = _full_collections(pauses)
    gc.callbacks.append(timer)
    try:
        job.fit(epochs=epochs, progress=progress)
    finally:
        gc.callbacks.remove(timer)
        stop.set()
        sampler.join()
    out.update(peaks)
    out["gc_full_s"] = pauses
    per_epoch = job.batches_per_epoch()
    firsts = [steps[0] - START]
    for e in range(1, epochs):
        firsts.append(steps[e * per_epoch] - steps[e * per_epoch - 1])
    out["first_step_s"] = firsts
    out["epoch_s"] = [e.seconds for e in job.history.epochs]
    out["cached"] = [e.cached for e in job.history.epochs]
    out["samples"] = [e.samples for e in job.history.epochs]
    out["rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def _full_collections(pauses: list[float]) -> Callable[[str, dict[str, int]], None]:
    """A `gc.callbacks` hook that appends each full collection's seconds to `pauses`: each
    walks every object the process tracks, holding the GIL (a pause of every thread)."""
    began = [0.0]

    def timer(phase: str, info: dict[str, int]) -> None:
        if info["generation"] == 2:
            if phase == "start":
                began[0] = time.perf_counter()
            else:
                pauses.append(time.perf_counter() - began[0])

    return timer


def _sample_memory(stop: threading.Event, peaks: dict[str, int]) -> None:
    """This process's peak anonymous and file-backed resident memory, sampled every 0.1
    s: its peak RSS also counts the cache's mapped segments, page cache the kernel can
    take back, where the anonymous part is what the process holds."""
    fields = {"RssAnon:": "anon_bytes", "RssFile:": "file_bytes"}
    while not stop.wait(0.1):
        with open("/proc/self/status") as f:
            for line in f:
                name = fields.get(line.split(maxsplit=1)[0])
                if name is not None:
                    peaks[name] = max(peaks.get(name, 0), int(line.split()[1]) * 1024)


def listing(address: str) -> dict[str, Any]:
    """The listing alone, in a process of its own: in the job's, it was the job's first
    step's wait twice over (12.8 s of 2026-12-07's 32 s at 10^6)."""
    from hapi.client import connect

    t0 = time.perf_counter()
    listed = connect(address).manifest("train")
    return {"list_s": time.perf_counter() - t0, "n": len(listed)}


def keys_walk(address: str) -> dict[str, Any]:
    """What a trainer holds for its keys, features aside, in this process: the listing
    through the server, then two epochs' keys as the loader makes them (each epoch's
    versions listed again, every chunk's keys and their versions)."""
    from hapi.client import connect
    from hapi.client.pipeline.keys import EpochKeys

    base = _rss()
    connection = connect(address)
    t0 = time.perf_counter()
    manifest = connection.manifest("train")
    out: dict[str, Any] = {"list_s": time.perf_counter() - t0, "n": len(manifest)}
    keys = EpochKeys(
        manifest,
        seed=0,
        shuffle=True,
        chunk_size=BATCH,
        batch_size=BATCH,
        relist=lambda: connection.manifest("train"),
        fresh_until=time.monotonic() + 60,
    )
    out["start_s"], out["walk_s"] = [], []
    for epoch in range(2):
        if epoch:
            # As the loader does, while the epoch before ends (here: waits as long as the
            # listing took alone, and a bit): the start times what the listing does not.
            keys.list_ahead()
            time.sleep(1.5 * out["list_s"] + 0.1)
        t0 = time.perf_counter()
        versions = keys.versions()
        chunks = keys.chunks(epoch)
        assert versions is not None
        versions.of(chunks[0][0])
        t1 = time.perf_counter()
        for j in range(1, len(chunks)):
            versions.of(chunks[j][0])
        out["start_s"].append(t1 - t0)
        out["walk_s"].append(time.perf_counter() - t1)
    out["growth_bytes"] = _rss() - base
    return out


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure_keys(sizes: tuple[int, ...], repeats: int) -> list[dict[str, Any]]:
    """`keys_walk` at each size, a new server and trainer process each time."""
    rows = []
    for n in sizes:
        runs = []
        with tempfile.TemporaryDirectory(dir=OUT) as tmp:
            make_store(Path(tmp), n)
            for _ in range(repeats):
                server = PinnedServer(Path(tmp))
                try:
                    before = server.rss()
                    run = _child("keys", server.address)
                    run["server_growth_bytes"] = server.peak_rss() - before
                finally:
                    end(server.proc)
                print(f"keys n={n}: {json.dumps(run)}", flush=True)
                runs.append(run)
        row: dict[str, Any] = {"n": n}
        for key in ("list_s", "growth_bytes", "server_growth_bytes"):
            row[key] = statistics.median(r[key] for r in runs)
        for key in ("start_s", "walk_s"):
            row[key] = [statistics.median(r[key][i] for r in runs) for i in range(2)]
        rows.append(row)
    return rows


def _keys_report(rows: list[dict[str, Any]], repeats: int) -> str:
    lo = rows[0]
    lines = [
        f"The keys alone (`--keys`; medians of {repeats}): a trainer process lists the "
        "dataset through the server, then walks two epochs' keys as the loader makes them "
        "(the second epoch's versions listed again while the first ends, each chunk's keys "
        "and versions). Memory a key: the growth of each process's peak RSS (the server's "
        f"from before the listing), less its growth at {lo['n']:,}, over the keys between.",
        "",
        "| N | listing | epoch start: 1 / 2 | keys a sample (walk) | trainer B a key "
        "| server B a key |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        n, dn = row["n"], row["n"] - lo["n"]
        trainer = f"{(row['growth_bytes'] - lo['growth_bytes']) / dn:.0f}" if dn else "-"
        server = (
            f"{(row['server_growth_bytes'] - lo['server_growth_bytes']) / dn:.0f}" if dn else "-"
        )
        lines.append(
            f"| {n:,} | {row['list_s']:.2f} s ({row['list_s'] / n * 1e6:.1f} us) "
            f"| {row['start_s'][0]:.3f} / {row['start_s'][1]:.3f} s "
            f"| {row['walk_s'][1] / n * 1e6:.2f} us | {trainer} | {server} |"
        )
    return "\n".join(lines)


def _child(*args: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, __file__, "--phase", *args], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"phase {args} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _evict(root: Path) -> bool:
    """Evict the files under `root` from the page cache (only they: a trainer's own
    libraries stay cached, as on a machine that has run a job before)."""
    os.sync()
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return True


def _disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def measure(layouts: tuple[str, ...], sizes: tuple[int, ...], repeats: int) -> dict[str, Any]:
    rows = [_measure_one(layout, n, repeats) for layout in layouts for n in sizes]
    return {"machine": machine(), "repeats": repeats, "rows": rows}


def _measure_one(layout: str, n: int, repeats: int) -> dict[str, Any]:
    """`repeats` runs of jobs A and B on `n` samples stored in `layout`, and their medians."""
    runs = []
    with tempfile.TemporaryDirectory(dir=OUT) as tmp, stored(layout, Path(tmp), n) as (store, env):
        for r in range(repeats):
            cache = Path(tmp) / f"cache-{r}"
            server = PinnedServer(store, env)
            try:
                listed = _child("list", server.address)
                cpu0 = server.cpu_s()
                a = _child("job", server.address, str(cache), "2")
                server_cpu = server.cpu_s() - cpu0
                server_rss = server.peak_rss()
                cold = _evict(cache)
                b = _child("job", server.address, str(cache), "1")
            finally:
                end(server.proc)
            run = {
                "list_s": listed["list_s"],
                "first_step_s": [*a["first_step_s"], b["first_step_s"][0]],
                "epoch_s": [*a["epoch_s"], b["epoch_s"][0]],
                "cached": [*a["cached"], b["cached"][0]],
                "server_cpu_s": server_cpu,
                "server_rss_bytes": server_rss,
                "trainer_rss_bytes": max(a["rss_bytes"], b["rss_bytes"]),
                "trainer_anon_bytes": max(a.get("anon_bytes", 0), b.get("anon_bytes", 0)),
                "trainer_file_bytes": max(a.get("file_bytes", 0), b.get("file_bytes", 0)),
                "gc_full_s": a.get("gc_full_s", []),
                "cache_disk_bytes": _disk_bytes(cache),
                "payload_bytes": n * WIDTH * 2,
                "cold": cold,
            }
            runs.append(run)
            shutil.rmtree(cache, ignore_errors=True)
            print(f"{layout} n={n} run {r + 1}: {json.dumps(run)}", flush=True)
    row: dict[str, Any] = {"layout": layout, "n": n, "runs": runs}
    for key in ("list_s", "server_cpu_s", "server_rss_bytes", "trainer_rss_bytes",
                "trainer_anon_bytes", "trainer_file_bytes"):  # fmt: skip
        row[key] = statistics.median(run[key] for run in runs)
    for key in ("first_step_s", "epoch_s"):
        row[key] = [statistics.median(run[key][i] for run in runs) for i in range(3)]
    row["disk_ratio"] = statistics.median(
        run["cache_disk_bytes"] / run["payload_bytes"] for run in runs
    )
    return row


def _report(data: dict[str, Any]) -> str:
    rows = data["rows"]
    lines = [
        f"Medians of {data['repeats']} runs. Per-sample figures in microseconds. Epoch 2: "
        "job A's second epoch (the trainer's cache, its memory tier where it fits); "
        "cached epoch: job B, a new process after the cache's files were evicted from the page "
        "cache. First step: "
        "epoch 1's from the process's start (build, listing and plan included), the others' "
        "from the epoch before's last step.",
        "",
        "| layout | N | listing | first step: epoch 1 / epoch 2 / cached | server CPU a sample "
        "| epoch 1 | epoch 2 | cached epoch | trainer / server peak RSS | cache disk / payload |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        n = row["n"]
        first = " / ".join(f"{s:.2f} s" for s in row["first_step_s"])
        epochs = [f"{s / n * 1e6:.0f} ({s:.1f} s)" for s in row["epoch_s"]]
        runs = len(row.get("runs", ())) or data["repeats"]
        alone = f" ({runs} run{'s' if runs > 1 else ''})" if runs != data["repeats"] else ""
        lines.append(
            f"| {row.get('layout', 'folder')} | {n:,}{alone} "
            f"| {row['list_s']:.2f} s ({row['list_s'] / n * 1e6:.1f}) | {first} "
            f"| {row['server_cpu_s'] / n * 1e6:.0f} | {' | '.join(epochs)} "
            f"| {row['trainer_rss_bytes'] / 2**30:.2f} / {row['server_rss_bytes'] / 2**30:.2f} GiB "
            f"| {row['disk_ratio']:.2f}x |"
        )
    pauses = [
        f"{row.get('layout', 'folder')} {row['n']:,}: {len(run['gc_full_s'])}, longest "
        f"{max(run['gc_full_s'], default=0.0):.2f} s"
        for row in rows
        for run in row.get("runs", ())[:1]
        if "gc_full_s" in run
    ]
    if pauses:
        lines += ["", "Full garbage collections in job A (its first run; each holds the GIL): "
                  + "; ".join(pauses) + "."]  # fmt: skip
    memory = []
    for layout, of in _by_layout(rows).items():
        if len(of) > 1:
            lo, hi = of[0], of[-1]
            dn = hi["n"] - lo["n"]
            trainer = (hi["trainer_rss_bytes"] - lo["trainer_rss_bytes"]) / dn
            server = (hi["server_rss_bytes"] - lo["server_rss_bytes"]) / dn
            split = ""
            if lo.get("trainer_anon_bytes") and hi.get("trainer_anon_bytes"):
                anon = (hi["trainer_anon_bytes"] - lo["trainer_anon_bytes"]) / dn
                mapped = (hi["trainer_file_bytes"] - lo["trainer_file_bytes"]) / dn
                split = f" (peak anonymous {anon:.0f} B, peak file-backed {mapped:.0f} B)"
            memory.append(f"{layout} trainer {trainer:.0f} B{split}, server {server:.0f} B")
    if memory:
        lines += [
            "",
            "Memory a key (each layout's peak RSS at its largest N less at its smallest, over "
            f"the keys between): {'; '.join(memory)} (the trainer's includes its cache's "
            f"features: its memory tier's, up to 256 MiB, and the segment files it maps, "
            f"{WIDTH * 2} B a feature - page cache, which RSS counts; the anonymous and "
            "file-backed parts are sampled every 0.1 s, each at its own peak).",
        ]
    return "\n".join(lines)


def _by_layout(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The rows of each layout, smallest N first (a JSON from before layouts: `folder`)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for row in sorted(rows, key=lambda r: r["n"]):
        out.setdefault(row.get("layout", "folder"), []).append(row)
    return out


def _plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    series = {
        "listing": lambda r: r["list_s"],
        "server CPU": lambda r: r["server_cpu_s"],
        "epoch 1": lambda r: r["epoch_s"][0],
        "epoch 2 (trainer cache)": lambda r: r["epoch_s"][1],
        "cached epoch, cold disk": lambda r: r["epoch_s"][2],
    }
    styles = {"folder": "-", "shards": "--", "s3": ":"}
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for layout, rows in _by_layout(data["rows"]).items():
        ns = [r["n"] for r in rows]
        for color, (label, value) in zip(colors, series.items(), strict=False):
            ax.plot(
                ns, [value(r) / r["n"] * 1e6 for r in rows], marker="o", color=color,
                linestyle=styles.get(layout, "-"), label=f"{label} ({layout})",
            )  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("samples (N)")
    ax.set_ylabel("microseconds per sample")
    ax.set_title("A job's per-sample costs against N (flat is the goal)")
    ax.legend(fontsize=6, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument(
        "--keys", type=int, nargs="+", help="only the keys' costs, at these sizes (to 10^6)"
    )
    parser.add_argument(
        "--add",
        action="store_true",
        help="add (or replace) these rows in the last run's table, rather than start a new one",
    )
    parser.add_argument("--results", action="store_true", help="update benchmarks/RESULTS.md")
    args = parser.parse_args()
    if args.phase:
        pin(1)
        if args.phase[0] == "keys":
            print(json.dumps(keys_walk(args.phase[1])))
            return
        if args.phase[0] == "list":
            print(json.dumps(listing(args.phase[1])))
            return
        _, address, cache, epochs = args.phase
        print(json.dumps(job(address, cache, int(epochs))))
        return
    if args.keys:
        OUT.mkdir(exist_ok=True)
        rows = measure_keys(tuple(args.keys), args.repeats)
        keys = {"machine": machine(), "repeats": args.repeats, "sizes": args.keys, "rows": rows}
        (OUT / "pipeline_keys.json").write_text(json.dumps(keys))
        print(_keys_report(rows, args.repeats))
    else:
        OUT.mkdir(exist_ok=True)
        data = measure(tuple(args.layouts), tuple(args.sizes), args.repeats)
        data["flags"] = "".join(f" {a}" for a in sys.argv[1:] if a not in ("--results", "--add"))
        if args.add:
            data = _added(json.loads((OUT / "pipeline_scale.json").read_text()), data)
        (OUT / "pipeline_scale.json").write_text(json.dumps(data, indent=1))
        _plot(data, OUT / "pipeline_scale.png")
        print(_report(data))
    if args.results:
        _write_results()


def _added(last: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """`new`'s rows in `last`'s table (replacing any of the same layout and N), and the
    command that measured them (`added`)."""
    made = {(r["layout"], r["n"]) for r in new["rows"]}
    rows = [r for r in last["rows"] if (r["layout"], r["n"]) not in made] + new["rows"]
    rows.sort(key=lambda r: (LAYOUTS.index(r["layout"]), r["n"]))
    added = []
    for earlier in last.get("added", []):  # each keeps the rows no later run replaced
        rest = [r for r in earlier["rows"] if tuple(r) not in made]
        if rest:
            added.append({**earlier, "rows": rest})
    added.append({"flags": new["flags"], "rows": sorted(made), "at": _commit()})
    return {**last, "rows": rows, "added": added}


def _commit() -> str:
    """The checkout's commit (where it is a git checkout), for the rows a run adds."""
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=OUT.parent, capture_output=True, text=True
    )
    return done.stdout.strip() if done.returncode == 0 else "?"


def _added_line(added: dict[str, Any]) -> str:
    rows = ", ".join(f"{layout} {n:,}" for layout, n in added["rows"])
    at = f" at {added['at']}" if "at" in added else ""
    command = f"python benchmarks/pipeline_scale.py{added['flags']} --add --results"
    return f"Rows {rows} added by `{command}`{at}."


def _write_results() -> None:
    """The section of RESULTS.md from both measures' last JSON: a job's costs, and the
    keys alone (each `--results` keeps the other's table)."""
    data = json.loads((OUT / "pipeline_scale.json").read_text())
    parts = [
        "## A job's per-sample costs against N (`benchmarks/pipeline_scale.py`)",
        f"`python benchmarks/pipeline_scale.py{data.get('flags', '')} --results` on "
        f"{data['machine']}"
        + (" (the rows no line below the table names)." if data.get("added") else "."),
        _report(data),
        *(_added_line(a) for a in data.get("added", [])),
        "![per-sample costs against N](out/pipeline_scale.png)",
    ]
    keys_path = OUT / "pipeline_keys.json"
    if keys_path.exists():
        keys = json.loads(keys_path.read_text())
        sizes = " ".join(str(n) for n in keys.get("sizes", [r["n"] for r in keys["rows"]]))
        parts += [
            f"`python benchmarks/pipeline_scale.py --keys {sizes} --results` on {keys['machine']}.",
            _keys_report(keys["rows"], keys.get("repeats", 3)),
        ]
    write_section("pipeline_scale", "\n\n".join(parts))


if __name__ == "__main__":
    main()
