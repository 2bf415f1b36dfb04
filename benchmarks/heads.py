"""A frozen head's speed and its features' error in each way the server could run it.

The ways: eager fp32, channels_last, `torch.compile` (inductor, fp32), compiled with
inductor's freezing (`compile_head`: what the server runs once compiling pays,
`hapi.server.chunks._compiled`), bf16 under autocast (`hapi.graph.precision`: a job with
`head_dtype="bf16"` on a CPU with bf16 kernels), and bf16 compiled with freezing. Speed: ResNet-18
and ResNet-50 frozen to `avgpool+flatten` at 112 px, batches of 32, one pinned core, one
torch thread; the ways interleaved within each repeat, medians; compile time apart and
cold (an empty inductor cache: what a server's first job would wait for). Error: five
models (torchvision, timm, Hugging Face, EfficientNet-Lite0 with its ImageNet
weights) at their last frozen cut, the largest difference from the eager fp32 features
over the largest fp32 value, on photo-like inputs.

    python benchmarks/heads.py                 # writes benchmarks/out/heads.{json,png}
    python benchmarks/heads.py --results       # ... and its section of benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _host import machine, pin
from _results import write_section

OUT = Path(__file__).resolve().parent / "out"
SPEED_MODELS = ("resnet18", "resnet50")
ERROR_MODELS = {
    # name: (spec, image side)
    "resnet18": ({"name": "resnet18"}, 112),
    "resnet50": ({"name": "resnet50"}, 112),
    "efficientnet_lite0": ({"name": "efficientnet_lite0", "weights": "imagenet"}, 112),
    "timm:mobilenetv3_small_100": ({"name": "timm:mobilenetv3_small_100"}, 112),
    "hf:ViTConfig (base)": ({"name": "hf:ViTConfig"}, 224),
}
WAYS = ("eager", "channels_last", "compiled", "compiled, frozen", "bf16", "bf16 frozen")
COMPILED = ("compiled", "compiled, frozen", "bf16 frozen")
BATCH = 32
RUNS = 5


def _head(spec: dict[str, Any], side: int) -> torch.nn.Module:
    from hapi.graph import ModelSpec, build_model, trace

    graph = trace(build_model(ModelSpec.from_dict({"seed": 0, **spec})), (3, side, side))
    return graph.head(graph.num_cuts - 1).eval()


def _inputs(n: int, side: int) -> torch.Tensor:
    """Photo-like inputs: smooth fields with some texture, normalised as ImageNet's."""
    g = torch.Generator().manual_seed(0)
    coarse = torch.rand((n, 3, 8, 8), generator=g)
    x = torch.nn.functional.interpolate(coarse, size=(side, side), mode="bicubic")
    x = x + 0.05 * torch.randn((n, 3, side, side), generator=g)
    return (x - 0.45) / 0.225


def _bf16(head: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return head(x)

    return run


def _ways(head: torch.nn.Module) -> dict[str, tuple[Callable[[torch.Tensor], Any], bool]]:
    """Each way as (function, whether it takes channels_last inputs)."""
    from hapi.server.chunks._compiled import compile_head

    last = copy.deepcopy(head).to(memory_format=torch.channels_last)
    return {
        "eager": (head, False),
        "channels_last": (last, True),
        "compiled": (torch.compile(copy.deepcopy(head)), False),
        "compiled, frozen": (compile_head(copy.deepcopy(head)), False),
        "bf16": (_bf16(head), False),
        # As the server runs it: the compiled head called under autocast.
        "bf16 frozen": (_bf16(compile_head(copy.deepcopy(head))), False),
    }


def _time(fn: Callable[[torch.Tensor], Any], x: torch.Tensor) -> float:
    """Milliseconds a sample: the median of `RUNS` runs."""
    times = []
    for _ in range(RUNS):
        t0 = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / len(x) * 1e3


def speed(model: str, repeats: int) -> dict[str, Any]:
    head = _head({"name": model}, 112)
    ways = _ways(head)
    x = _inputs(BATCH, 112)
    xl = x.contiguous(memory_format=torch.channels_last)
    first: dict[str, float] = {}
    with torch.inference_mode():
        for name, (fn, last) in ways.items():
            t0 = time.perf_counter()
            fn(xl if last else x)  # compiles the compiled ways; warms the others
            first[name] = time.perf_counter() - t0
        per_way: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(repeats):
            for name, (fn, last) in ways.items():
                per_way[name].append(_time(fn, xl if last else x))
    ms = {name: statistics.median(v) for name, v in per_way.items()}
    return {
        "ms": ms,
        "ratio": {name: ms[name] / ms["eager"] for name in ways},
        "first_call_s": first,
    }


def error(spec: dict[str, Any], side: int) -> dict[str, float]:
    """The largest difference from eager fp32, over the largest fp32 value, per way."""
    from hapi.server.chunks._compiled import compile_head

    head = _head(spec, side)
    x = _inputs(8, side)
    with torch.inference_mode():
        ref = head(x).float()
        scale = ref.abs().max().item()
        got = {
            "bf16": _bf16(head)(x).float(),
            # Fresh copies (the same seed): a traced head that has run does not deepcopy.
            "compiled": torch.compile(_head(spec, side))(x).float(),
            "compiled, frozen": compile_head(_head(spec, side))(x).float(),
        }
    return {name: (y - ref).abs().max().item() / scale for name, y in got.items()}


def report(data: dict[str, Any]) -> str:
    lines = [
        "Milliseconds a sample (batches of 32, 112 px, one pinned core, one torch thread; "
        f"medians of {data['repeats']} interleaved repeats of {RUNS} runs), and each way "
        "against eager fp32 (goal for a compiled or bf16 head: <= 0.75x):",
        "",
        "| model | " + " | ".join(WAYS) + " |",
        "|---|" + "---|" * len(WAYS),
    ]
    for model, row in data["speed"].items():
        cells = [f"{row['ms'][w]:.2f} ({row['ratio'][w]:.2f}x)" for w in WAYS]
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    compiles = "; ".join(
        f"{model} " + ", ".join(f"{w} {row['first_call_s'][w]:.0f} s" for w in COMPILED)
        for model, row in data["speed"].items()
    )
    errors = data["error"]
    bf16 = ", ".join(f"{model} {row['bf16']:.2%}" for model, row in errors.items())
    frozen = ", ".join(f"{model} {row['compiled, frozen']:.1e}" for model, row in errors.items())
    worst = max(row["compiled"] for row in errors.values())
    lines += [
        "",
        f"The first call of each compiled way, which compiles it (cold, one core): {compiles}.",
        "",
        "Features against eager fp32 (the largest difference over the largest value, at each "
        f"model's last frozen cut, 8 photo-like inputs): bf16 {bf16}; compiled fp32 at most "
        f"{worst:.1e}; compiled with freezing {frozen} (`TOLERANCE`: 1e-4).",
    ]
    return "\n".join(lines)


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    models = list(data["speed"])
    width = 0.8 / len(WAYS)
    for i, way in enumerate(WAYS):
        values = [data["speed"][m]["ratio"][way] for m in models]
        bars = ax.bar([j + i * width for j in range(len(models))], values, width, label=way)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(0.75, color="gray", linestyle="--", linewidth=1, label="goal (0.75x)")
    ax.set_xticks([j + width * (len(WAYS) - 1) / 2 for j in range(len(models))], models)
    ax.set_ylabel("time a sample / eager fp32")
    ax.set_title("a frozen head at 112 px, batch 32, one core", fontsize=10)
    ax.set_ylim(0, 1.4)  # room for the legend above the bars
    ax.legend(fontsize=7, ncol=3, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--results", action="store_true", help="write RESULTS.md's section")
    args = parser.parse_args()
    # A cold compile, as a fresh server's: inductor keeps what it compiled on disk.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="hapi-inductor-")
    pin(1)
    torch.set_num_threads(1)
    data: dict[str, Any] = {"machine": machine(), "repeats": args.repeats}
    data["speed"] = {m: speed(m, args.repeats) for m in SPEED_MODELS}
    data["error"] = {name: error(spec, side) for name, (spec, side) in ERROR_MODELS.items()}
    OUT.mkdir(exist_ok=True)
    (OUT / "heads.json").write_text(json.dumps(data, indent=1))
    plot(data, OUT / "heads.png")
    text = report(data)
    print(text)
    if args.results:
        write_results(data, text)


def write_results(data: dict[str, Any], text: str) -> None:
    """This benchmark's section of RESULTS.md."""
    write_section(
        "heads",
        "## A frozen head: eager, compiled, bf16 (`benchmarks/heads.py`)\n\n"
        f"`python benchmarks/heads.py --results` on {data['machine']}.\n\n{text}\n\n"
        "![each way against eager](out/heads.png)",
    )


if __name__ == "__main__":
    main()
