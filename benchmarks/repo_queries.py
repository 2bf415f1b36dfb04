"""Repository queries at 10^2, 10^3 and 10^4 versions, cold and warm.

Versions are generated as a model zoo grows: families of a few architectures (ResNet-18
and three small CNNs and MLPs), each with heads of three sizes; every family has a base and
names derived from it, each name a chain of fine-tunes that change the last tensors. The
manifests and refs are written to a local-dir store as pushes write them (blobs are not:
no query reads one). Then, on a fresh `ModelRepo` whose catalog is built (cold: the first
call) and again (warm: the median of 20 calls), it times `find` by name, tag and module
classes, shared-prefix matches, lineage, ancestors, descendants, `log` and `ls`.

    python benchmarks/repo_queries.py                 # 100,1000,10000 versions
    python benchmarks/repo_queries.py --results       # ... and benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _results import write_section  # benchmarks/, the script's own directory

HERE = Path(__file__).resolve().parent
VERSIONS_PER_NAME = 8
WARM_CALLS = 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", default="100,1000,10000")
    parser.add_argument("--out", type=Path, default=HERE / "out")
    parser.add_argument("--results", action="store_true", help="write benchmarks/RESULTS.md")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = []
    load_before = os.getloadavg()[0]
    for n in [int(v) for v in args.versions.split(",")]:
        with tempfile.TemporaryDirectory(prefix="hapi-repo-queries-") as tmp:
            runs.append(_measure(n, Path(tmp)))
    result = {
        "machine": _machine(),
        "command": _command(),
        "load": [load_before, os.getloadavg()[0]],
        "runs": runs,
    }
    (args.out / "repo_queries.json").write_text(json.dumps(result, indent=2))
    _plot(runs, args.out / "repo_queries.png")
    table = _markdown(result)
    print(table)
    if args.results:
        write_section("repo-queries", table)


def _architectures() -> list[tuple[str, Any]]:
    """(family, model) for every architecture and head size, built on the meta device."""
    import torch
    from torch import nn
    from torchvision.models import resnet18

    def cnn(width: int, classes: int) -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(3, width, 3),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(2 * width, classes),
        )

    def mlp(classes: int) -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, classes))

    out = []
    with torch.device("meta"):
        for classes in (10, 100, 1000):
            out.append((f"resnet18-{classes}", resnet18(num_classes=classes)))
            out.append((f"cnn16-{classes}", cnn(16, classes)))
            out.append((f"cnn32-{classes}", cnn(32, classes)))
            out.append((f"mlp-{classes}", mlp(classes)))
    return out


def _generate(uri: str, count: int) -> dict[str, Any]:
    """Write `count` versions; return refs to query."""
    from hapi.data import open_store
    from hapi.repo import TensorEntry, VersionManifest, describe_modules
    from hapi.repo.storage.epoch import mark_changed, mark_epoch
    from hapi.repo.storage.layout import manifest_key, ref_key

    rng = random.Random(0)
    store = open_store(uri)
    mark_epoch(store)
    archs = []
    for family, model in _architectures():
        tensors = {
            k: TensorEntry(hash="", dtype="float32", shape=tuple(v.shape), nbytes=v.numel() * 4)
            for k, v in model.state_dict().items()
        }
        archs.append((family, describe_modules(model), tensors))

    def hashes(tensors: dict[str, TensorEntry], old: dict[str, TensorEntry] | None, changed: int):
        keys = list(tensors)
        fresh = set(keys[-changed:]) if old is not None else set(keys)
        return {
            k: TensorEntry(
                hash=f"{rng.getrandbits(256):064x}" if k in fresh or old is None else old[k].hash,
                dtype=t.dtype,
                shape=t.shape,
                nbytes=t.nbytes,
            )
            for k, t in tensors.items()
        }

    written = 0
    refs: dict[str, Any] = {}
    bases: list[tuple[str, VersionManifest]] = []
    start = time.perf_counter()
    while written < count:
        family, modules, tensors = archs[len(bases) % len(archs)]
        name = f"{family}-base{len(bases) // len(archs)}"
        parent = VersionManifest(
            name=name,
            parent=None,
            created=f"2026-01-01T00:00:{written:06d}",
            tags=("base", family.split("-")[0]),
            modules=modules,
            tensors=hashes(tensors, None, 0),
        )
        store.put(manifest_key(parent.id), parent.to_json())
        store.put(ref_key(name, 1), parent.id.encode())
        bases.append((name, parent))
        written += 1
        # Names derived from this base: chains of fine-tunes, until a base's share is used.
        for d in range(rng.randint(3, 12)):
            chain_parent = parent
            derived = f"{name}-ft{d}"
            for v in range(1, VERSIONS_PER_NAME + 1):
                if written >= count:
                    break
                m = VersionManifest(
                    name=derived,
                    parent=chain_parent.id,
                    created=f"2026-01-01T00:00:{written:06d}",
                    tags=("tuned",) + (("best",) if rng.random() < 0.01 else ()),
                    metrics={"accuracy": rng.random()},
                    modules=modules,
                    tensors=hashes(tensors, chain_parent.tensors, rng.randint(1, 4)),
                )
                store.put(manifest_key(m.id), m.to_json())
                store.put(ref_key(derived, v), m.id.encode())
                written += 1
                chain_parent = m
                if v == VERSIONS_PER_NAME:
                    refs["deep"] = f"{derived}@{v}"
    mark_changed(store)  # as the last push would have
    refs["base"] = bases[0][0]
    refs["name_glob"] = f"{archs[1][0]}-base0*"
    refs["leaf_name"] = refs["deep"].split("@")[0]
    refs["write_s"] = time.perf_counter() - start
    return refs


def _measure(count: int, tmp: Path) -> dict[str, Any]:
    import torch
    from torchvision.models import resnet18

    from hapi.repo import ModelRepo

    uri, catalog = str(tmp / "repo"), tmp / "catalog.sqlite"
    refs = _generate(uri, count)
    print(f"[{count} versions] written in {refs['write_s']:.1f} s", flush=True)
    start = time.perf_counter()
    built = ModelRepo.open(uri, catalog=catalog).reindex()
    build_s = time.perf_counter() - start
    with torch.device("meta"):
        probe = resnet18(num_classes=10)  # shares every layer but the head with a family
    queries: dict[str, Callable[[ModelRepo], Any]] = {
        "find name": lambda r: r.find(name=refs["name_glob"]),
        "find tag": lambda r: r.find(tag="best"),
        "find classes": lambda r: r.find(contains=["Conv2d", "BatchNorm2d", "ReLU"]),
        "prefix matches (ref)": lambda r: r.prefix_matches(refs["deep"], min_layers=2),
        "prefix matches (module)": lambda r: r.prefix_matches(probe, min_layers=2),
        "lineage": lambda r: r.lineage(refs["deep"]),
        "ancestors": lambda r: r.ancestors(refs["deep"]),
        "descendants": lambda r: r.descendants(refs["base"]),
        "log": lambda r: r.log(refs["leaf_name"]),
        "ls": lambda r: r.ls(),
    }
    row: dict[str, Any] = {"versions": built, "catalog_build_s": build_s, "queries": {}}
    from hapi.repo.ops.matching import layer_ids

    times = []
    for _ in range(WARM_CALLS + 1):
        start = time.perf_counter()
        layer_ids(probe)
        times.append(time.perf_counter() - start)
    row["describe_ms"] = statistics.median(times[1:]) * 1e3
    for label, query in queries.items():
        repo = ModelRepo.open(uri, catalog=catalog)  # a new process's first call: cold
        start = time.perf_counter()
        found = query(repo)
        cold = time.perf_counter() - start
        times = []
        for _ in range(WARM_CALLS):
            start = time.perf_counter()
            query(repo)
            times.append(time.perf_counter() - start)
        repo.close()
        row["queries"][label] = {
            "cold_ms": cold * 1e3,
            "warm_ms": statistics.median(times) * 1e3,
            "results": len(found),
        }
        print(
            f"  {label}: {len(found)} found, cold {cold * 1e3:.1f} ms, "
            f"warm {statistics.median(times) * 1e3:.2f} ms",
            flush=True,
        )
    return row


def _machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def _command() -> str:
    return "python benchmarks/repo_queries.py " + " ".join(sys.argv[1:])


def _plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label in runs[0]["queries"]:
        ax.plot(
            [r["versions"] for r in runs],
            [r["queries"][label]["warm_ms"] for r in runs],
            marker="o",
            label=label,
        )
    ax.axhline(10, color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("versions in the repository")
    ax.set_ylabel("warm query time (ms)")
    ax.legend(fontsize=7, ncol=2)
    fig.suptitle("hapi repository queries (local dir store, SQLite catalog)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _markdown(result: dict[str, Any]) -> str:
    runs = result["runs"]
    load = result.get("load", [float("nan")] * 2)
    head = " | ".join(f"{r['versions']:,} cold / warm ms" for r in runs)
    lines = [
        "## Model repository queries at scale",
        "",
        f"`{result['command']}` on {result['machine']}. Generated versions: families of "
        "ResNet-18 and three small CNNs and MLPs with 3 head sizes, each base with 3-12 "
        "derived names of up to 8 fine-tunes; local-dir store. Cold = the first call of a "
        "newly opened `ModelRepo` on a built catalog; warm = median of "
        f"{WARM_CALLS} calls after it. Prefix matches of a ref read its manifest; of an "
        f"`nn.Module` describe the module first ({runs[-1]['describe_ms']:.1f} ms for a "
        "ResNet-18 here, whatever the repository's size). Load average (1 min) "
        f"{load[0]:.1f} at the start, {load[1]:.1f} at the end, on shared cores. Data: "
        "`out/repo_queries.json`.",
        "",
        f"| query | {head} | results at {runs[-1]['versions']:,} |",
        "|---|" + "---|" * (len(runs) + 1),
    ]
    for label in runs[0]["queries"]:
        cells = " | ".join(
            f"{r['queries'][label]['cold_ms']:.1f} / {r['queries'][label]['warm_ms']:.2f}"
            for r in runs
        )
        lines.append(f"| {label} | {cells} | {runs[-1]['queries'][label]['results']} |")
    builds = ", ".join(f"{r['catalog_build_s']:.1f} s at {r['versions']:,}" for r in runs)
    last = runs[-1]
    slow = [
        f"{k} ({q['warm_ms']:.1f} ms)" for k, q in last["queries"].items() if q["warm_ms"] >= 10
    ]
    worst = max(q["warm_ms"] for q in last["queries"].values())
    verdict = "met" if not slow else "not met: " + ", ".join(slow)
    lines += [
        "",
        f"Catalog built from the store (`reindex`): {builds}.",
        "",
        f"Goal of issue 42, every query under 10 ms warm at {last['versions']:,} versions: "
        f"{verdict} (slowest {worst:.1f} ms). Warm queries answer from the catalog's "
        "in-memory snapshot after one read of the store's change token; prefix matches and "
        "`find(contains=)` take the versions of the matching module trees from it, never "
        "scanning every version. Cold includes opening SQLite and building the snapshot.",
        "",
        "![warm query time against versions](out/repo_queries.png)",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
