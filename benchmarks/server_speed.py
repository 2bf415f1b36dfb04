"""The storage core's cost per sample against eager PyTorch doing the same work.

One configuration a run: a model frozen to a cut, images of one size in a local store.
Eager: this process, pinned to core 1 with one torch thread, reads each object from the
store, decodes and transforms it with hapi's own `load_sample` and runs the model's head up
to the cut in batches of 256 - the work and nothing else. Server: `hapi serve --threads 1`
pinned to core 0 computes the same samples' features for a client on core 1, in chunks of
256 keys one after another; its CPU seconds (all its threads, from /proc) are the cost.
Interleaved repeats, medians; the ratio is the server's over eager's. A second server
with `--compile-heads always`, warmed until its head is compiled (the compile's seconds
reported apart), gives the compiled head's cost the same way.

With `--profile`, py-spy samples the server (the thread holding the GIL, `--gil`) during
one more pass, and the report breaks its time down by stage (`docs/server-profile.md`).

    python benchmarks/server_speed.py                   # both configurations
    python benchmarks/server_speed.py --profile         # ... with the server's breakdown
    python benchmarks/server_speed.py --results         # ... and its section of RESULTS.md
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _host import PinnedServer, end, machine, pin
from _results import DETAILS, write_section

OUT = Path(__file__).resolve().parent / "out"
BATCH = 256
CONFIGS = {
    # name: (model, cut, image side, stored side, samples, JPEG kind)
    "r18-32px-tiny": ("resnet18", "avgpool+flatten", 32, 32, 4096, "tiny"),
    "r18-112px-photo": ("resnet18", "avgpool+flatten", 112, 440, 512, "photo"),
}
STAGES = {
    # stage: parts of frame names that put a sample in it. A stack's outermost frame that
    # names a stage is its stage (a transform's PIL resize is the transform's); py-spy's
    # stacks may start part way, so a stage names its leaves' modules too.
    "memory estimate (header)": ["object_decode_bytes", "decoded_size"],
    "listing (the benchmark's)": ["HapiServer.manifest"],
    "access checks": ["check_keys", "security/tenants.py"],
    "read (store)": ["read_objects", "_read_run", "hapi/data/store/"],
    "decode": ["_decode (hapi/data/images", "_open (hapi/data/images", "PIL/"],
    "transforms": ["Transforms.__call__", "hapi/data/ops.py", "torchvision/transforms"],
    "head (model)": ["torch/nn/modules", "<eval_with_key>", "torch/fx/graph_module.py"],
    "encode (Arrow, wire dtype)": ["hapi/server/chunks/_batches.py", "hapi/wire/"],
    "send (Flight stream)": ["HapiServer._stream", "do_get"],
    "thread hand-offs": ["concurrent/futures", "Condition.", "Event.wait", "queue.py"],
}


def make_store(root: Path, n: int, stored: int, kind: str) -> None:
    """`n` JPEGs under `root/train/c<k>/`: tiny noise (about 1.2 KB at 32 px), or
    photo-like ones (about 100 KB at 440 px); 64 distinct images, written again."""
    import numpy as np
    from PIL import Image

    from hapi.data import synth_image

    rng = random.Random(0)
    blobs = []
    for i in range(64):
        if kind == "tiny":
            image = Image.effect_noise((stored, stored), 20 + rng.random() * 40).convert("RGB")
            quality = 85
        else:
            image = synth_image(i % 4, 4, stored, np.random.default_rng(i))
            quality = 90
        out = io.BytesIO()
        image.save(out, "JPEG", quality=quality)
        blobs.append(out.getvalue())
    for c in range(4):
        (root / "train" / f"c{c}").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (root / "train" / f"c{i % 4}" / f"{i:07d}.jpg").write_bytes(blobs[i % 64])


def _spec(model: str) -> Any:
    from hapi.graph import ModelSpec

    return ModelSpec(name=model, seed=0)


def eager(store_dir: Path, config: tuple[Any, ...]) -> float:
    """CPU seconds a sample for the work alone: read, `load_sample`, the head in batches."""
    import torch

    from hapi.data import Transforms, load_sample, open_store
    from hapi.graph import build_model, trace

    model_name, cut_name, side, _, n, _ = config
    graph = trace(build_model(_spec(model_name)), (3, side, side))
    head = graph.head(graph.resolve_cut(cut_name)).eval()
    store = open_store(str(store_dir))
    keys = sorted(store.list("train"))[:n]
    transforms = Transforms.eval(side)
    t0 = time.process_time()
    with torch.inference_mode():
        for i in range(0, len(keys), BATCH):
            batch = [load_sample(store.get(k), k, transforms, 0) for k in keys[i : i + BATCH]]
            head(torch.stack(batch))
    return (time.process_time() - t0) / len(keys)


def served(server: PinnedServer, config: tuple[Any, ...]) -> float:
    """The server's CPU seconds a sample for the same samples, chunk after chunk."""
    from hapi.client import connect
    from hapi.data import Transforms
    from hapi.graph import build_model, trace
    from hapi.wire import ChunkTicket, SessionRequest

    model_name, cut_name, side, _, n, _ = config
    graph = trace(build_model(_spec(model_name)), (3, side, side))
    cut = graph.resolve_cut(cut_name)
    with connect(server.address) as conn:
        manifest = conn.manifest("train")
        keys, labels = list(manifest.keys[:n]), list(manifest.labels[:n])
        request = SessionRequest(
            model=_spec(model_name).to_dict(), cut=cut, freeze=cut,
            transforms=Transforms.eval(side).to_dict(), image_size=side,
        )  # fmt: skip
        session = conn.open_session(request).session
        first = ChunkTicket(session=session, chunk=0, keys=keys[:8], labels=labels[:8])
        conn.fetch(first)  # the session's first chunk pays what every later one reuses
        cpu0 = server.cpu_s()
        for c, i in enumerate(range(0, n, BATCH), start=1):
            ticket = ChunkTicket(
                session=session, chunk=c, keys=keys[i : i + BATCH], labels=labels[i : i + BATCH]
            )
            conn.fetch(ticket)
        cpu = server.cpu_s() - cpu0
        conn.close_session(session)
    return cpu / n


def breakdown(raw: Path) -> dict[str, float]:
    """Shares of py-spy's samples by stage (`STAGES`), from its raw (collapsed) output."""
    counts: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack:
            continue
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]
        total += int(n)
        counts[_stage(frames)] += int(n)
    return {stage: counts[stage] / total for stage in [*STAGES, "other"]} if total else {}


def _stage(frames: list[str]) -> str:
    for frame in frames:
        for stage, parts in STAGES.items():
            if any(part in frame for part in parts):
                return stage
    return "other"


def profile(server: PinnedServer, config: tuple[Any, ...], out: Path) -> dict[str, float]:
    """One more pass with py-spy sampling the server; its breakdown by stage."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        raise SystemExit("--profile needs py-spy: pip install py-spy")
    cmd = [spy, "record", "--pid", str(server.proc.pid), "--rate", "200", "--gil"]
    cmd += ["--nonblocking", "--format", "raw", "--output", str(out)]
    recorder = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    try:
        served(server, config)
    finally:
        recorder.send_signal(2)
        recorder.wait(timeout=120)
    return breakdown(out)


def warm_compiled(server: PinnedServer, config: tuple[Any, ...], most_s: float = 900) -> str:
    """Run the configuration on `server` until its head is compiled (or refused); how
    it runs then, in the server's words."""
    from hapi.client import connect

    deadline = time.monotonic() + most_s
    state = "not started"
    while time.monotonic() < deadline:
        served(server, config)
        with connect(server.address) as conn:
            states = list(conn.stats().compiled_heads.values())
        state = states[0] if states else "no head"
        if not state.startswith(("eager", "compiling", "checking")):
            break
    print(f"compiled server: {state}", flush=True)
    return state


def measure(names: list[str], repeats: int, with_profile: bool) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    pin(1)
    rows = []
    for name in names:
        config = CONFIGS[name]
        with tempfile.TemporaryDirectory(dir=OUT) as tmp:
            store = Path(tmp) / "store"
            make_store(store, config[4], config[3], config[5])
            server = PinnedServer(store)
            fast = PinnedServer(store, args=("--compile-heads", "always"))
            try:
                compiled = warm_compiled(fast, config)
                runs = []
                for r in range(repeats):  # interleaved: eager, server, compiled, eager...
                    runs.append({
                        "eager_s": eager(store, config),
                        "server_s": served(server, config),
                        "compiled_s": served(fast, config),
                    })  # fmt: skip
                    print(f"{name} run {r + 1}: {json.dumps(runs[-1])}", flush=True)
                shares = (
                    profile(server, config, OUT / f"server_speed-{name}.txt")
                    if with_profile
                    else {}
                )
            finally:
                end(server.proc)
                end(fast.proc)
        eager_s = statistics.median(r["eager_s"] for r in runs)
        server_s = statistics.median(r["server_s"] for r in runs)
        ratio = statistics.median(r["server_s"] / r["eager_s"] for r in runs)
        rows.append({"name": name, "config": config, "runs": runs, "eager_s": eager_s,
                     "server_s": server_s, "ratio": ratio, "profile": shares,
                     "compiled": compiled,
                     "compiled_s": statistics.median(r["compiled_s"] for r in runs),
                     "compiled_ratio": statistics.median(
                         r["compiled_s"] / r["eager_s"] for r in runs)})  # fmt: skip
    return {"machine": machine(), "repeats": repeats, "rows": rows}


def report(data: dict[str, Any]) -> str:
    lines = [
        f"Medians of {data['repeats']} interleaved runs; microseconds a sample on one core, "
        "one torch thread. Eager: read, `load_sample` (decode and transforms), the head in "
        f"batches of {BATCH}; server: its process's CPU for chunks of {BATCH} keys.",
        "",
        "| configuration | samples | eager | server | server / eager (goal <= 1.1x) "
        "| server, head compiled | compiled / eager |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in data["rows"]:
        lines.append(
            f"| {row['name']} | {row['config'][4]:,} | {row['eager_s'] * 1e6:.0f} "
            f"| {row['server_s'] * 1e6:.0f} | {row['ratio']:.2f}x "
            f"| {row['compiled_s'] * 1e6:.0f} | {row['compiled_ratio']:.2f}x |"
        )
    said = "; ".join(f"{row['name']}: {row['compiled']}" for row in data["rows"])
    lines += ["", f"The compiled server's heads (`ServerStats.compiled_heads`): {said}"]
    profiled = [row for row in data["rows"] if row["profile"]]
    if profiled:
        lines += [
            DETAILS,
            "Where the server's time goes (py-spy `--gil`: the thread holding the GIL, so "
            "native code that releases it counts less than it runs):",
            "",
            "| stage | " + " | ".join(row["name"] for row in profiled) + " |",
            "|---|" + "---|" * len(profiled),
        ]
        for stage in [*STAGES, "other"]:
            cells = " | ".join(f"{row['profile'].get(stage, 0) * 100:.0f}%" for row in profiled)
            lines.append(f"| {stage} | {cells} |")
    return "\n".join(lines)


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    x = range(len(rows))
    bars = (("eager", "eager_s", None), ("hapi serve", "server_s", "ratio"),
            ("hapi serve, head compiled", "compiled_s", "compiled_ratio"))  # fmt: skip
    for j, (label, key, ratio) in enumerate(bars):
        at = [i + (j - 1) * 0.27 for i in x]
        ax.bar(at, [r[key] * 1e6 for r in rows], 0.27, label=label)
        for i, r in zip(at, rows, strict=True):
            if ratio is not None:
                ax.text(i, r[key] * 1e6, f"{r[ratio]:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), [r["name"] for r in rows])
    ax.set_ylabel("CPU microseconds a sample")
    ax.set_title("The server's cost a sample against eager PyTorch's")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="py-spy the server (one pass)")
    parser.add_argument("--results", action="store_true", help="update benchmarks/RESULTS.md")
    args = parser.parse_args()
    OUT.mkdir(exist_ok=True)
    data = measure(args.configs, args.repeats, args.profile)
    (OUT / "server_speed.json").write_text(json.dumps(data, indent=1))
    plot(data, OUT / "server_speed.png")
    text = report(data)
    print(text)
    if args.results:
        write_results(data, text)


def write_results(data: dict[str, Any], text: str) -> None:
    """This benchmark's section of RESULTS.md: the ratios and the plot; the profile's
    table in `out/server_speed.md`."""
    command = "python benchmarks/server_speed.py --profile --results"
    ratios, _, details = text.partition(DETAILS)
    write_section(
        "server_speed",
        "## The server's cost a sample against eager PyTorch (`benchmarks/server_speed.py`)"
        f"\n\n`{command}` on {data['machine']}.\n\n{ratios.rstrip()}\n\n"
        "![server against eager](out/server_speed.png)"
        + (f"\n{DETAILS}\n{details}" if details else ""),
    )


if __name__ == "__main__":
    main()
